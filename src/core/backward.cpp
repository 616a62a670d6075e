// Backward: the post-backward guarantee and agreement on both lanes for one pass.
//
// [Note: the post-backward guarantee] A group's reduce-scatter is issued only when every trainable
// parameter of the group whose AccumulateGrad will run in this backward has run it (Final). The
// expected set is read when the pass begins from the engine's own plan (nodes_in_graph, and
// exec_info when backward was given inputs), so it does not depend on scheduling. Groups are
// issued in one fixed order, a ready group waiting for its turn (Agreed). Each group is issued at
// most once per backward (Once), and the final callback, which the engine runs after every node,
// issues whatever is left (parameters that got no gradient contribute zeros) and waits for every
// reduction before backward returns (Complete). A backward with explicit inputs
// (torch::autograd::grad, backward(inputs=)) reduces nothing: its gradients, if any accumulate,
// stay unsharded until the next plain synced backward.
#include "core/backward.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/faults.h"

namespace fsdp::detail {
namespace {

// Will `node` run in the current GraphTask? The exec info's needed_ flag says so, not
// should_execute() (docs/design.md, [Note: the post-backward guarantee]).
bool will_run(const torch::autograd::Node* node) {
  auto* nig = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (!node || !nig || !nig->count(const_cast<torch::autograd::Node*>(node))) return false;
  auto* ei = torch::autograd::get_current_graph_task_exec_info();
  if (!ei || ei->empty()) return true;
  auto it = ei->find(const_cast<torch::autograd::Node*>(node));
  return it != ei->end() && it->second.needed_;
}

template <class Nodes>
int count_will_run(const Nodes& nodes, const torch::autograd::Node* first) {
  int n = 0;
  for (const auto& w : nodes)
    if (auto node = w.lock(); node && (node.get() == first || will_run(node.get()))) ++n;
  return n;
}

}  // namespace

void ReapBudget::expired(const Group& g, int waited_ms, const CommContext& ctx) {
  ++expiries;
  ctx.log(g.name(), cat("reduce-scatter still in flight after a bounded wait of ", waited_ms,
                        " ms (", expiries, " of ", kMaxExpiries, ")"));
  if (expiries == kMaxExpiries)
    TORCH_WARN("fsdp[rank ", ctx.comm->rank(), "]: reduce-scatters were still in flight after ",
               kMaxExpiries, " bounded waits of ", waited_ms,
               " ms; backward no longer waits for them before packing the next group's "
               "gradients, so more send buffers may be held at once (memory, not results). A "
               "rank far slower than the others, or a slow reduce lane, does this.");
}

Backward::Backward(std::vector<Group*> groups, const std::vector<Group*>& completion,
                   const torch::autograd::Node* first, uint64_t epoch, CommContext& ctx,
                   Audit& audit, ReapBudget& budget)
    : groups_(std::move(groups)), epoch_(epoch), ctx_(ctx), audit_(audit), budget_(budget) {
  auto* ei = torch::autograd::get_current_graph_task_exec_info();
  plain_ = ei == nullptr || ei->empty();
  slots_.resize(groups_.size());
  for (Group* g : groups_) {
    Slot& s = slot(*g);
    s.arrived.assign(g->params().size(), Arrival::kAbsent);
    for (size_t i = 0; i < g->params().size(); ++i) {
      const auto& acc = g->params()[i].accumulator();
      if (acc && will_run(acc.get())) {
        s.arrived[i] = Arrival::kExpected;
        ++s.grads_pending;
      }
    }
    s.hooks_pending = count_will_run(g->output_nodes(), first);
    s.inputs_pending = count_will_run(g->input_nodes(), nullptr);
    log(g, cat("backward begins: expects ", s.hooks_pending, " output hooks, ", s.grads_pending,
               " gradients, ", s.inputs_pending, " input-side nodes",
               plain_ ? "" : " (explicit inputs: no reduction)"));
  }
  for (auto it = completion.rbegin(); it != completion.rend(); ++it)
    if ((*it)->forwarded_with_grad()) backward_order_.push_back(*it);
}

void Backward::log(const Group* g, const std::string& event) const {
  ctx_.log(g ? g->name() : "-", event);
}

Backward::Slot& Backward::slot(const Group& g) {
  const int k = g.index();
  FSDP_CHECK(k >= 0 && static_cast<size_t>(k) < slots_.size() && groups_[k] == &g,
             "sharded module '", g.name(),
             "' was registered while a backward was running; call fully_shard before training");
  return slots_[k];
}

const Backward::Slot& Backward::slot(const Group& g) const {
  return const_cast<Backward*>(this)->slot(g);
}

std::vector<bool> Backward::syncing() const {
  std::vector<bool> out;
  for (Group* g : groups_)
    out.push_back(protocol::reduces(plain_, g->requires_gradient_sync(), g->has_trainable(), true));
  return out;
}

std::vector<bool> Backward::holdings() const {
  std::vector<bool> out = syncing();
  for (size_t k = 0; k < groups_.size(); ++k)
    out[k] = out[k] && (slots_[k].grads_pending > 0 || groups_[k]->holds_gradients());
  return out;
}

// This rank's gather plan: the groups forwarded with grad that its forward left resharded, in
// reverse order of forward completion (the order their output hooks fire).
std::vector<int64_t> Backward::plan() const {
  std::vector<int64_t> out;
  for (Group* g : backward_order_)
    if (g->shard_state() == ShardState::kSharded && g->unshard_in_backward())
      out.push_back(g->index());
  return out;
}

bool Backward::reduces(const Group& g) const {
  const auto k = static_cast<size_t>(g.index());
  return protocol::reduces(plain_, g.requires_gradient_sync(), g.has_trainable(),
                           k < held_.size() && held_[k]);
}

int Backward::reductions_of(const Group& g) const {
  const int k = g.index();
  return k >= 0 && static_cast<size_t>(k) < slots_.size() ? slots_[k].reductions : 0;
}

void Backward::start(protocol::BackwardDecision d) {
  for (int64_t k : d.gathers) gather_plan_.push_back(groups_.at(k));
  for (int64_t k : d.reductions) reduce_order_.push_back(groups_.at(k));
  held_ = std::move(d.held);
  calls_differ_ = d.calls_differ;
  for (size_t k = 0; k < groups_.size(); ++k) groups_[k]->set_gather_from_chunk(d.from_chunk[k]);
  // Fault injection (the Agreed check's test): this rank swaps its first two backward gathers.
  if (faults::active().gather_order && ctx_.gather.rank() != 0 && gather_plan_.size() >= 2)
    std::swap(gather_plan_[0], gather_plan_[1]);
  for (Group* g : groups_)
    if (!reduces(*g)) g->begin_unsynced_backward();
  gather_elements();
  // Groups this rank's backward does not touch: done now (a gathered one may reshard at once; a
  // resharded one is still gathered and dropped when its turn in the plan comes).
  for (Group* g : groups_)
    if (!slot(*g).needed()) {
      slot(*g).progress = Progress::kDone;
      if (g->shard_state() == ShardState::kUnsharded) g->post_backward();
    }
  try_issue_reductions();
}

// Elements gathered on use (fully_shard_elements) have no output hook to gather them again before
// their nodes run; the forward leaves them gathered. One resharded since (an explicit reshard()) is
// gathered here, when the pass begins: the plan up to it, in order, like a catch-up.
void Backward::gather_elements() {
  size_t end = 0;
  for (size_t k = 0; k < gather_plan_.size(); ++k)
    if (gather_plan_[k]->gathers_on_use()) end = k + 1;
  gather_through(end);
  for (size_t k = 0; k < end; ++k)
    if (gather_plan_[k]->gathers_on_use() && slot(*gather_plan_[k]).needed())
      gather_plan_[k]->wait_for_unshard();
}

// ---------------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------------
void Backward::pre_backward(Group& g) {
  Slot& s = slot(g);
  log(&g,
      cat("pre_backward (", to_string(g.shard_state()), ", ", s.hooks_pending, " hooks expected)"));
  // Still counted as pending while its own gather is issued, so that catch-up keeps it.
  auto it = std::find(gather_plan_.begin() + gather_cursor_, gather_plan_.end(), &g);
  if (it != gather_plan_.end()) gather_through(it - gather_plan_.begin() + 1);
  if (s.hooks_pending > 0) --s.hooks_pending;
  if (!g.unshard_in_backward() && g.shard_state() == ShardState::kSharded) {
    // Left resharded on purpose (set_unshard_in_backward(false)): a node that reads its
    // parameters meets the resharded-parameter guard, which names the setting.
    s.progress = Progress::kRunning;
    g.begin_backward_use();
    return;
  }
  FSDP_CHECK(g.shard_state() != ShardState::kSharded, "sharded module '", g.name(),
             "' is needed by backward after this rank's backward resharded it (the engine ran a "
             "node of its forward that its plan did not expect). Gathering it now would put this "
             "rank's all-gathers out of step with the other ranks', so backward stops here. "
             "Please report this with the model (FSDP_DEBUG=1 shows the events).");
  // Reductions finished by now give their send buffers back first, and the next group's gather is
  // issued only once this one is complete (and copied out of its flat gather buffer, which the
  // next gather's then takes: the gather lane runs one all-gather at a time, so issuing it earlier
  // would gain little and hold one more full-size buffer at backward's peak).
  reap_reductions(Reap::kPoll);
  g.wait_for_unshard();
  reap_reductions(Reap::kPoll);
  prefetch_after(g);
  s.progress = Progress::kRunning;
  g.begin_backward_use();
}

void Backward::on_grad_ready(Group& g, size_t i) {
  Slot& s = slot(g);
  if (s.reductions > 0) {
    if (audit_.enabled) audit_.late_gradient(g, i);
    log(&g, cat("LATE gradient of '", g.params()[i].name(), "'"));
    return;
  }
  if (s.arrived[i] == Arrival::kExpected) {
    s.arrived[i] = Arrival::kArrived;
    --s.grads_pending;
    // Final (its AccumulateGrad runs once in this task): packed for the reduction now, so the
    // group's unsharded gradients do not wait beside the send buffer for the last of them. A
    // reduction that has completed since is finished first: its send buffer goes back to the
    // pool, where this group's can take it.
    if (reduces(g)) {
      reap_reductions(before_send_buffer(g));
      g.hand_over_grad(i);
    } else {
      g.keep_unsynced_grad(i);
    }
  }
  log(&g, cat("gradient final: '", g.params()[i].name(), "' (", s.grads_pending, " to go)"));
  if (s.grads_pending == 0) try_issue_reductions();
  maybe_post_backward(g);
}

void Backward::on_input_backward(Group& g) {
  Slot& s = slot(g);
  if (s.inputs_pending > 0) --s.inputs_pending;
  log(&g, cat("input-side backward (", s.inputs_pending, " to go)"));
  maybe_post_backward(g);
}

void Backward::maybe_post_backward(Group& g) {
  Slot& s = slot(g);
  if (s.progress == Progress::kDone || s.needed()) return;
  s.progress = Progress::kDone;
  g.post_backward();
}

// ---------------------------------------------------------------------------------------------
// The all-gather lane
// ---------------------------------------------------------------------------------------------
void Backward::gather_through(size_t plan_end) {
  for (; gather_cursor_ < plan_end && gather_cursor_ < gather_plan_.size(); ++gather_cursor_) {
    Group* t = gather_plan_[gather_cursor_];
    // Every rank must issue this all-gather; a rank whose backward does not use the group, or that
    // holds it already (its calls differed), takes part and keeps nothing (waiting for it is
    // safe: every rank issues this lane in the same order).
    if (slot(*t).needed() && t->shard_state() == ShardState::kSharded) {
      t->unshard(epoch_);
    } else {
      log(t, "backward all-gather for the other ranks (not needed here)");
      t->serve_gather();
    }
  }
}

void Backward::prefetch_after(Group& g) {
  if (g.backward_prefetch_set()) {
    for (Group* t : g.backward_prefetch()) {
      auto it = std::find(gather_plan_.begin() + gather_cursor_, gather_plan_.end(), t);
      if (it != gather_plan_.end()) gather_through(it - gather_plan_.begin() + 1);
    }
    return;
  }
  // The next plan entry, when this rank needs it (one not needed is left to catch-up, which would
  // otherwise wait for it here), unless a group the forward left gathered runs first (the last
  // block, by fsdp-train's layout): its pre-backward prefetches instead, so that no more groups
  // are held gathered at once than without it.
  if (gather_cursor_ >= gather_plan_.size()) return;
  Group* next = gather_plan_[gather_cursor_];
  Group* upcoming = needed_after(g);
  if (upcoming && upcoming != next && upcoming->shard_state() == ShardState::kUnsharded &&
      !upcoming->gathers_on_use())  // an element has no pre-backward
    return;
  if (next->options().runtime.max_unsharded_groups >= 2 && slot(*next).needed()) {
    log(next, cat("backward prefetch from '", g.name(), "'"));
    gather_through(gather_cursor_ + 1);
  }
}

Group* Backward::needed_after(const Group& g) {
  auto it = std::find(backward_order_.begin(), backward_order_.end(), &g);
  if (it == backward_order_.end()) return nullptr;
  for (++it; it != backward_order_.end(); ++it)
    if (slot(**it).needed()) return *it;
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// The reduce-scatter lane
// ---------------------------------------------------------------------------------------------
void Backward::try_issue_reductions() {
  while (reduce_cursor_ < reduce_order_.size() &&
         (faults::active().issue_early || slot(*reduce_order_[reduce_cursor_]).grads_pending == 0))
    issue(*reduce_order_[reduce_cursor_++]);
}

void Backward::issue(Group& g) {
  Slot& s = slot(g);
  if (s.reductions > 0) {
    if (audit_.enabled) audit_.issued_twice(g);
    return;
  }
  if (!reduces(g)) return;
  s.reductions = 1;
  if (ctx_.reduce.rank() != 0) std::this_thread::sleep_for(faults::active().slow_reduce);
  reap_reductions(gather_cursor_ >= gather_plan_.size() ? Reap::kAll : before_send_buffer(g));
  in_flight_.push_back(InFlight{&g, g.issue_reduce_scatter()});
  log(&g, "reduce-scatter issued");
}

// A reduce-scatter in flight holds its group's gradients (the send buffer). Before a group takes a
// send buffer, the reductions in flight are finished, so that one send buffer is in use at a time
// where the lanes keep up. Waiting for all of them (kAll) is safe only once this rank has issued
// its whole backward all-gather plan: before that, another rank may be waiting, in its backward,
// for an all-gather this rank has not issued yet, while its part of this reduction waits behind
// it. Before that point the wait is bounded (kBounded), and only for a reduction whose group this
// rank has gathered through in the plan (every all-gather up to and including its own is issued:
// what another rank needs before it can issue that reduction, where backward runs the groups in
// plan order; for a group the forward left gathered, which has no entry, every entry that backward
// reaches before it). The wait never decides anything about either lane's order, only when this
// thread goes on, so the bound is a backstop, not what makes it safe: a bounded wait that runs out
// ends such waits for the rest of the pass, and after a few (ReapBudget) for good.
bool Backward::may_wait_for(const Group& g) const {
  // Ranks whose calls differ do not run the plan in its order: another rank may need a later
  // entry before it issues this reduction. Then only the whole plan issued (kAll) allows a wait.
  if (calls_differ_) return false;
  const auto end = gather_plan_.begin() + static_cast<std::ptrdiff_t>(gather_cursor_);
  if (std::find(gather_plan_.begin(), gather_plan_.end(), &g) != gather_plan_.end())
    return std::find(gather_plan_.begin(), end, &g) != end;
  auto it = std::find(backward_order_.begin(), backward_order_.end(), &g);
  if (it == backward_order_.end()) return false;
  return std::all_of(backward_order_.begin(), it, [&](const Group* before) {
    return std::find(end, gather_plan_.end(), before) == gather_plan_.end();
  });
}

Backward::Reap Backward::before_send_buffer(const Group& g) const {
  return g.has_handed_over() ? Reap::kPoll : Reap::kBounded;  // it holds one already: no wait
}

void Backward::reap_reductions(Reap how) {
  if (how == Reap::kBounded) wait_bounded();
  // A group's all-reduce hook may issue collectives: it runs only once this rank has issued its
  // whole gather plan, so that no rank waits on an all-gather behind it (finalize issues the rest).
  const bool hooks_may_run = gather_cursor_ >= gather_plan_.size();
  while (!in_flight_.empty()) {
    InFlight& f = in_flight_.front();
    if (!hooks_may_run && f.group->has_all_reduce_hook()) break;
    if (how != Reap::kAll && !f.group->poll_reduce(f.reduce)) break;
    f.group->finish_reduce(f.reduce);
    in_flight_.pop_front();
  }
}

void Backward::wait_bounded() {
  if (bounded_wait_expired_ || !budget_.enabled()) return;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(kBoundedReapWaitMs);
  for (auto& f : in_flight_) {  // in issue order
    if (!may_wait_for(*f.group)) return;
    while (!f.group->poll_reduce(f.reduce)) {
      if (std::chrono::steady_clock::now() >= deadline) {
        bounded_wait_expired_ = true;
        budget_.expired(*f.group, kBoundedReapWaitMs, ctx_);
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The final callback
// ---------------------------------------------------------------------------------------------
void Backward::finalize() {
  std::exception_ptr error;
  try {
    gather_through(gather_plan_.size());
    for (; reduce_cursor_ < reduce_order_.size(); ++reduce_cursor_) {
      Group* g = reduce_order_[reduce_cursor_];
      slot(*g).grads_pending = 0;  // whatever did not arrive will not: zeros
      issue(*g);
    }
  } catch (...) {
    error = std::current_exception();
  }
  for (auto& f : in_flight_) {
    try {
      f.group->finish_reduce(f.reduce);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  in_flight_.clear();
  for (Group* g : groups_) {
    try {
      g->finalize_backward();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  // The root group registers last: the completion is the root's.
  log(groups_.empty() ? nullptr : groups_.back(), "backward complete");
  if (error) std::rethrow_exception(error);
}

}  // namespace fsdp::detail
