// CallAgreement: the all-gathers of ranks whose forward calls differ, agreed round by round.
//
// [Note: calls that differ between ranks] (docs/design.md) in brief: a rank may call any subset
// of the sharded modules, any number of times, in any order. Every forward all-gather is issued
// from a *round*, one small all-gather on the gather lane in which each rank says which groups it
// needs gathered now and which it would prefetch; every rank issues the union, in registration
// order, keeps what it asked for and serves the rest (sends its part, keeps nothing). A rank
// enters a round only when it has something to gather, so the k-th rounds of all ranks pair up
// whatever their calls were; at the end of its top-level call a rank enters "done" rounds,
// serving the others, until every rank is done. Backward agrees once per pass: the ranks' gather
// plans and reduction orders are exchanged when it begins and merged the same way everywhere.
//
// What must still match across ranks: the top-level calls (a forward of the root, or of any
// sharded module called outside another's forward), the backward calls and the explicit
// FSDPModule::unshard() calls. A round of one kind
// meeting another (a rank beginning a top-level forward while another begins a backward) throws
// fsdp::Error on every rank naming both.
//
// Thread-safety: the forward rounds run on the training thread; agree_backward on the thread of
// the backward's first hook, with the backward mutex held (no forward runs then).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
class Communicator;
class FSDPModule;
}  // namespace fsdp

namespace fsdp::detail {

class Context;
class Group;

class CallAgreement {
 public:
  explicit CallAgreement(Context& ctx) : ctx_(ctx) {}

  // Whether rounds are needed at all: more than one rank on the gather lane.
  bool active() const;

  // ---- forward, in run order ----
  // A top-level forward call of `g` begins: the first round, in which the ranks decide which
  // groups held gathered from an earlier epoch are stale ([Note: stale gathered parameters]);
  // those are resharded on every rank that holds them.
  void begin_top_level(Group& g);
  // A forward call of `g` (or its first use, for an element gathered on use) needs its
  // parameters: g's all-gather, if resharded here, and this rank's forward prefetches, through one
  // round. Returns without a round when this rank has nothing to gather.
  void gather_for_call(Group& g);
  // The top-level call of `g` returned: done rounds, serving the other ranks, until every rank is
  // done; then this call's prefetches that no call used are dropped.
  void end_top_level(Group& g);
  // The forward threw: forgets this call's prefetches (they are resharded by the unwinding).
  void abandon() { prefetched_.clear(); }

  // FSDPModule::unshard(), a collective every rank calls: g is gathered where it is resharded
  // and served where it is held (its calls differed), in one round of its own kind.
  void explicit_unshard(Group& g);

  // An explicit collective of the user's begins (clip_grad_norm_, a state dict, a checkpoint):
  // one round of its own kind, so that a rank calling it while another does something else stops
  // every rank at once, naming both, instead of waiting out the collective timeout.
  enum class Explicit : int64_t {
    kClipGradNorm,
    kFullStateDict,
    kLoadFullStateDict,
    kCheckpointSave,
    kCheckpointLoad,
    kFinalizeBackward
  };
  void explicit_collective(Explicit what);

  // ---- backward ----
  struct BackwardOrders {
    std::vector<Group*> gathers;     // the gather plan every rank issues
    std::vector<Group*> reductions;  // the reduce order every rank issues (the root last)
    // Some rank of the mesh planned otherwise than another: a rank's backward may then need a
    // later gather before it can issue an earlier reduction (BackwardPass::may_wait_for).
    bool calls_differ = false;
    // Per registration index: gathered from the post-forward chunks (every rank holds one).
    std::vector<bool> from_chunk;
    // Per registration index: some rank of the mesh may have something to reduce for the group
    // (my_holdings of any rank); a group none has is not reduced.
    std::vector<bool> held;
  };
  // A backward begins: this rank's gather plan and reverse first-forward order, merged with every
  // other rank's (and, under HSDP, every replica's reduce order) into the same orders on every
  // rank.
  // `my_reductions`, per registration index: this backward reduces the group (ranks that differ
  // stop, naming set_requires_gradient_sync). `my_holdings`, per registration index: this rank may
  // have something to reduce for the group ([Note: parameters that got no gradient]).
  BackwardOrders agree_backward(const std::vector<Group*>& my_gathers,
                                const std::vector<Group*>& my_reverse_forward,
                                const std::vector<bool>& my_reductions,
                                const std::vector<bool>& my_holdings);
  // finalize_backward's reductions on this rank, per registration index: ranks that differ stop,
  // naming set_requires_gradient_sync (as at a backward's start). `my_holdings`: this rank holds
  // gradients for the group. Returns, per registration index, whether any rank of the shard
  // group does (the replicas reduce in step: each holds its own micro-batches' gradients, so a
  // group is reduced where any replica's rank holds some; see finalize_backward).
  std::vector<bool> agree_finalize(const std::vector<bool>& my_reductions,
                                   const std::vector<bool>& my_holdings);

 private:
  enum Kind : int64_t {
    kStart = 1,
    kCall = 2,
    kDone = 3,
    kBackward = 4,
    kUnshard = 5,
    kExplicit = 6,  // who: the Explicit collective
    kFinalize = 7   // finalize_backward's reductions, as kBackward's
  };
  // One rank's message: kind, the group whose call it is (-1: none), the rank's number in the
  // mesh, then four bit sets over the registration indices: need, prefetch, changed, held (the
  // last two in kStart only).
  struct Message {
    int64_t kind = 0, who = -1, rank = 0;
    int64_t digest = 0;  // of `need` (exchange() computes it): a backward's reductions
    std::vector<uint64_t> need, prefetch, changed, held;
  };
  using Clash = std::pair<Message, Message>;  // two messages of one round that cannot pair
  // A reduction round (kBackward, kFinalize): `need` holds the groups reduced, `who` their count,
  // `held` the groups this rank holds gradients for (kFinalize). Returns every rank's message.
  std::vector<Message> agree_reductions(Kind kind, const std::vector<bool>& my_reductions,
                                        const std::vector<bool>& my_holdings);

  static bool exclusive(int64_t kind);
  static bool clash(const Message& a, const Message& b);
  int64_t mesh_rank() const;
  Message message(Kind kind, const Group* who) const;
  // The round: every rank's message, indexed by gather-lane rank; throws on every rank of the
  // mesh when two cannot pair.
  std::vector<Message> exchange(Message mine);
  std::vector<Message> gather_messages(const Message& mine);
  std::optional<Clash> agree_across_replicas(Communicator& rep, const Message& mine,
                                             const std::optional<Clash>& found);
  // Issues the union of the needed, then of the prefetched groups, in registration order.
  void issue_union(const Message& mine, const std::vector<Message>& all);
  std::string describe(const Message& m) const;

  Context& ctx_;
  std::vector<Group*> prefetched_;  // this top-level call's prefetches, until used or dropped
};

// The round of CallAgreement::explicit_collective, for the context `module` belongs to.
void agree_explicit_collective(const FSDPModule& module, CallAgreement::Explicit what);

}  // namespace fsdp::detail
