// Context: what spans the groups under one root. The communication lanes, the forward call order
// of the current iteration, the running backwards (BackwardPasses), gathered-memory accounting,
// the communication buffer pool, the debug log and the audit.
//
// Thread-safety: one thread trains a model; backward hooks may run on the engine's threads. The
// forward entry points below (on_pre_forward, on_post_forward, forward_prefetch_targets,
// cancel_forward_prefetches) take the backward bookkeeping's mutex, which guards the forward
// order the passes plan from (core/backward_passes.h).
#pragma once

#include <fsdp/communicator.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/agreement.h"
#include "core/audit.h"
#include "core/backward_passes.h"
#include "core/call_agreement.h"
#include "util/mutex.h"

namespace fsdp::detail {

class Group;

// Reuses the flat communication buffers (all-gather receive, full blocks, reduce-scatter send)
// across groups and iterations, as a caching allocator would: buffers freed per collective
// otherwise stay resident under glibc's default malloc policy, or page-fault again when touched.
// One size class per dtype: a request takes the smallest idle buffer holding `numel` to
// numel + numel / 8 elements (a group's full block and its (world, S) buffers differ by padding
// only), as a view of its first `numel` elements. An idle buffer is kept only while the bytes in
// use and idle stay within the most ever in use at once: the pool never holds more than the
// step's own peak of buffers in use.
class BufferPool {
 public:
  at::Tensor acquire(int64_t numel, at::ScalarType dtype, at::Device device);
  // `t` is a tensor acquire returned, or a view of it, given back once. REQUIRES: no collective or
  // other tensor still uses its storage. Throws fsdp::Error for a tensor the pool does not count
  // in use (not from it, or given back already), which two owners would otherwise share.
  void release(at::Tensor t);
  int64_t idle_bytes() const { return idle_bytes_; }
  int64_t in_use_bytes() const { return in_use_bytes_; }
  int64_t peak_in_use_bytes() const { return peak_in_use_bytes_; }

 private:
  std::vector<at::Tensor> idle_;       // whole buffers, 1-D over all of their storage
  std::multiset<const void*> in_use_;  // storages handed out, not given back (empty: null)
  int64_t in_use_bytes_ = 0, idle_bytes_ = 0, peak_in_use_bytes_ = 0;
};

class Context {
 public:
  // `replicate` (HSDP, fsdp/mesh.h): the ranks holding the same shards; null for plain FSDP.
  Context(std::shared_ptr<Communicator> comm, std::shared_ptr<Communicator> replicate, bool audit);
  ~Context();

  // Registration order: children first, the root last.
  const std::vector<Group*>& groups() const { return groups_; }
  Group* root() const { return groups_.empty() ? nullptr : groups_.back(); }
  int index_of(const Group* g) const;
  void add(Group* g);
  void remove(Group* g);

  Communicator& gather_lane() const { return *gather_lane_; }
  Communicator& reduce_lane() const { return *reduce_lane_; }
  // HSDP: the lane on which reduced shard gradients are averaged across replicas; null otherwise.
  Communicator* replicate_lane() const { return replicate_lane_.get(); }
  const std::shared_ptr<Communicator>& replicate() const { return replicate_; }
  // HSDP: the replicate lane for small agreements; null otherwise.
  Communicator* replicate_agree_lane() const { return replicate_agree_lane_.get(); }

  // ---- forward ----
  bool in_forward() const;  // a forward of a sharded module of this context is running
  // Starts a new iteration at the first forward after a backward; records the call order.
  void on_pre_forward(Group* g) FSDP_EXCLUDES(backward_.mutex());
  void on_post_forward(Group* g) FSDP_EXCLUDES(backward_.mutex());
  // Epochs: a new one begins at every top-level forward call and at the end of every backward,
  // the points between which user code (an optimizer step, a load) may write the shards.
  uint64_t epoch() const { return epoch_; }
  void advance_epoch() { ++epoch_; }
  // The current epoch ends: every group still gathered remembers its shards' values.
  void end_epoch();
  // The rounds in which the ranks agree on every forward all-gather (core/call_agreement.h).
  CallAgreement& calls() { return calls_; }
  // The groups to prefetch when `g`'s forward call begins: the one after g in this rank's previous
  // iteration, or g's explicit list; only those resharded here, and only with
  // max_unsharded_groups >= 2.
  std::vector<Group*> forward_prefetch_targets(Group& g) FSDP_EXCLUDES(backward_.mutex());
  // A forward threw: drop gathers nobody will use.
  void cancel_forward_prefetches() FSDP_EXCLUDES(backward_.mutex());
  // Groups in first pre-forward order of this iteration. REQUIRES: backward_.mutex() held, or
  // no backward running (BackwardPass reads it under the mutex, from the hooks).
  const std::vector<Group*>& forward_order() const FSDP_NO_THREAD_SAFETY_ANALYSIS {
    return forward_order_;
  }
  // Groups by the order in which their (last) forward call of this iteration completed; the
  // same REQUIRES.
  const std::vector<Group*>& completion_order() const FSDP_NO_THREAD_SAFETY_ANALYSIS {
    return completion_order_;
  }

