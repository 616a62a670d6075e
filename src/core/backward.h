// Backward: one backward (one autograd GraphTask) over the groups of one root: the post-backward
// guarantee ([Note: the post-backward guarantee]) and the order of both lanes ([Note: agreement on
// both lanes]) for that pass. The root builds it at the pass's first hook, hands it the orders the
// ranks agreed on (protocol::decide_backward), feeds it every later event of the pass and
// finalises it in the engine's final callback. It calls the groups; nothing calls back into it.
//
// In brief: both lanes follow orders computed when the pass begins from facts every rank shares
// (the forward call order, the settings and the shard states they produce), never from which
// outputs or parameters receive gradients on this rank. Backward all-gathers follow the gather
// plan; a rank that needs plan entry k first issues every entry before k (catch-up), and whatever
// it does not need is gathered and dropped. Reductions follow the reduce order, each issued when
// its group's participating gradients are final and every group before it was issued. The final
// callback issues what remains of both, so every rank issues both whole sequences.
// Thread-safety: the root calls it under its mutex.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "core/audit.h"
#include "core/group.h"
#include "core/protocol.h"

namespace fsdp::detail {

// Bounded waits for reductions in flight (Backward::reap_reductions), across the passes of a root:
// after kMaxExpiries of them ran out of time, later passes only poll (a warning says so once).
struct ReapBudget {
  static constexpr int kMaxExpiries = 3;
  int expiries = 0;
  bool enabled() const { return expiries < kMaxExpiries; }
  void expired(const Group& g, int waited_ms, const CommContext& ctx);
};

class Backward {
 public:
  // At the first output hook of a GraphTask: reads the engine's plan for the task. `groups` in
  // registration order (index() is the place), `completion` by last completed forward call this
  // iteration; `first` is the node whose hook fired (the graph root when backward() was called on
  // one tensor, which the engine runs without listing it in nodes_in_graph).
  // `epoch`: the root's, for the gathers issued in this pass.
  Backward(std::vector<Group*> groups, const std::vector<Group*>& completion,
           const torch::autograd::Node* first, uint64_t epoch, CommContext& ctx, Audit& audit,
           ReapBudget& budget);

  // ---- what this rank sends in the pass's opening round (core/protocol.h, kBackward) ----
  bool plain() const { return plain_; }  // no explicit inputs: gradients are reduced
  std::vector<bool> syncing() const;     // groups whose gradient sync is on (must match)
  std::vector<bool> holdings() const;    // groups this rank may have something to reduce for
  std::vector<int64_t> plan() const;     // groups it gathers, in order
  // ---- the agreed orders; the pass begins ----
  void start(protocol::BackwardDecision decided);

  // ---- events, in the order they arrive ----
  void pre_backward(Group& g);                 // an output hook of g fired
  void on_grad_ready(Group& g, size_t param);  // a parameter's AccumulateGrad ran
  void on_input_backward(Group& g);            // an input-side node of g ran
  // The engine's final callback: issues what is left of both lanes, waits for every reduction,
  // finalises every group. Rethrows the first error after finalising all.
  void finalize();

  // ---- for the audit ----
  bool reduces(const Group& g) const;  // this pass reduces g's gradients (protocol::reduces)
  int reductions_of(const Group& g) const;
  size_t reductions_in_flight() const { return in_flight_.size(); }

 private:
  enum class Arrival : uint8_t {
    kExpected,  // its AccumulateGrad will run in this task, has not yet
    kArrived,   // ran: the gradient is final
    kAbsent,    // will not run in this task
  };
  enum class Progress : uint8_t {
    kWaiting,  // nothing of the group has run yet in this pass
    kRunning,  // an output hook fired: its gathered parameters are in use
    kDone,     // every expected hook, gradient and input node ran
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
  struct InFlight {
    Group* group;
    PendingReduce reduce;
  };
  // How long reap_reductions may wait for the reductions in flight.
  enum class Reap : uint8_t {
    kPoll,     // finish those completed, never wait
    kBounded,  // wait up to kBoundedReapWaitMs for them
    kAll,      // wait for all: safe only once the gather plan is issued
  };
  static constexpr int kBoundedReapWaitMs = 3000;

  Slot& slot(const Group& g);
  const Slot& slot(const Group& g) const;
  void gather_elements();                // elements are never left resharded into their backward
  void gather_through(size_t plan_end);  // issue plan entries [cursor, plan_end)
  void prefetch_after(Group& g);
  Group* needed_after(const Group& g);  // the next group of backward_order_ this rank needs
  void maybe_post_backward(Group& g);
  void try_issue_reductions();
  void issue(Group& g);
  void reap_reductions(Reap how);  // finishes the reductions done, in order, waiting as allowed
  Reap before_send_buffer(const Group& g) const;  // kPoll if g holds its send buffer
  void wait_bounded();
  bool may_wait_for(const Group& g) const;  // the plan is issued here up to g
  void log(const Group* g, const std::string& event) const;

  std::vector<Group*> groups_;
  uint64_t epoch_;
  CommContext& ctx_;
  Audit& audit_;
  ReapBudget& budget_;
  bool plain_ = false;
  std::vector<Slot> slots_;             // by registration index
  std::vector<Group*> backward_order_;  // forwarded with grad, reverse completion order
  std::vector<Group*> gather_plan_;
  size_t gather_cursor_ = 0;
  std::vector<Group*> reduce_order_;
  size_t reduce_cursor_ = 0;
  std::vector<bool> held_;  // by registration index: some rank has something to reduce for it
  std::deque<InFlight> in_flight_;
  bool bounded_wait_expired_ = false;  // a kBounded reap ran out of time in this pass
  bool calls_differ_ = false;          // the ranks' plans differed
};

}  // namespace fsdp::detail
