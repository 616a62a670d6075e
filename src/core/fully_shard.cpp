// fully_shard: a module's parameters claimed in the registry, checked across ranks, and given a
// group in a context that absorbs the groups of its sharded descendants.
#include <fsdp/fully_shard.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "comm/rank_agreement.h"
#include "core/binding.h"
#include "core/buffers.h"
#include "core/group.h"
#include "core/hooks.h"
#include "core/model_agreement.h"
#include "core/registry.h"
#include "core/root.h"

namespace fsdp::detail {

namespace {
void check_placement(const std::string& type, const Communicator& comm, const NamedTensors& mine) {
  for (const auto& [name, t] : mine) {
    FSDP_CHECK(t.device().is_cpu() || comm.backend() != "gloo", "parameter '", name, "' is on ",
               t.device(), " but the communicator uses gloo (CPU)");
    FSDP_CHECK(t.device() == mine.front().second.device(), "fully_shard(", type, "): parameter '",
               name, "' is on ", t.device(), " but '", mine.front().first, "' is on ",
               mine.front().second.device(),
               "; parameters of one group must share a device (move the module first)");
    FSDP_CHECK(t.scalar_type() == mine.front().second.scalar_type(), "fully_shard(", type,
               "): parameter '", name, "' has dtype ", t.scalar_type(), " but '",
               mine.front().first, "' has ", mine.front().second.scalar_type(),
               "; parameters of one group must share a dtype (cast the module first)");
  }
}

// reshard_after_forward = k: a positive divisor of the shard group's size.
void check_reshard_after_forward(const std::string& type, const Communicator& comm,
                                 const ShardOptions& options) {
  if (!options.reshard_after_forward || options.reshard_after_forward->is_bool()) return;
  const int k = options.reshard_after_forward->world();
  FSDP_CHECK(k >= 1 && comm.size() % k == 0, "fully_shard(", type, "): reshard_after_forward = ", k,
             " is not a world size that divides the shard group's ", comm.size(),
             " ranks. After forward each rank keeps 1/k of the parameters and backward gathers "
             "them within k consecutive ranks, so k must divide ",
             comm.size(), ". Fix: pass a divisor of ", comm.size(),
             " (the ranks of one host, say), or true / false");
}

// ShardOptions::shard_placement_fn: each parameter's shard dim, normalised to [0, dim).
std::vector<int64_t> shard_dims(const std::string& type, const NamedTensors& mine,
                                const ShardOptions& options) {
  std::vector<int64_t> dims;
  for (const auto& [name, t] : mine) {
    std::optional<Shard> placement;
    try {
      if (options.shard_placement_fn) placement = options.shard_placement_fn(name, t);
    } catch (const std::exception& e) {
      throw Error(cat("fully_shard(", type, "): shard_placement_fn threw for parameter '", name,
                      "' (shape ", t.sizes(), "): ", e.what(),
                      ". Fix: return fsdp::Shard{dim} or std::nullopt for every parameter"));
    }
    int64_t d = placement ? placement->dim : 0;
    const int64_t n = t.dim();
    FSDP_CHECK(n > 0 || d == 0, "fully_shard(", type, "): shard_placement_fn gave Shard(", d,
               ") for '", name,
               "', a 0-d parameter (a scalar): it can only be split as one row. "
               "Fix: return std::nullopt for it");
    FSDP_CHECK(n == 0 || (d >= -n && d < n), "fully_shard(", type,
               "): shard_placement_fn gave Shard(", d, ") for '", name, "' of shape ", t.sizes(),
               ", which has no dim ", d, ". Fix: return a dim in [", -n, ", ", n,
               ") (negative counts from the end), or "
               "std::nullopt for dim 0");
    dims.push_back(d < 0 ? d + n : d);
  }
  return dims;
}

// MixedPrecisionPolicy: each parameter's compute dtype (std::nullopt: its own), param_dtype unless
// param_dtype_override_fn keeps the parameter's own. Only floating-point parameters are cast.
std::vector<std::optional<at::ScalarType>> compute_dtypes(const std::string& type,
                                                          const NamedTensors& mine,
                                                          const MixedPrecisionPolicy& mp) {
  std::vector<std::optional<at::ScalarType>> out;
  for (const auto& [name, t] : mine) {
    std::optional<at::ScalarType> dtype = mp.param_dtype;
    if (mp.param_dtype_override_fn && at::isFloatingType(t.scalar_type())) {
      std::optional<at::ScalarType> given;
      try {
        given = mp.param_dtype_override_fn(name, t);
      } catch (const std::exception& e) {
        throw Error(cat("fully_shard(", type, "): param_dtype_override_fn threw for parameter '",
                        name, "' (", t.scalar_type(), "): ", e.what(),
                        ". Fix: return a dtype or std::nullopt for every parameter"));
      }
      FSDP_CHECK(!given || *given == t.scalar_type() || *given == mp.param_dtype, "fully_shard(",
                 type, "): param_dtype_override_fn gave ", *given, " for '", name, "', a ",
                 t.scalar_type(), " parameter, with param_dtype ",
                 mp.param_dtype ? c10::toString(*mp.param_dtype) : "unset",
                 ". Fix: return the parameter's own dtype (", t.scalar_type(),
                 ") to keep it, or std::nullopt for param_dtype; no other dtype is supported");
      if (given) dtype = *given;
    }
    if (dtype && (*dtype == t.scalar_type() || !at::isFloatingType(t.scalar_type())))
      dtype = std::nullopt;
    out.push_back(dtype);
  }
  return out;
}

// hpZ's post-forward lane: this rank's k consecutive ranks of `comm`, one communicator per
// (communicator, k), shared by the groups that use it (Communicator::lane caches it). Every rank
// calls fully_shard with the same options in the same order, so every rank creates the same lanes
// in the same order.
std::shared_ptr<Communicator> post_forward_lane(const std::shared_ptr<Communicator>& comm,
                                                const ShardOptions& options) {
  if (!options.reshard_after_forward) return nullptr;
  const int k = options.reshard_after_forward->world();
  if (k <= 1 || k == comm->size()) return nullptr;  // false, true, or true by another name
  std::vector<int> ranks;
  for (int r = comm->rank() / k * k, end = r + k; r < end; ++r) ranks.push_back(r);
  return comm->lane(cat("post_forward", k), ranks);
}

// ShardOptions::gather_transform_fn: each parameter's transform (null: the plain gather).
std::vector<std::shared_ptr<GatherTransform>> gather_transforms(const std::string& type,
                                                                const NamedTensors& mine,
                                                                const ShardOptions& options) {
  std::vector<std::shared_ptr<GatherTransform>> out;
  for (const auto& [name, t] : mine) {
    if (!options.gather_transform_fn) {
      out.emplace_back();
      continue;
    }
    try {
      out.push_back(options.gather_transform_fn(name, t));
    } catch (const std::exception& e) {
      throw Error(cat("fully_shard(", type, "): gather_transform_fn threw for parameter '", name,
                      "' (shape ", t.sizes(), "): ", e.what(),
                      ". Fix: return a transform or nullptr for every parameter"));
    }
  }
  return out;
}

// What fully_shard makes of its parameters: their states (shard dims, compute dtypes) and gather
// transforms, from the user's functions.
struct Placement {
  std::vector<ParamState> params;
  std::vector<std::shared_ptr<GatherTransform>> transforms;
};

Placement place_parameters(const std::string& type, const NamedTensors& mine,
                           const std::shared_ptr<Communicator>& comm,
                           const std::shared_ptr<Communicator>& replicate,
                           const ShardOptions& options) {
  // An error of the user's functions (shard_placement_fn, param_dtype_override_fn,
  // gather_transform_fn) on one rank stops every rank (the others would wait in the next
  // collective).
  std::vector<int64_t> dims;
  std::vector<std::optional<at::ScalarType>> dtypes;
  Placement out;
  const std::string error = error_of([&] {
    dims = shard_dims(type, mine, options);
    dtypes = compute_dtypes(type, mine, options.mixed_precision);
    out.transforms = gather_transforms(type, mine, options);
  });
  // On every rank, whether or not it has the functions: a rank given one where another is not
  // still meets the others here (and check_same_model compares their answers). Under HSDP across
  // the replicas too.
  raise_together(*comm, replicate.get(), error, cat("fully_shard(", type, ")"));
  check_same_model(*comm, type, mine, dims, dtypes);
  agree_on_values(*comm, type, mine, options.runtime.sync_module_states);
  for (size_t i = 0; i < mine.size(); ++i)
    out.params.emplace_back(mine[i].first, mine[i].second, dims[i], comm->rank(), comm->size(),
                            options.offload_policy, dtypes[i]);
  return out;
}

}  // namespace

ShardOptions resolved_options(ShardOptions o) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  o.runtime.activation_checkpointing |= o.activation_checkpointing;
  o.runtime.broadcast_buffers |= o.broadcast_buffers;
  o.runtime.sync_module_states |= o.sync_module_states;
  if (o.max_unsharded_groups) o.runtime.max_unsharded_groups = *o.max_unsharded_groups;
  o.debug.audit |= o.audit;
#pragma GCC diagnostic pop
  return o;
}

