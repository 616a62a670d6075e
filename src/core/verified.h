// VerifiedCollectives: the check that every all-gather and reduce-scatter of a root's lanes
// delivered what its ranks sent ([Note: verified collectives] in docs/design.md). It observes the
// lanes (core/lane.h) and rides the Agreed exchange (core/agreed.h, an AgreedRider): no collective
// or wait of its own unless a check fails.
//
// All-gathers (the gather lane, hpZ's post-forward lanes, gathers into places, custom all-gathers,
// GatherTransforms' wire): each rank digests (XXH3) its own block of the result and the block
// from each peer; every check compares, for every pair of ranks, what one sent with what the
// other received, exactly. Reduce-scatters (the communicator's): the XXH3 of every block as it
// was sent and as it arrived, before the sum (detail::reduce_scatter_digested: exact, over the
// iteration's slice of each block), and a linear sketch (a pseudo-random +-1 projection in fp64) of
// each block a rank sends and of the reduced shard it receives, whose senders' sketches must sum to
// the receiver's within a rounding bound derived in the note (the sum itself, and the sender's
// buffer before the wire). A custom reduce-scatter is checked by the digests of its wire it
// attaches to its Work (Work::with_digests, as fsdp/quantized.h's do), or counted as unchecked.
//
// A window is the collectives since the previous check; its row has a fixed size (7N + 10 words
// for N ranks), whatever the number of collectives. Only when a check fails are the collectives'
// own digests exchanged, to name the first that differs. `period` > 1 checks a rotating 1/period
// of each payload per iteration (every byte within `period` iterations).
// Thread-safety: collectives are issued on the root's training thread; their completion steps run
// on whichever thread waits (under the state's mutex, core/verified_state.h), the check on the
// training thread.
#pragma once

#include <fsdp/communicator.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/agreed.h"
#include "core/lane.h"

namespace fsdp::detail {

class VerifiedCollectives final : public LaneObserver, public AgreedRider {
 public:
  using Names = std::function<std::vector<std::string>()>;
  struct Settings {
    bool enabled = true;
    int period = 8;  // 1: every byte of every collective
  };
  // `agree`: the shard group's lane of the Agreed exchange, whose ranks index the rows.
  VerifiedCollectives(std::shared_ptr<Communicator> agree, Names names);
  ~VerifiedCollectives() override;
  VerifiedCollectives(const VerifiedCollectives&) = delete;
  VerifiedCollectives& operator=(const VerifiedCollectives&) = delete;
  // RuntimeOptions and FSDP_VERIFY_COLLECTIVES, resolved by the root before its first collective.
  void configure(Settings s);
  Settings settings() const;
  // The check about to run ends a forward (false) or a backward (true) of the iteration.
  void begin_check(bool backward);

  Work issued_all_gather(const Collective& c, const at::Tensor& out, const at::Tensor& in,
                         Work work) override;
  Work issued_all_gather_into(const Collective& c,
                              const std::vector<std::vector<at::Tensor>>& places,
                              const std::vector<at::Tensor>& pieces, Work work) override;
  void issuing_reduce_scatter(const Collective& c, const at::Tensor& out, const at::Tensor& in,
                              ReduceOp op, const ReduceScatter* custom) override;
  bool digests_reduce_scatter(const Collective& c, ReceivedChunkHook* hook,
                              WireSpan* span) override;
  Work issued_reduce_scatter(const Collective& c, const at::Tensor& out, const at::Tensor& in,
                             Work work) override;

  size_t words() const override;
  void fill(int64_t* words) override;
  void examine(const std::vector<const int64_t*>& rows) override;

  // Checks that passed on every rank, in this process (tests: the check runs where it should).
  static int64_t checks_passed();
  // Seconds this process spent digesting and sketching payloads and checking rows (fsdp-bench
  // reports it per step beside the step time).
  static double seconds_spent();
  // Counts its lifetime into seconds_spent().
  struct Timed {
    Timed();
    ~Timed();
    int64_t start_ns;
  };

  // One all-gather's digests by shard-group rank (0 outside its lane), for naming it.
  struct GatherRecord {
    int64_t group = 0, bytes = 0;
    std::vector<uint64_t> digests;
  };
  // One reduce-scatter's sketches by shard-group rank (of the block this rank sent to it), its
  // output's, and a custom collective's wire digests.
  struct ReduceRecord {
    int64_t group = 0, numel = 0, custom = 0;
    std::vector<double> sketch, var, abs;  // of the block sent to each rank
    double out_sketch = 0, out_var = 0, out_abs = 0;
    std::vector<uint64_t> wire_sent, wire_received;
  };
  // The mutable state (core/verified_state.h), shared with the completion steps of collectives in
  // flight, which may outlive this.
  struct State;

  // What one rank folded since the previous check: the row it contributes, and its collectives.
  struct Window {
    explicit Window(int n = 0);
    std::vector<uint64_t> sent, received, wire_sent,
        wire_received;                     // by peer: sums of H(k, digest)
    std::vector<double> sketch, var, abs;  // of the blocks sent to each rank
    double out_sketch = 0, out_var = 0, out_abs = 0;
    int64_t sketched = 0, max_terms = 0, unchecked = 0;
    bool orphaned = false;  // a collective had not completed when the check came
    int64_t step = 0;
    bool backward = false;
    std::vector<GatherRecord> gathers;
    std::vector<ReduceRecord> reduces;
  };

 private:
  static void count_passed();
  [[noreturn]] void report(const std::vector<const int64_t*>& rows);
  void throw_if_differ(const std::vector<const int64_t*>& rows);

  std::shared_ptr<Communicator> agree_;
  Names names_;
  const int n_, me_;
  std::shared_ptr<State> state_;
  bool backward_check_ = false;  // set by begin_check, on the training thread
  Window examined_;              // the window of the check in progress (fill to examine)
};

}  // namespace fsdp::detail
