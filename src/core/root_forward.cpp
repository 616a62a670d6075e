// Root: a forward call of one of its groups, in run order. [Note: calls that differ between ranks]
// When every rank makes the same calls, a call's gathers are issued directly (its own, then its
// prefetch), the same on every rank by construction; inside the forward of a module declared
// calls_may_differ, each through a round.
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>

#include "core/binding.h"
#include "core/buffers.h"
#include "core/hooks.h"
#include "core/root.h"

namespace fsdp::detail {
namespace {
// A forward called from inside a backward (a hook, a recomputation): no rounds there; its gathers
// are issued directly.
bool in_backward() { return torch::autograd::get_current_graph_task_nodes_in_graph() != nullptr; }
}  // namespace

bool Root::in_forward() const {
  return std::any_of(order_.begin(), order_.end(), [](const Group* g) { return g->in_forward(); });
}

void Root::pre_forward(Group& g) {
  EntryLock lock(mu_);
  const bool top_level = !in_forward() && !in_backward();
  g.check_materialized();  // before any state changes: the module stays usable after the error
  FSDP_CHECK(!g.is_list() || !g.is_root(), "sharded module list ", g.type_name(),
             " was called with no sharded parent: a module list is one group inside a model "
             "and cannot be its root. Fix: fully_shard the model that holds its modules (its "
             "root) after the list, before the first forward");
  start_iteration_if_new(g);
  if (top_level) ++epoch_;
  g.enter_forward();
  try {
    // The round that opens a top-level call comes before any other collective of the call, so
    // that ranks whose top-level calls differ stop there, naming both calls.
    if (top_level) begin_top_level(g);
    if (top_level && g.is_root()) {
      if (g.options().runtime.broadcast_buffers) broadcast_buffers();
      gather_elements();
    }
    // A module whose forward's calls may differ begins its region before its own gather: what
    // each rank prefetches with it comes from that rank's own last iteration inside the region.
    if (g.calls_may_differ() && !in_backward() && rounds_.active() && !g.is_list()) ++region_depth_;
    gather_for_call(g);
    g.wait_for_unshard();
  } catch (...) {
    abort_forward_locked(g);
    throw;
  }
  g.note_call(at::GradMode::is_enabled());
}

void Root::start_iteration_if_new(Group& g) {
  // A backward that threw: the engine skips final callbacks then, so its pass was never
  // finalised. Its key (the task's address) may be reused by the next task: drop it now.
  if (drop_unfinished()) {
    ctx_.log(g.name(), "dropped the bookkeeping of a backward that did not complete");
    backward_done_ = true;
  }
  if (backward_done_ && !in_backward()) {
    backward_done_ = false;
    if (!forward_order_.empty()) last_forward_order_ = forward_order_;
    forward_order_.clear();
    completion_order_.clear();
    for (Group* x : order_) x->begin_iteration();
  }
  if (std::find(forward_order_.begin(), forward_order_.end(), &g) == forward_order_.end())
    forward_order_.push_back(&g);
  ctx_.log(g.name(), "pre_forward");
}

// [Note: stale gathered parameters] The ranks decide together, in the round that opens the call:
// a group is stale when some rank's shard changed since its gather, or when only some ranks hold
// it (one that does not hold it cannot tell whether its shard changed since the others gathered).
// The round also compares the calls_may_differ declarations, which decide the collectives.
void Root::begin_top_level(Group& g) {
  prefetched_.clear();
  protocol::Message m = message(protocol::Kind::kStart, g.index());
  std::vector<bool> declared;
  for (size_t k = 0; k < order_.size(); ++k) {
    declared.push_back(order_[k]->calls_may_differ());
    if (!order_[k]->held_from_earlier_epoch(epoch_)) continue;
    protocol::set_bit(m.held, k);
    if (order_[k]->changed_since_gather()) protocol::set_bit(m.changed, k);
  }
  m.digest = protocol::digest_of(protocol::bits_of(declared));
  const auto all = exchange(m);
  const auto stale = protocol::stale(m, all, order_.size());
  for (size_t k = 0; k < order_.size(); ++k) {
    if (!protocol::test_bit(m.held, k)) continue;
    if (stale[k])
      order_[k]->reshard();
    else
      order_[k]->mark_current(epoch_);
  }
}

void Root::broadcast_buffers() {
  // DDP's broadcast_buffers: rank 0's buffers (e.g. BatchNorm running statistics) on every rank,
  // before each forward of the root. Under HSDP, within the replica, then across replicas.
  torch::nn::Module& m = *root_group()->module();
  detail::broadcast_buffers(m, *ctx_.comm);
  if (ctx_.replicate) detail::broadcast_buffers(m, *ctx_.replicate);
}

// [Note: elements gathered on use] The root's forward issues every element's gather when it
// begins, in registration order (the same on every rank); a use of an element's parameter waits
// for its gather (use_element). They stay gathered until the end of the backward.
void Root::gather_elements() {
  for (Group* e : order_)
    if (e->gathers_on_use() && e->shard_state() == ShardState::kSharded) e->unshard(epoch_);
}

bool Root::use_element(Group& g) {
  EntryLock lock(mu_);
  Group* root = root_group();
  if (!g.gathers_on_use() || !root || !root->in_forward() ||
      g.shard_state() == ShardState::kSharded)
    return false;
  if (std::find(forward_order_.begin(), forward_order_.end(), &g) == forward_order_.end()) {
    forward_order_.push_back(&g);
    completion_order_.push_back(&g);
  }
  g.note_call(at::GradMode::is_enabled());
  g.wait_for_unshard();  // issued when the root's forward began: nothing is issued here
  return true;
}

void Root::gather_for_call(Group& g) {
  prefetched_.erase(std::remove(prefetched_.begin(), prefetched_.end(), &g), prefetched_.end());
  if (in_backward()) return g.unshard(epoch_);
  auto targets = forward_prefetch_targets(g);
  if (region_depth_ > 0) return round_for_call(g, std::move(targets));
  g.unshard(epoch_);
  for (Group* t : targets) {
    ctx_.log(t->name(), "forward prefetch");
    t->unshard(epoch_);
    prefetched_.push_back(t);
  }
}

// Inside a region whose calls may differ: one round gathers the union of what the ranks need now,
// then of what they would prefetch. A rank enters a round only when it has something to gather,
// so the k-th rounds of all ranks pair up whatever their calls were.
void Root::round_for_call(Group& g, std::vector<Group*> prefetch) {
  protocol::Message m = message(protocol::Kind::kCall, g.index());
  bool any = false;
  if (g.shard_state() == ShardState::kSharded) {
    protocol::set_bit(m.need, static_cast<size_t>(g.index()));
    any = true;
  }
  for (Group* t : prefetch) {
    protocol::set_bit(m.prefetch, static_cast<size_t>(t->index()));
    any = true;
  }
  if (any) issue_round(m, exchange(m));
}

void Root::issue_round(const protocol::Message& mine, const std::vector<protocol::Message>& all) {
  for (const auto& gather : protocol::gathers_of_round(mine, all, order_.size())) {
    Group* g = order_[gather.group];
    switch (gather.use) {
      case protocol::Gather::Use::kNeed:
        g->unshard(epoch_);
        break;
      case protocol::Gather::Use::kPrefetch:
        ctx_.log(g->name(), "forward prefetch");
        g->unshard(epoch_);
        prefetched_.push_back(g);
        break;
      case protocol::Gather::Use::kServe:
        g->serve_gather();
        break;
    }
  }
}

// The groups to prefetch when `g`'s forward call begins: the one after g in this rank's previous
// iteration, or g's explicit list; only those resharded here, and only with
// max_unsharded_groups >= 2.
std::vector<Group*> Root::forward_prefetch_targets(Group& g) {
  std::vector<Group*> targets;
  if (g.forward_prefetch_set()) {
    targets = g.forward_prefetch();
  } else {
    auto it = std::find(last_forward_order_.begin(), last_forward_order_.end(), &g);
    if (it != last_forward_order_.end() && it + 1 != last_forward_order_.end())
      targets.push_back(*(it + 1));
  }
  targets.erase(std::remove_if(targets.begin(), targets.end(),
                               [&](Group* t) {
                                 return t == &g || t->shard_state() != ShardState::kSharded ||
                                        t->options().runtime.max_unsharded_groups < 2;
                               }),
                targets.end());
  return targets;
}

at::Tensor Root::input(Group& g, const at::Tensor& input, const std::weak_ptr<Binding>& b) {
  const at::Tensor x = g.cast_input(input);
  if (!x.defined() || !x.requires_grad() || !at::GradMode::is_enabled()) return x;
  return hand_input(x, b);
}

void Root::post_forward(Group& g, const std::vector<at::Tensor>& outs,
                        const std::weak_ptr<Binding>& b) {
  EntryLock lock(mu_);
  g.rebase_modified_inputs();
  for (const auto& out : outs) {
    if (!out.defined() || !out.requires_grad() || !out.grad_fn()) continue;
    attach_output_hook(out, b);
    g.record_output_node(out.grad_fn());
  }
  completion_order_.erase(std::remove(completion_order_.begin(), completion_order_.end(), &g),
                          completion_order_.end());
  completion_order_.push_back(&g);
  const bool grad = at::GradMode::is_enabled();
  g.leave_forward();
  const bool outermost = g.training_state() == TrainingState::kIdle;  // not inside a backward
  // A module list waits for the end of the top-level forward (below): its other modules may come.
  if (g.resolved_reshard_after_forward() && outermost && !g.is_list())
    g.reshard_after_forward(grad);
  // Elements gathered in a forward without grad mode have no backward to wait for.
  if (g.is_root() && !grad)
    for (Group* e : order_)
      if (e->gathers_on_use() && e->training_state() == TrainingState::kIdle) e->reshard();
  const bool top_level_ends = outermost && !in_forward() && !in_backward();
  if (top_level_ends)
    for (Group* l : order_)
      if (l->is_list() && l->training_state() == TrainingState::kIdle &&
          l->shard_state() != ShardState::kSharded && l->resolved_reshard_after_forward())
        l->reshard_after_forward(grad);
  if (g.calls_may_differ() && region_depth_ > 0 && !in_backward() && !g.is_list()) end_region(g);
  if (top_level_ends) end_top_level();
  // Every forward of the root ends by checking that the ranks gathered the same groups, before a
  // backward could reduce into the wrong ones (core/agreed.h).
  if (g.is_root() && outermost) check_agreement();
  // A top-level call ends its epoch: user code (an optimizer step) may follow.
  if (top_level_ends) end_epoch();
}

// The region's forward returned: done rounds, serving the other ranks' needs, until a round in
// which every rank is done: all ranks leave the region together, with identical gather sequences.
void Root::end_region(Group& g) {
  --region_depth_;
  if (region_depth_ > 0) return;
  for (;;) {
    const protocol::Message m = message(protocol::Kind::kDone, g.index());
    const auto all = exchange(m);
    issue_round(m, all);
    if (protocol::all_done(all)) break;
  }
}

// Prefetched for a call this rank did not make: no longer needed.
void Root::end_top_level() {
  for (Group* t : prefetched_)
    if (t->shard_state() == ShardState::kGathering && t->training_state() == TrainingState::kIdle) {
      ctx_.log(t->name(), "forward prefetch unused: dropped");
      t->reshard();
    }
  prefetched_.clear();
}

void Root::end_epoch() {
  for (Group* g : order_) g->fingerprint_if_gathered();
}

void Root::abort_forward(Group& g) noexcept {
  try {
    EntryLock lock(mu_);
    abort_forward_locked(g);
  } catch (const std::exception& e) {
    TORCH_WARN("fsdp: while unwinding the failed forward of '", g.name(), "': ", e.what());
  }
}

void Root::abort_forward_locked(Group& g) noexcept {
  try {
    const bool was_region = g.in_forward() && g.calls_may_differ() && region_depth_ > 0;
    g.abort_forward();
    if (was_region) --region_depth_;
    g.reshard();
    // Gathers nobody will use: waited (the other ranks issued them too), then dropped.
    for (Group* x : order_)
      if (x->shard_state() == ShardState::kGathering && x->training_state() == TrainingState::kIdle)
        x->reshard();
    prefetched_.clear();
  } catch (const std::exception& e) {
    // The forward's own error is on its way out: this one is only reported.
    TORCH_WARN("fsdp: while unwinding the failed forward of '", g.name(), "': ", e.what());
  }
}

}  // namespace fsdp::detail
