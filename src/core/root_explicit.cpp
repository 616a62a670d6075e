// Root: the explicit calls every rank makes at the same point (FSDPModule::unshard, reshard and
// finalize_backward, and the rounds that open clip_grad_norm_, state dicts and checkpoints).
#include <fsdp/error.h>
#include <torch/csrc/autograd/graph_task.h>

#include "core/root.h"

namespace fsdp::detail {

void Root::unshard(Group& g, bool wait) {
  EntryLock lock(mu_);
  protocol::Message m = message(protocol::Kind::kUnshard, g.index());
  if (g.shard_state() == ShardState::kSharded)
    protocol::set_bit(m.need, static_cast<size_t>(g.index()));
  issue_round(m, exchange(m));
  if (!wait) return;
  g.wait_for_unshard();
  end_epoch();  // user code follows
}

void Root::wait_for_unshard(Group& g) {
  EntryLock lock(mu_);
  // Resharded since, or already waited (by the module's forward): nothing in flight.
  if (g.shard_state() != ShardState::kGathering) return;
  g.wait_for_unshard();
  end_epoch();  // user code follows
}

void Root::reshard(Group& g) {
  EntryLock lock(mu_);
  g.reshard();
}

void Root::explicit_collective(protocol::Explicit what) {
  EntryLock lock(mu_);
  exchange(message(protocol::Kind::kExplicit, static_cast<int64_t>(what)));
}

void Root::rebind_replicate(std::shared_ptr<Communicator> r) {
  EntryLock lock(mu_);
  FSDP_CHECK(!in_forward() && passes_.empty() &&
                 torch::autograd::get_current_graph_task_nodes_in_graph() == nullptr,
             "set_replicate_communicator: called inside a forward or a backward; call it between "
             "steps (after the optimizer step, or after the step's gradients were thrown away)");
  ctx_.rebind_replicate(std::move(r));
}

// FSDP2's finalize_backward: reduces outside any backward what backwards without gradient sync
// accumulated. The ranks first agree (an explicit collective's round, then the groups reduced by
// their sync settings, which must match, and those each rank holds gradients for: a group none
// holds any for is not reduced); then every reduced group reduce-scatters in registration order
// (children first, the root last: the same on every rank and replica), the Agreed check settles
// the shards' gradients ([Note: parameters that got no gradient]) and the groups reshard.
void Root::finalize_backward() {
  explicit_collective(protocol::Explicit::kFinalizeBackward);
  EntryLock lock(mu_);
  Group* root = root_group();
  FSDP_CHECK(!in_forward() && torch::autograd::get_current_graph_task_nodes_in_graph() == nullptr,
             "finalize_backward(", root ? root->name() : "",
             "): called inside a forward or a backward; call it after the step's last backward "
             "returned, before the optimizer step");
  std::vector<bool> syncing, holdings;
  for (Group* g : order_) {
    syncing.push_back(
        protocol::reduces(true, g->requires_gradient_sync(), g->has_trainable(), true));
    holdings.push_back(syncing.back() && g->holds_gradients());
  }
  protocol::Message m =
      message(protocol::Kind::kFinalize, std::count(syncing.begin(), syncing.end(), true));
  m.need = protocol::bits_of(syncing);
  m.digest = protocol::digest_of(m.need);
  m.held = protocol::bits_of(holdings);
  protocol::Bits held(m.held.size(), 0);
  for (const auto& o : exchange(m))
    for (size_t i = 0; i < held.size(); ++i) held[i] |= o.held[i];
  // HSDP: the all-reduces across replicas follow, so the replicas decide alike too.
  for (const auto& r : rounds_.across_replicas({held.begin(), held.end()}))
    for (size_t i = 0; i < held.size(); ++i) held[i] |= static_cast<uint64_t>(r[i]);
  std::vector<std::pair<Group*, PendingReduce>> pending;
  for (size_t k = 0; k < order_.size(); ++k)
    if (syncing[k] && protocol::test_bit(held, k))
      pending.emplace_back(order_[k], order_[k]->issue_reduce_scatter());
  for (auto& [g, p] : pending) g->finish_reduce(p);
  check_agreement_and_settle();
  for (Group* g : order_)
    if (g->reshard_after_backward()) g->reshard();
  ctx_.log(root ? root->name() : "-", "finalize_backward: accumulated gradients reduced");
}

}  // namespace fsdp::detail
