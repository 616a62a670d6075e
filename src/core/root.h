// Root: one per sharded model (FSDP2's state at the root). It owns everything that spans the
// model's groups (the groups, their communication context, the rounds of the cross-rank protocol,
// the Agreed log, the audit, the forward order, the running backwards, the epochs, the only mutex)
// and drives every step: each forward call's gathers, the backward's plan and reductions, the
// explicit collectives. Hooks and handles enter it through a Binding (core/binding.h); it calls
// the groups, which never call back.
//
// A root is made by each fully_shard call; a parent's fully_shard makes a new one that absorbs the
// roots of its sharded descendants (their groups, renamed by path), so that the model's root is
// the root of the last call, whose group is its own parameters' (last in registration order).
//
// Lifecycle of a step, in run order: pre_forward / post_forward of each call (the first of an
// iteration starts it; a top-level call opens with a round, core/protocol.h kStart); the backward's
// hooks (the first builds the pass: its opening round, core/backward.h), the engine's final
// callback (finalize_backward's checks); explicit collectives between steps.
// Thread-safety: one thread trains a model; backward hooks may run on the engine's threads. Every
// entry point takes mu_ once; nothing it reaches takes it again (an EntryMutex: a nested lock
// throws).
#pragma once

#include <fsdp/communicator.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/agreed.h"
#include "core/audit.h"
#include "core/backward.h"
#include "core/comm_context.h"
#include "core/group.h"
#include "core/rounds.h"
#include "core/verified.h"
#include "util/mutex.h"

namespace fsdp::detail {

struct Binding;

class Root {
 public:
  // `replicate` (HSDP, fsdp/mesh.h): the ranks holding the same shards; null for plain FSDP.
  Root(std::shared_ptr<Communicator> comm, std::shared_ptr<Communicator> replicate, bool audit);
  ~Root();
  Root(const Root&) = delete;
  Root& operator=(const Root&) = delete;

  // ---- groups (registration order: descendants first, the root's own group last) ----
  // Takes over every group of `other` (a descendant's root), in its order, renamed by the caller.
  void absorb(Root& other);
  void add(std::shared_ptr<Group> g);  // the group of the fully_shard call that made this root
  const std::vector<Group*>& groups() const { return order_; }
  Group* root_group() const { return order_.empty() ? nullptr : order_.back(); }
  // The groups at or below `g`'s module (its members' for a list), in registration order.
  std::vector<Group*> at_or_below(const Group& g) const;
  CommContext& comm_context() { return ctx_; }
  const CommContext& comm_context() const { return ctx_; }
  bool audits() const { return audit_.enabled; }
  std::vector<std::string> names() const;  // the groups' names by registration index

  // ---- a forward call (ForwardScope), in run order ----
  void pre_forward(Group& g) FSDP_EXCLUDES(mu_);
  // A tensor input of the call, handed to forward (through an input-side node when it needs one).
  at::Tensor input(Group& g, const at::Tensor& x, const std::weak_ptr<Binding>& b);
  void post_forward(Group& g, const std::vector<at::Tensor>& outs, const std::weak_ptr<Binding>& b)
      FSDP_EXCLUDES(mu_);
  void abort_forward(Group& g) noexcept FSDP_EXCLUDES(mu_);
  // The guard: an operator reads a parameter of element group `g` (fully_shard_elements). Inside
  // the root's forward its gather was issued when that forward began: waits for it (never issues
  // a collective) and records the use; false outside.
  bool use_element(Group& g) FSDP_EXCLUDES(mu_);

  // ---- backward: the hooks' entries (core/hooks.h) ----
  void on_output_hook(Group& g, const torch::autograd::Node* node) FSDP_EXCLUDES(mu_);
  void on_accumulate(Group& g, size_t param) FSDP_EXCLUDES(mu_);  // before autograd accumulates
  void on_grad_ready(Group& g, size_t param) FSDP_EXCLUDES(mu_);  // AccumulateGrad ran
  void on_input_backward(Group& g) FSDP_EXCLUDES(mu_);

