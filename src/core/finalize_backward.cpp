#include "core/finalize_backward.h"

#include <fsdp/error.h>
#include <torch/csrc/autograd/graph_task.h>

#include "core/call_agreement.h"
#include "core/context.h"
#include "core/group.h"

namespace fsdp::detail {

void finalize_backward(Context& ctx) {
  Group* root = ctx.root();
  FSDP_CHECK(
      !ctx.in_forward() && torch::autograd::get_current_graph_task_nodes_in_graph() == nullptr,
      "finalize_backward(", root ? root->name() : "",
      "): called inside a forward or a backward; call it after the step's last backward returned, "
      "before the optimizer step");
  ctx.calls().explicit_collective(CallAgreement::Explicit::kFinalizeBackward);
  const auto& groups = ctx.groups();
  std::vector<bool> syncing, holdings;
  for (Group* g : groups) {
    syncing.push_back(g->requires_gradient_sync() && g->has_trainable());
    holdings.push_back(syncing.back() && g->holds_gradients());
  }
  // Ranks whose gradient sync differs stop here, by name. [Note: parameters that got no
  // gradient] A group no rank holds gradients for is not reduced.
  const auto held = ctx.calls().agree_finalize(syncing, holdings);
  // Registration order (children first, the root last): the same on every rank and replica. The
  // reduce-scatters are all issued before the first is waited; HSDP's all-reduces follow in order.
  std::vector<PendingReduce> pending;
  for (size_t k = 0; k < groups.size(); ++k)
    if (syncing[k] && held[k]) {
      ctx.agreement().on_reduce(static_cast<int>(k), groups[k]->flat_numel(),
                                ctx.replicate_lane() && !groups[k]->all_reduces());
      pending.push_back(groups[k]->issue_reduce_scatter());
    }
  for (auto& p : pending) p.group->finish_reduce(p);
  // Agreed over these reductions, and the shards' gradients settled.
  ctx.check_agreement_and_settle();
  for (Group* g : groups)
    if (g->reshard_after_backward()) g->reshard();
  ctx.log(root, "finalize_backward: accumulated gradients reduced");
}

}  // namespace fsdp::detail