namespace {

[[noreturn]] void reject_second_fully_shard(const torch::nn::Module& module) {
  throw Error(cat("fully_shard was applied twice to module '", module.name(),
                  "': apply it once per module (blocks first, then the root)"));
}

}  // namespace

FSDPModule fully_shard_impl(const std::shared_ptr<torch::nn::Module>& module,
                            std::shared_ptr<Communicator> comm,
                            std::shared_ptr<Communicator> replicate, const ShardOptions& given,
                            CallPath path, const std::vector<torch::nn::Module*>& members) {
  const ShardOptions options = resolved_options(given);
  FSDP_CHECK(module != nullptr, "fully_shard: the module is empty (construct it first)");
  FSDP_CHECK(comm != nullptr, "fully_shard: the communicator is null (call init_process_group)");
  const std::string type = module->name();
  auto& reg = Registry::instance();
  if (reg.is_sharded(*module)) reject_second_fully_shard(*module);
  check_reshard_after_forward(type, *comm, options);
  const ModulePaths paths = module_paths(*module);
  // Here rather than at the first forward, where ranks whose calls differ would not all see it.
  if (options.runtime.activation_checkpointing)
    for (const auto* m : paths.order)
      FSDP_CHECK(!reg.is_sharded(*m), "activation checkpointing on '", type,
                 "': it contains the sharded module '", paths.path_of.at(m), "' (", m->name(),
                 "), whose hooks would run again during backward's recomputation. Checkpoint the "
                 "innermost sharded modules instead (e.g. each block), not their parent");
  auto mine = reg.claim_parameters(*module, paths, options.ignored_params);
  check_placement(type, *comm, mine);
  Placement placed = place_parameters(type, mine, comm, replicate, options);
  auto root = reg.absorb_children(paths, comm, replicate, options);
  auto group = std::make_shared<Group>(module.get(), type, std::move(placed.params), comm, options,
                                       std::move(placed.transforms));
  if (!members.empty()) group->set_members(module, members);
  group->set_post_forward_lane(post_forward_lane(comm, options));
  group->set_path("");
  if (path == CallPath::kGatherOnUse) group->set_gathers_on_use();
  root->add(group);
  auto binding = std::make_shared<Binding>(Binding{group, root, {}});
  attach_param_hooks(binding);
  reg.add(binding);
  // Buffers are replicated: rank 0's values win. Sharded children broadcast their own already.
  broadcast_buffers(reg.own_buffers(*module, paths), *comm);
  root->comm_context().log(group->name(),
                           cat("fully_shard: ", group->params().size(), " parameters, ",
                               group->flat_numel(), " padded elements per rank"));
  return HandleAccess::make(binding);
}

