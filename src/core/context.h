// Context: what spans the groups under one root. The communication lanes, the forward call order
// of the current iteration, the live BackwardPass of each running backward (one per GraphTask),
// gathered-memory accounting, the communication buffer pool, the debug log and the audit.
//
// Thread-safety: hooks run on the thread that called backward (CPU engine); backward bookkeeping
// is serialised by mutex().
#pragma once

#include <fsdp/communicator.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/audit.h"

namespace fsdp::detail {

class Group;
class BackwardPass;
}  // namespace fsdp::detail
namespace torch::autograd {
struct Node;
}
namespace fsdp::detail {

// Reuses the flat communication buffers across groups and iterations, as a caching allocator
// would: sharded blocks have equal sizes, and buffers freed per collective otherwise stay resident
// under glibc's default malloc policy (and page-fault again when touched). Keeps at most
// kPerSize idle buffers of each (elements, dtype).
class BufferPool {
 public:
  at::Tensor acquire(int64_t numel, at::ScalarType dtype);
  void release(at::Tensor t);  // REQUIRES: no collective still uses t

 private:
  static constexpr size_t kPerSize = 2;
  std::map<std::pair<int64_t, int>, std::vector<at::Tensor>> idle_;
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

  // ---- forward ----
  bool in_forward() const;  // a forward of a sharded module of this context is running
  // Starts a new iteration at the first forward after a backward; records the call order.
  void on_pre_forward(Group* g);
  void on_post_forward(Group* g);
  // Issues the all-gather of the group expected to run next (the order recorded in the previous
  // iteration, or the explicit override list). Depends only on call order and settings.
  void prefetch_forward(Group* g);
  void cancel_forward_prefetches();  // a forward threw: drop gathers nobody will use
  // Groups in first pre-forward order of this iteration.
  const std::vector<Group*>& forward_order() const { return forward_order_; }
  // Groups by the order in which their (last) forward call of this iteration completed.
  const std::vector<Group*>& completion_order() const { return completion_order_; }

  // ---- backward ----
  BackwardPass* current_pass();  // of the current GraphTask; null outside a backward
  // Creates it at the first output hook of a GraphTask (`node`: the node whose hook fires).
  BackwardPass& pass_for_hook(Group* g, const torch::autograd::Node* node);
  std::recursive_mutex& mutex() { return mu_; }

  // ---- all-gather lane log (audit) and gathered memory, from all-gather issue to reshard ----
  // Bytes count every group; groups count all but the root, which by default stays gathered
  // from forward to the end of backward (the quantity max_unsharded_groups bounds).
  void on_gather_issued(const Group* g);
  void on_resharded(const Group* g);
  int64_t unsharded_bytes() const { return unsharded_bytes_; }
  int64_t peak_unsharded_bytes() const { return peak_unsharded_bytes_; }
  int unsharded_groups() const { return unsharded_groups_; }
  int peak_unsharded_groups() const { return peak_unsharded_groups_; }
  void reset_peaks();

  BufferPool& pool() { return pool_; }
  bool debug() const { return debug_; }
  void log(const Group* g, const std::string& event) const;
  Audit& audit() { return audit_; }

 private:
  void finalize(const void* key);
  void claim_task(const void* key, const Group* g);  // one root per backward (see context.cpp)

  std::shared_ptr<Communicator> comm_, gather_lane_, reduce_lane_;
  std::shared_ptr<Communicator> replicate_, replicate_lane_;
  std::vector<Group*> groups_;
  std::recursive_mutex mu_;
  std::map<const void*, std::unique_ptr<BackwardPass>> passes_;  // by GraphTask
  std::vector<Group*> forward_order_;       // groups in first pre-forward order, this iteration
  std::vector<Group*> last_forward_order_;  // the previous iteration's
  std::vector<Group*> completion_order_;    // by last completed forward call, this iteration
  bool backward_done_ = true;               // a forward after this starts a new iteration
  int64_t unsharded_bytes_ = 0, peak_unsharded_bytes_ = 0;
  int unsharded_groups_ = 0, peak_unsharded_groups_ = 0;
  bool debug_ = false;
  Audit audit_;
  BufferPool pool_;
};

}  // namespace fsdp::detail
