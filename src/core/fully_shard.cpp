// fully_shard: a module's parameters claimed in the registry, checked across ranks, and given a
// group in a context that absorbs the groups of its sharded descendants.
#include <fsdp/fully_shard.h>
#include <torch/nn/module.h>

#include "core/buffers.h"
#include "core/context.h"
#include "core/group.h"
#include "core/model_agreement.h"
#include "core/registry.h"

namespace fsdp::detail {

namespace {
void check_placement(const std::string& type, const Communicator& comm, const NamedTensors& mine) {
  for (const auto& [name, t] : mine) {
    FSDP_CHECK(t.device().is_cpu() || comm.backend() != "gloo", "parameter '", name, "' is on ",
               t.device(), " but the communicator uses gloo (CPU)");
    FSDP_CHECK(t.scalar_type() == mine.front().second.scalar_type(), "fully_shard(", type,
               "): parameter '", name, "' has dtype ", t.scalar_type(), " but '",
               mine.front().first, "' has ", mine.front().second.scalar_type(),
               "; parameters of one group must share a dtype (cast the module first)");
  }
}

}  // namespace

FSDPModule fully_shard_impl(const std::shared_ptr<torch::nn::Module>& module,
                            std::shared_ptr<Communicator> comm,
                            std::shared_ptr<Communicator> replicate, const ShardOptions& options,
                            CallPath path) {
  FSDP_CHECK(module != nullptr, "fully_shard: the module is empty (construct it first)");
  FSDP_CHECK(comm != nullptr, "fully_shard: the communicator is null (call init_process_group)");
  const std::string type = module->name();
  auto& reg = Registry::instance();
  if (reg.is_sharded(*module)) reject_second_fully_shard(*module);
  const ModulePaths paths = module_paths(*module);
  auto mine = reg.claim_parameters(*module, paths);
  check_placement(type, *comm, mine);
  check_same_model(*comm, type, mine);
  agree_on_values(*comm, type, mine, options.sync_module_states);

  auto context = reg.absorb_children(paths, comm, replicate, options);
  std::vector<ParamState> params;
  for (auto& [name, t] : mine)
    params.emplace_back(name, t, comm->rank(), comm->size(), options.mixed_precision.param_dtype);
  auto group = std::make_shared<Group>(module.get(), type, std::move(params), comm, options);
  group->set_path("");
  group->set_context(context);
  context->add(group.get());
  if (context->groups().size() > 1) group->set_contains_groups();  // it absorbed sharded children
  group->attach_hooks();
  if (path == CallPath::kGatherOnUse) group->set_gathers_on_use();
  reg.add(group);
  // Buffers are replicated: rank 0's values win. Sharded children broadcast their own already.
  broadcast_buffers(reg.own_buffers(*module, paths), *comm);
  context->log(group.get(), detail::cat("fully_shard: ", group->params().size(), " parameters, ",
                                        group->flat_numel(), " padded elements per rank"));
  return HandleAccess::make(group);
}

void reject_second_fully_shard(const torch::nn::Module& module) {
  throw Error(cat("fully_shard was applied twice to module '", module.name(),
                  "': apply it once per module (blocks first, then the root)"));
}

}  // namespace fsdp::detail
