// fully_shard: ownership checks, cross-rank agreement, group and context construction, and the
// FSDPModule / ForwardScope front ends.
#include <ATen/ATen.h>
#include <fsdp/fully_shard.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "comm/rank_agreement.h"
#include "core/buffers.h"
#include "core/context.h"
#include "core/deferred_init.h"
#include "core/group.h"
#include "util/checksum.h"

namespace fsdp {
namespace detail {

namespace {

// Which group manages a module or a parameter. Weak references keyed by identity: models and
// ranks in one process do not interfere, and entries die with their groups.
struct Registry {
  std::mutex mu;
  std::unordered_map<const torch::nn::Module*, std::weak_ptr<Group>> modules;
  std::unordered_map<const c10::TensorImpl*, std::weak_ptr<Group>> params;
  // Container elements (no holder owns their groups) until a sharded ancestor absorbs them.
  std::vector<std::shared_ptr<Group>> unowned_elements;

  template <class K>
  static std::shared_ptr<Group> find(std::unordered_map<const K*, std::weak_ptr<Group>>& m,
                                     const K* k) {
    auto it = m.find(k);
    if (it == m.end()) return nullptr;
    auto g = it->second.lock();
    if (!g) m.erase(it);
    return g;
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

std::string describe(const at::Tensor& t) {
  return detail::cat(t.sizes(), " ", t.scalar_type(), t.requires_grad() ? "" : " (frozen)");
}

// Every rank must build the same model: compares (name, shape, dtype, requires_grad) of the
// group's parameters with rank 0's and names the first difference on every rank.
void check_same_on_all_ranks(Communicator& comm, const std::string& module,
                             const std::vector<std::pair<std::string, at::Tensor>>& params) {
  if (comm.size() == 1) return;
  std::vector<int64_t> hashes;
  for (const auto& [name, t] : params) {
    const std::string text = name + "|" + describe(t);
    hashes.push_back(static_cast<int64_t>(checksum_bytes(text.data(), text.size()) >> 1));
  }
  const auto per_rank = all_gather_values(comm, hashes);
  const auto diff = first_difference_from_rank0(per_rank);
  if (!diff) return;
  const size_t first = diff->index;
  std::string counts;
  for (size_t r = 0; r < per_rank.size(); ++r)
    counts += detail::cat(r ? ", " : "", per_rank[r].size());
  std::string mine_desc = first < params.size() ? detail::cat("'", params[first].first, "' ",
                                                              describe(params[first].second))
                                                : "no such parameter";
  throw Error(detail::cat(
      "fully_shard(", module, "): the model differs across ranks at parameter #", first,
      " (first seen on rank ", diff->rank, "); on this rank (", comm.rank(), ") it is ", mine_desc,
      "; parameter counts per rank: ", counts,
      ". Every rank must construct the same model (same config, same parameter shapes) before "
      "fully_shard."));
}

// Every rank must start from the same values: broadcasts rank 0's (sync), or compares checksums
// with rank 0's and names the first parameter that differs, on every rank.
void agree_on_values(Communicator& comm, const std::string& module,
                     const std::vector<std::pair<std::string, at::Tensor>>& params, bool sync) {
  if (comm.size() == 1 || params.empty()) return;
  // Built under deferred_init: no values yet (materialize compares them across ranks).
  for (const auto& [name, t] : params)
    if (deferred::is_pending(t)) return;
  if (sync) {
    at::NoGradGuard no_grad;
    for (const auto& [name, t] : params) {
      at::Tensor wire = t.detach().contiguous();
      comm.broadcast(wire, 0).wait();
      if (!wire.is_same(t)) t.detach().copy_(wire);
    }
    return;
  }
  std::vector<at::Tensor> values;
  for (const auto& [name, t] : params) values.push_back(t);
  if (auto diff = first_value_difference(comm, values))
    throw Error(detail::cat(
        "fully_shard(", module, "): parameter '", params[diff->index].first,
        "' has different initial values on rank ", diff->rank, " than on rank 0 (this is rank ",
        comm.rank(),
        "). Every rank must start from the same weights: seed the random generator "
        "identically on every rank before building the model (torch::manual_seed), or set "
        "ShardOptions::sync_module_states = true to broadcast rank 0's values"));
}

// The groups at or below `g`'s module, in the context's registration order.
std::vector<Group*> groups_at_or_below(Group* g) {
  std::set<const torch::nn::Module*> below{g->module()};
  for (const auto& m : g->module()->modules(/*include_self=*/false)) below.insert(m.get());
  std::vector<Group*> out;
  for (Group* x : g->context().groups())
    if (below.count(x->module())) out.push_back(x);
  return out;
}

// The module's descendants by path, in the model's own module order: pointer order differs
// between processes, and the group order must be the same on every rank.
struct ModulePaths {
  std::map<const torch::nn::Module*, std::string> path_of;
  std::vector<const torch::nn::Module*> order;
};

ModulePaths module_paths(const torch::nn::Module& module) {
  ModulePaths m;
  for (const auto& item : module.named_modules("", /*include_self=*/false))
    if (m.path_of.emplace(item.value().get(), item.key()).second)
      m.order.push_back(item.value().get());
  return m;
}

// The parameters this fully_shard call manages: those no sharded descendant owns, each once (a
// parameter tied within the group counts once). A parameter shared with another group is an
// error naming both. REQUIRES: the registry's lock.
std::vector<std::pair<std::string, at::Tensor>> own_parameters(Registry& reg,
                                                               const torch::nn::Module& module,
                                                               const ModulePaths& paths) {
  const std::string type = module.name();
  std::vector<std::pair<std::string, at::Tensor>> mine;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    if (auto owner = Registry::find(reg.params, impl)) {
      auto p = paths.path_of.find(owner->module());
      if (p != paths.path_of.end()) {
        FSDP_CHECK(item.key().rfind(p->second + ".", 0) == 0, "parameter '", item.key(),
                   "' of module '", type, "' is also a parameter of sharded submodule '", p->second,
                   "' (", owner->type_name(),
                   "): a parameter shared by two groups cannot be sharded. Fix: do not "
                   "fully_shard '",
                   p->second,
                   "' separately, so that both uses fall in one group (shard their common parent)");
        continue;
      }
      bool owner_is_ancestor = false;
      for (const auto& m : owner->module()->modules(/*include_self=*/false))
        if (m.get() == &module) owner_is_ancestor = true;
      FSDP_CHECK(!owner_is_ancestor, "fully_shard(", type, ") was called after its parent (",
                 owner->type_name(),
                 ") was sharded: apply fully_shard bottom-up, children first, then the parent");
      throw Error(detail::cat("parameter '", item.key(), "' of module '", type,
                              "' is already managed by fully_shard on module '", owner->name(),
                              "' (", owner->type_name(),
                              "): a parameter shared by two groups cannot be sharded. Fix: shard "
                              "their common parent only, so that both uses fall in one group"));
    }
    if (!seen.insert(impl).second) continue;  // tied within this group: one parameter
    mine.emplace_back(item.key(), item.value());
  }
  return mine;
}

void check_placement(const std::string& type, const Communicator& comm,
                     const std::vector<std::pair<std::string, at::Tensor>>& mine) {
  for (const auto& [name, t] : mine) {
    FSDP_CHECK(t.device().is_cpu() || comm.backend() != "gloo", "parameter '", name, "' is on ",
               t.device(), " but the communicator uses gloo (CPU)");
    FSDP_CHECK(t.scalar_type() == mine.front().second.scalar_type(), "fully_shard(", type,
               "): parameter '", name, "' has dtype ", t.scalar_type(), " but '",
               mine.front().first, "' has ", mine.front().second.scalar_type(),
               "; parameters of one group must share a dtype (cast the module first)");
  }
}

// A new context holding every group registered on a descendant (with everything their contexts
// held), renamed by their path under this module. REQUIRES: the registry's lock.
std::shared_ptr<Context> absorb_children(Registry& reg, const ModulePaths& paths,
                                         const std::shared_ptr<Communicator>& comm,
                                         const std::shared_ptr<Communicator>& replicate,
                                         const ShardOptions& options) {
  auto context = std::make_shared<Context>(comm, replicate, options.audit);
  std::vector<std::shared_ptr<Context>> absorbed;
  for (const auto* m : paths.order) {
    auto g = Registry::find(reg.modules, m);
    if (!g) continue;
    auto old = g->shared_context();
    if (std::find(absorbed.begin(), absorbed.end(), old) == absorbed.end()) absorbed.push_back(old);
  }
  for (const auto& old : absorbed) {
    FSDP_CHECK(old->replicate() == replicate && &old->groups().front()->comm() == comm.get(),
               "fully_shard: sharded submodule '", paths.path_of.at(old->root()->module()),
               "' was sharded over a different communicator or mesh than its parent; shard "
               "every module of a model with the same communicator (or the same DeviceMesh)");
    if (old->audit().enabled) context->audit().enabled = true;
    for (Group* g : std::vector<Group*>(old->groups())) {
      g->set_path(paths.path_of.at(g->module()));
      g->set_context(context);
      context->add(g);
    }
  }
  return context;
}

// The container elements below `group`'s module that no sharded ancestor owned yet become owned
// by `group` (they live as long as it). REQUIRES: the registry's lock.
void adopt_elements(Registry& reg, Group& group) {
  std::set<const torch::nn::Module*> below;
  for (const auto& m : group.module()->modules(/*include_self=*/false)) below.insert(m.get());
  auto& v = reg.unowned_elements;
  for (auto it = v.begin(); it != v.end();) {
    if (below.count((*it)->module())) {
      group.own(*it);
      it = v.erase(it);
    } else {
      ++it;
    }
  }
}

// Buffers are replicated: rank 0's values win. Sharded children broadcast their own already.
void broadcast_own_buffers(Registry& reg, const torch::nn::Module& module, const ModulePaths& paths,
                           Communicator& comm) {
  std::vector<std::pair<std::string, at::Tensor>> own;
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    bool in_child = false;
    for (const auto& [m, path] : paths.path_of)
      if (Registry::find(reg.modules, m) && item.key().rfind(path + ".", 0) == 0) in_child = true;
    // A buffer built under deferred_init has no values yet: materialize fills it (and compares
    // it across ranks).
    if (in_child || !item.value().defined() || deferred::is_pending(item.value())) continue;
    own.emplace_back(item.key(), item.value());
  }
  broadcast_buffers(own, comm);
}

}  // namespace

FSDPModule fully_shard_impl(const std::shared_ptr<torch::nn::Module>& module,
                            std::shared_ptr<Communicator> comm,
                            std::shared_ptr<Communicator> replicate, const ShardOptions& options,
                            CallPath path) {
  FSDP_CHECK(module != nullptr, "fully_shard: the module is empty (construct it first)");
  FSDP_CHECK(comm != nullptr, "fully_shard: the communicator is null (call init_process_group)");
  const std::string type = module->name();
  auto& reg = registry();
  std::unique_lock<std::mutex> lock(reg.mu);
  if (Registry::find(reg.modules, module.get())) reject_second_fully_shard(*module);
  const ModulePaths paths = module_paths(*module);
  auto mine = own_parameters(reg, *module, paths);
  check_placement(type, *comm, mine);
  lock.unlock();
  check_same_on_all_ranks(*comm, type, mine);  // collectives: outside the lock
  agree_on_values(*comm, type, mine, options.sync_module_states);

  lock.lock();
  auto context = absorb_children(reg, paths, comm, replicate, options);
  std::vector<ParamState> params;
  for (auto& [name, t] : mine)
    params.emplace_back(name, t, comm->rank(), comm->size(), options.mixed_precision.param_dtype);
  auto group = std::make_shared<Group>(module.get(), type, std::move(params), comm, options);
  group->set_path("");
  group->set_context(context);
  context->add(group.get());
  if (context->groups().size() > 1) group->set_contains_groups();  // it absorbed sharded children
  group->attach_hooks();
  adopt_elements(reg, *group);
  if (path == CallPath::kGatherOnUse) {
    group->set_gathers_on_use();
    reg.unowned_elements.push_back(group);
  }
  reg.modules[module.get()] = group;
  for (const auto& p : group->params()) reg.params[p.param().unsafeGetTensorImpl()] = group;
  lock.unlock();

  broadcast_own_buffers(reg, *module, paths, *comm);
  context->log(group.get(), detail::cat("fully_shard: ", group->params().size(), " parameters, ",
                                        group->flat_numel(), " padded elements per rank"));
  return HandleAccess::make(group);
}

void reject_second_fully_shard(const torch::nn::Module& module) {
  throw Error(cat("fully_shard was applied twice to module '", module.name(),
                  "': apply it once per module (blocks first, then the root)"));
}

namespace deferred {
Communicator* deliver_to_shard(const at::Tensor& param, const at::Tensor& full) {
  auto& reg = registry();
  std::shared_ptr<Group> g;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    g = Registry::find(reg.params, param.unsafeGetTensorImpl());
  }
  if (!g) return nullptr;
  for (size_t i = 0; i < g->params().size(); ++i)
    if (g->params()[i].param().unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) {
      g->materialize_param(i, full);
      return &g->comm();
    }
  return nullptr;
}
}  // namespace deferred

// ---------------------------------------------------------------------------------------------
// ForwardScope
// ---------------------------------------------------------------------------------------------
ForwardScope::ForwardScope(Group* group) : group_(group) { group_->pre_forward(); }

ForwardScope::~ForwardScope() {
  if (!finished_) group_->abort_forward();
}

void ForwardScope::finish_tensors(const std::vector<at::Tensor>& outs) {
  group_->post_forward(outs);
  finished_ = true;
}

at::Tensor ForwardScope::input(const at::Tensor& x) { return group_->wrap_input(x); }

at::Tensor ForwardScope::output(const at::Tensor& y) { return group_->cast_output(y); }

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// FSDPModule
// ---------------------------------------------------------------------------------------------
namespace {
detail::Group& checked(const std::shared_ptr<detail::Group>& g) {
  FSDP_CHECK(g != nullptr, "this FSDPModule handle is empty: use the one fully_shard returned");
  return *g;
}
}  // namespace

std::vector<ShardInfo> FSDPModule::shards() const {
  auto& g = checked(group_);
  std::unordered_map<const c10::TensorImpl*, const detail::ParamState*> by_impl;
  for (detail::Group* x : detail::groups_at_or_below(&g))
    for (const auto& p : x->params()) by_impl[p.param().unsafeGetTensorImpl()] = &p;
  std::vector<ShardInfo> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : g.module()->named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    auto it = by_impl.find(impl);
    if (it == by_impl.end() || !seen.insert(impl).second) continue;
    const auto& p = *it->second;
    ShardInfo s;
    s.name = item.key();
    s.global_shape = p.param().sizes().vec();
    s.shard = p.shard();
    s.row_offset = p.row_offset();
    s.rows_per_rank = p.chunk();
    s.requires_grad = p.trainable();
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<at::Tensor> FSDPModule::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& s : shards()) out.push_back(s.shard);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPModule::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& s : shards()) out.emplace_back(s.name, s.shard);
  return out;
}