  // ---- explicit calls (FSDPModule and the free functions) ----
  // FSDPModule::unshard(): one round of its own kind; g gathered where it is resharded, served
  // where it is held. `wait`: blocks until gathered.
  void unshard(Group& g, bool wait) FSDP_EXCLUDES(mu_);
  void wait_for_unshard(Group& g) FSDP_EXCLUDES(mu_);  // UnshardHandle::wait
  void reshard(Group& g) FSDP_EXCLUDES(mu_);
  // An explicit collective of the user's begins (clip_grad_norm_, a state dict, a checkpoint): one
  // round of its own kind, so that a rank calling it while another does something else stops every
  // rank at once, naming both.
  void explicit_collective(protocol::Explicit what) FSDP_EXCLUDES(mu_);
  void finalize_backward() FSDP_EXCLUDES(mu_);  // FSDPModule::finalize_backward
  // FSDPModule::set_replicate_communicator: between steps only.
  void rebind_replicate(std::shared_ptr<Communicator> r) FSDP_EXCLUDES(mu_);

  // ---- memory ----
  void reset_peaks();

 private:
  // Forward (root_forward.cpp).
  bool in_forward() const;
  void start_iteration_if_new(Group& g) FSDP_REQUIRES(mu_);
  void begin_top_level(Group& g) FSDP_REQUIRES(mu_);
  void gather_elements() FSDP_REQUIRES(mu_);
  void gather_for_call(Group& g) FSDP_REQUIRES(mu_);
  void round_for_call(Group& g, std::vector<Group*> prefetch) FSDP_REQUIRES(mu_);
  void issue_round(const protocol::Message& mine, const std::vector<protocol::Message>& all)
      FSDP_REQUIRES(mu_);
  std::vector<Group*> forward_prefetch_targets(Group& g) FSDP_REQUIRES(mu_);
  void end_region(Group& g) FSDP_REQUIRES(mu_);
  void end_top_level() FSDP_REQUIRES(mu_);
  void end_epoch();
  void broadcast_buffers();
  void abort_forward_locked(Group& g) noexcept FSDP_REQUIRES(mu_);
  // Backward (root_backward.cpp).
  Backward* current() FSDP_REQUIRES(mu_);
  Backward& begin_backward(Group& g, const torch::autograd::Node* node) FSDP_REQUIRES(mu_);
  protocol::BackwardDecision agree_backward(const Backward& pass) FSDP_REQUIRES(mu_);
  void finalize_task(const void* key) FSDP_EXCLUDES(mu_);
  bool drop_unfinished() FSDP_REQUIRES(mu_);
  // After reductions: the Agreed check carrying who contributed, the shards' gradients settled.
  std::vector<uint64_t> check_agreement_and_settle();
  std::vector<uint64_t> contribution_bits() const;
  void settle_shard_grads(const std::vector<uint64_t>& any_rank);
  void check_agreement();
  protocol::Message message(protocol::Kind kind, int64_t who) const;
  std::vector<protocol::Message> exchange(const protocol::Message& m);

  CommContext ctx_;
  std::vector<std::shared_ptr<Group>> groups_;  // owned
  std::vector<Group*> order_;                   // the same, registration order
  Rounds rounds_{ctx_};
  AgreedLog agreed_;
  VerifiedCollectives verified_{ctx_.agree, [this] { return names(); }};  // rides agreed_
  Audit audit_;
  ReapBudget reap_budget_;
  EntryMutex mu_{"the root's mutex"};
  // Groups in first pre-forward order this iteration, and the previous iteration's; by last
  // completed forward call this iteration.
  std::vector<Group*> forward_order_ FSDP_GUARDED_BY(mu_);
  std::vector<Group*> last_forward_order_ FSDP_GUARDED_BY(mu_);
  std::vector<Group*> completion_order_ FSDP_GUARDED_BY(mu_);
  bool backward_done_ FSDP_GUARDED_BY(mu_) = true;  // the next forward starts a new iteration
  // [Note: calls that differ between ranks] Depth of the forwards of modules that declared
  // calls_may_differ: inside one, every gather goes through a round.
  int region_depth_ FSDP_GUARDED_BY(mu_) = 0;
  std::vector<Group*> prefetched_ FSDP_GUARDED_BY(mu_);  // this top-level call's prefetches
  // Epochs: one begins at every top-level forward call and at the end of every backward, the
  // points between which user code (an optimizer step, a load) may write the shards.
  uint64_t epoch_ = 1;
  std::map<const void*, std::unique_ptr<Backward>> passes_ FSDP_GUARDED_BY(mu_);  // by GraphTask
};

}  // namespace fsdp::detail