  // ---- backward ----
  BackwardPasses& backward() { return backward_; }  // the hooks' entry points
  // A backward ended (its final callback): the next forward starts a new iteration and epoch.
  // REQUIRES: backward_.mutex() held (BackwardPasses::finalize holds it; clang cannot tell that
  // its ctx_.backward_ is itself, hence no annotation).
  void on_backward_end() FSDP_NO_THREAD_SAFETY_ANALYSIS;
  // Bounded waits for reductions in flight (BackwardPass::reap_reductions): after
  // kMaxReapWaitExpiries of them ran out of time, later passes only poll (a warning says so once).
  static constexpr int kMaxReapWaitExpiries = 3;
  bool reap_waits_enabled() const { return reap_wait_expiries_ < kMaxReapWaitExpiries; }
  void on_reap_wait_expired(const Group& g, int waited_ms);

  // ---- all-gather lane log (audit) and gathered memory, from all-gather issue to reshard ----
  // Bytes count every group; groups count all but the root, which by default stays gathered
  // from forward to the end of backward (the quantity max_unsharded_groups bounds).
  void on_gather_issued(const Group* g);
  void on_resharded(const Group* g);
  int64_t unsharded_bytes() const { return unsharded_bytes_; }
  int64_t peak_unsharded_bytes() const { return peak_unsharded_bytes_; }
  // hpZ: the post-forward chunks held ([Note: resharding to a smaller world after forward]).
  void on_chunk(int64_t delta_bytes) {
    chunk_bytes_ += delta_bytes;
    peak_chunk_bytes_ = std::max(peak_chunk_bytes_, chunk_bytes_);
  }
  int64_t chunk_bytes() const { return chunk_bytes_; }
  int64_t peak_chunk_bytes() const { return peak_chunk_bytes_; }
  int unsharded_groups() const { return unsharded_groups_; }
  int peak_unsharded_groups() const { return peak_unsharded_groups_; }
  void reset_peaks();

  BufferPool& pool() { return pool_; }
  const BufferPool& pool() const { return pool_; }
  bool debug() const { return debug_; }
  void log(const Group* g, const std::string& event) const;
  Audit& audit() { return audit_; }
  Agreement& agreement() { return agreement_; }
  // Agreed, checked at the end of every backward and of every forward of the root without grad
  // mode: on the shard lane and, under HSDP, the replicate lane (core/agreement.h).
  void check_agreement();
  // At the end of a backward: the Agreed check, carrying which parameters each rank contributed
  // a gradient to, then the shards' gradients settled by the mesh's answer
  // ([Note: parameters that got no gradient]).
  // Returns the mesh's bits (contribution_bits' layout).
  std::vector<uint64_t> check_agreement_and_settle();
  // One bit per parameter of every group (registration order, then parameter order): this rank
  // contributed to its reduction (ParamState::contributed).
  std::vector<uint64_t> contribution_bits() const;
  // Settles every group that wrote shards' gradients, from `any_rank` (contribution_bits' layout,
  // ORed over the mesh).
  void settle_shard_grads(const std::vector<uint64_t>& any_rank);
  // HSDP, when a synced backward begins: every rank decided each group's all-reduce alike
  // (Agreement::check_all_reduce_settings).
  void check_all_reduce_settings();

 private:
  std::shared_ptr<Communicator> comm_, gather_lane_, reduce_lane_;
  std::shared_ptr<Communicator> replicate_, replicate_lane_;
  std::vector<Group*> groups_;
  // Declared before what it guards. Its passes refer to the groups and this context.
  BackwardPasses backward_{*this};
  // Groups in first pre-forward order this iteration, and the previous iteration's.
  std::vector<Group*> forward_order_ FSDP_GUARDED_BY(backward_.mutex());
  std::vector<Group*> last_forward_order_ FSDP_GUARDED_BY(backward_.mutex());
  // By last completed forward call, this iteration.
  std::vector<Group*> completion_order_ FSDP_GUARDED_BY(backward_.mutex());
  // A forward after this starts a new iteration.
  bool backward_done_ FSDP_GUARDED_BY(backward_.mutex()) = true;
  int64_t unsharded_bytes_ = 0, peak_unsharded_bytes_ = 0;
  int64_t chunk_bytes_ = 0, peak_chunk_bytes_ = 0;
  int unsharded_groups_ = 0, peak_unsharded_groups_ = 0;
  bool debug_ = false;
  int reap_wait_expiries_ = 0;
  std::shared_ptr<Communicator> agree_lane_, replicate_agree_lane_;
  uint64_t epoch_ = 1;
  Audit audit_;
  Agreement agreement_;
  CallAgreement calls_{*this};
  BufferPool pool_;
};

}  // namespace fsdp::detail