void FSDPModule::unshard() {
  auto& g = checked(group_);
  g.unshard();
  g.wait_for_unshard();
  g.context().end_epoch();  // user code follows
}

void FSDPModule::reshard() { checked(group_).reshard(); }

void FSDPModule::set_requires_gradient_sync(bool sync) {
  for (auto* g : detail::groups_at_or_below(&checked(group_))) g->set_requires_gradient_sync(sync);
}

void FSDPModule::set_reshard_after_backward(bool reshard) {
  for (auto* g : detail::groups_at_or_below(&checked(group_)))
    g->set_reshard_after_backward(reshard);
}

void FSDPModule::set_reshard_after_forward(bool reshard) {
  checked(group_).set_reshard_after_forward(reshard);
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  std::vector<detail::Group*> targets;
  for (auto& m : modules) targets.push_back(&checked(m.group_));
  checked(group_).set_forward_prefetch(std::move(targets));
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  std::vector<detail::Group*> targets;
  for (auto& m : modules) targets.push_back(&checked(m.group_));
  checked(group_).set_backward_prefetch(std::move(targets));
}

FSDPModule::MemoryStats FSDPModule::memory_stats() const {
  auto& c = checked(group_).context();
  MemoryStats s;
  s.unsharded_bytes = c.unsharded_bytes();
  s.peak_unsharded_bytes = c.peak_unsharded_bytes();
  s.unsharded_groups = c.unsharded_groups();
  s.peak_unsharded_groups = c.peak_unsharded_groups();
  s.buffer_bytes_in_use = c.pool().in_use_bytes();
  s.buffer_bytes_idle = c.pool().idle_bytes();
  s.peak_buffer_bytes_in_use = c.pool().peak_in_use_bytes();
  return s;
}

void FSDPModule::reset_memory_peaks() { checked(group_).context().reset_peaks(); }

const std::string& FSDPModule::name() const { return checked(group_).name(); }

Communicator& FSDPModule::communicator() const { return checked(group_).comm(); }

const std::shared_ptr<Communicator>& FSDPModule::replicate_communicator() const {
  return checked(group_).context().replicate();
}

}  // namespace fsdp
