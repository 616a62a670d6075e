// BackwardPass: one backward (one autograd GraphTask) over the groups of one root. It owns the
// per-group bookkeeping, the order of both lanes, the reductions in flight and the finalisation.
//
// [Note: agreement on both lanes] (docs/design.md) in brief: both lanes follow orders computed
// when the pass begins from facts every rank shares (the forward call order, the settings and
// the shard states they produce), never from which outputs or parameters receive gradients on
// this rank. Backward all-gathers follow the gather plan (reverse forward-completion order of the
// groups the forward left resharded); a rank that needs plan entry k first issues every entry
// before k (catch-up), and whatever this rank does not need is gathered and dropped. Reductions
// follow the reduce order (reverse first-forward order, the root last), each issued when its
// group's participating gradients are final and every group before it was issued. The final
// callback issues what remains of both, so every rank issues both whole sequences.
//
// Thread-safety: reachable only through BackwardPasses, which owns the passes and calls every
// method with its mutex held.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "core/group.h"

namespace fsdp::detail {

class Context;

class BackwardPass {
 public:
  // Called at the first output hook of a GraphTask: reads the engine's plan for that task.
  // `first` is the node whose hook fired: the graph root when backward() was called on one
  // tensor, which the engine runs without listing it in nodes_in_graph.
  BackwardPass(Context& ctx, const void* task_key, const torch::autograd::Node* first);

  // ---- events, in the order they arrive ----
  void pre_backward(Group& g);                 // an output hook of g fired
  void on_grad_ready(Group& g, size_t param);  // a parameter's AccumulateGrad ran
  void on_input_backward(Group& g);            // an input-side node of g ran
  void finalize();                             // the engine's final callback: issue, wait, check

  // ---- for the audit ----
  bool reducing() const { return reducing_; }  // a plain backward(): gradients are synced
  int reductions_of(const Group& g) const;
  bool reduces(const Group& g) const { return will_reduce(g); }
  size_t reductions_in_flight() const { return in_flight_.size(); }

 private:
  enum class Arrival : uint8_t {
    kExpected,  // its AccumulateGrad will run in this task, has not yet
    kArrived,   // ran: the gradient is final
    kAbsent,    // will not run in this task: contributes zeros (or its kept gradient)
  };
  enum class Progress : uint8_t {
    kWaiting,  // nothing of the group has run yet in this pass
    kRunning,  // an output hook fired: its gathered parameters are in use
    kDone,     // every expected hook, gradient and input node ran (post_backward)
  };
  struct Slot {
    int hooks_pending = 0;   // output hooks whose node will run
    int grads_pending = 0;   // AccumulateGrad post hooks expected
    int inputs_pending = 0;  // input-side nodes expected
    std::vector<Arrival> arrived;
    Progress progress = Progress::kWaiting;
    int reductions = 0;
    bool needed() const { return hooks_pending + grads_pending + inputs_pending > 0; }
  };

  Slot& slot(const Group& g);
  void plan();             // the gather plan and the reduce order, agreed with the other ranks
  void gather_elements();  // elements gathered on use: never left resharded into their backward
  void gather_through(size_t plan_end);  // issue plan entries [cursor, plan_end)
  void prefetch_after(Group& g);
  // The group after `g` in backward_order_ that this rank's backward needs; null when none.
  Group* needed_after(const Group& g);
  void maybe_post_backward(Group& g);
  void try_issue_reductions();
  void issue(Group& g);
  bool syncs(const Group& g) const;        // a plain backward with g's gradient sync on
  bool will_reduce(const Group& g) const;  // this pass reduces g's gradients
  // How long reap_reductions may wait for the reductions in flight.
  enum class Reap : uint8_t {
    kPoll,     // finish those completed, never wait
    kBounded,  // wait up to kBoundedReapWaitMs for them (see backward_pass.cpp)
    kAll,      // wait for all: safe only once the gather plan is issued
  };
  static constexpr int kBoundedReapWaitMs = 3000;
  // Finishes the reductions in flight that are done, in order, waiting as `how` allows.
  void reap_reductions(Reap how);
  Reap before_send_buffer(const Group& g) const;  // kPoll if g holds its send buffer, else kBounded
  void wait_bounded();                            // kBounded's wait, before the reaping
  bool may_wait_for(const Group& g) const;        // the plan is issued here up to g (see .cpp)

  Context& ctx_;
  const void* key_;
  bool reducing_ = false;
  std::vector<Slot> slots_;             // by registration index
  std::vector<Group*> backward_order_;  // forwarded with grad, reverse completion order
  std::vector<Group*> gather_plan_;
  size_t gather_cursor_ = 0;
  std::vector<Group*> reduce_order_;
  size_t reduce_cursor_ = 0;
  std::deque<PendingReduce> in_flight_;
  bool bounded_wait_expired_ = false;  // a kBounded reap ran out of time in this pass
  bool calls_differ_ = false;          // the ranks' plans differed (CallAgreement)
  std::vector<bool> held_;  // by registration index: some rank has something to reduce for it
};

}  // namespace fsdp::detail