// A container holds the modules as "0", "1", ... and is sharded as one module; the group keeps
// it and knows its members, whose holders all call it.
FSDPModule fully_shard_list(const std::vector<ShardedRef>& modules,
                            std::shared_ptr<Communicator> comm,
                            std::shared_ptr<Communicator> replicate, const ShardOptions& options) {
  FSDP_CHECK(!modules.empty(),
             "fully_shard: the list of modules is empty; pass the modules to shard together");
  std::string type;
  std::vector<torch::nn::Module*> members;
  for (size_t k = 0; k < modules.size(); ++k) {
    const auto& m = HandleAccess::module(modules[k]);
    FSDP_CHECK(m != nullptr, "fully_shard: module #", k,
               " of the list is empty (construct it first)");
    if (HandleAccess::sharded(modules[k]) || Registry::instance().is_sharded(*m))
      reject_second_fully_shard(*m);
    for (size_t j = 0; j < k; ++j) {
      FSDP_CHECK(members[j] != m.get(), "fully_shard: module '", m->name(),
                 "' is in the list twice (#", j, " and #", k, "); list each module once");
      for (const auto& d : m->modules(/*include_self=*/false))
        FSDP_CHECK(d.get() != members[j], "fully_shard: module #", j, " of the list ('",
                   members[j]->name(), "') lies inside module #", k, " ('", m->name(),
                   "'); list modules that do not contain each other (the outer one's group would "
                   "hold it)");
      for (const auto& d : members[j]->modules(/*include_self=*/false))
        FSDP_CHECK(d.get() != m.get(), "fully_shard: module #", k, " of the list ('", m->name(),
                   "') lies inside module #", j, " ('", members[j]->name(),
                   "'); list modules that do not contain each other (the outer one's group would "
                   "hold it)");
    }
    members.push_back(m.get());
    type += (k ? ", " : "") + m->name();
  }
  if (modules.size() == 1) {
    auto handle = fully_shard_impl(HandleAccess::module(modules[0]), std::move(comm),
                                   std::move(replicate), options, CallPath::kHolder);
    HandleAccess::attach_ref(modules[0], handle);
    return handle;
  }
  auto list = std::make_shared<torch::nn::Module>("ModuleList(" + type + ")");
  for (size_t k = 0; k < modules.size(); ++k)
    list->register_module(std::to_string(k), HandleAccess::module(modules[k]));
  auto handle = fully_shard_impl(list, std::move(comm), std::move(replicate), options,
                                 CallPath::kHolder, members);
  for (const auto& m : modules) HandleAccess::attach_ref(m, handle);
  return handle;
}

}  // namespace fsdp::detail

namespace fsdp {

FSDPModule fully_shard(const std::vector<ShardedRef>& modules, std::shared_ptr<Communicator> comm,
                       const ShardOptions& options) {
  FSDP_CHECK(comm != nullptr, "fully_shard: the communicator is null (call init_process_group)");
  return detail::fully_shard_list(modules, std::move(comm), nullptr, options);
}

FSDPModule fully_shard(const std::vector<ShardedRef>& modules, const DeviceMesh& mesh,
                       const ShardOptions& options) {
  FSDP_CHECK(mesh.shard != nullptr,
             "fully_shard: the DeviceMesh is empty (build it with init_mesh)");
  return detail::fully_shard_list(modules, mesh.shard, mesh.replicate, options);
}

}  // namespace fsdp
