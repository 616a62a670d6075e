// CommContext: what the groups of one root share and the root hands down to each (FSDP2's
// comm_ctx): the lanes their collectives travel on, the communication-buffer pool, the account of
// gathered memory and the debug log. It refers to no group and calls none: groups use it, the root
// owns it.
// Thread-safety: used by the root's training thread only (the backward's hooks run on it on CPU,
// under the root's mutex).
#pragma once

#include <fsdp/communicator.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/lane.h"

namespace fsdp::detail {

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

// Gathered memory, from each all-gather's issue to its reshard. Bytes count every group; groups
// count all but the root, which by default stays gathered from forward to the end of backward
// (the quantity max_unsharded_groups bounds).
struct GatheredMemory {
  int64_t bytes = 0, peak_bytes = 0;
  int groups = 0, peak_groups = 0;
  int64_t chunk_bytes = 0, peak_chunk_bytes = 0;  // hpZ's post-forward chunks
  void gathered(int64_t b, bool counts_as_group);
  void resharded(int64_t b, bool counts_as_group);
  void chunk(int64_t delta);
  void reset_peaks();
};

struct CommContext {
  // `replicate` (HSDP, fsdp/mesh.h): the ranks holding the same shards; null for plain FSDP.
  CommContext(std::shared_ptr<Communicator> comm, std::shared_ptr<Communicator> replicate);

  std::shared_ptr<Communicator> comm;       // the shard group
  std::shared_ptr<Communicator> replicate;  // HSDP: across replicas; null otherwise
  Lane gather, reduce;                      // the all-gathers and the reduce-scatters
  std::unique_ptr<Lane> replicate_reduce;   // HSDP: the all-reduces across replicas
  // Small cross-rank messages: the Agreed exchange (and, across replicas, the rounds' checks).
  std::shared_ptr<Communicator> agree, replicate_agree;
  BufferPool pool;
  GatheredMemory memory;
  bool debug = false;  // FSDP_DEBUG: every event logged to stderr

  // Replaces the replicate communicator and its lanes (an elastic job's new membership,
  // fsdp/elastic.h): collective over the new one's ranks, between steps only.
  void rebind_replicate(std::shared_ptr<Communicator> r);

  // hpZ's lane over `comm` (a post-forward subgroup of the shard group), watched by the gather
  // lane's observers: its all-gathers belong to the gather sequence.
  Lane& post_forward(const std::shared_ptr<Communicator>& comm);
  void log(const std::string& who, const std::string& event) const;

 private:
  std::map<const Communicator*, std::unique_ptr<Lane>> post_forward_;
};

}  // namespace fsdp::detail
