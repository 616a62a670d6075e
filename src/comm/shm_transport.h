// Shared-memory transport between ranks on one host: the point-to-point all-gather and the
// rank-order reduce-scatter of RingReduceScatter, moved through shared memory instead of loopback
// TCP (which spent ~0.18 s of system CPU per step of the default benchmark in the kernel's copies
// and wake-ups, docs/performance.md).
//
// Each rank owns one segment per transport (a POSIX shared-memory object, unlinked as soon as
// every rank has mapped it: nothing is left in /dev/shm once the rendezvous is over, even if a
// process is killed later). It holds one channel per peer: a ring of kSlots slots of kSlotBytes,
// written by the owner (head) and consumed by that peer (tail). A stream of bytes from rank r to
// rank j travels through r's channel for j in slot-sized pieces, each slot stamped with the job's
// sequence number, the stream's total size and the piece's offset: a consumer checks them, so
// ranks that disagree on a collective's sizes or order fail with an error naming both, instead of
// exchanging the wrong bytes. Each rank has a doorbell (a futex word in its own segment) that a
// peer rings after filling or freeing a slot for it; an idle rank sleeps on its doorbell.
//
// All-gather: rank r writes its pieces into every peer's channel, and copies each peer's pieces
// from the peer's channel into their places. Reduce-scatter: rank r writes block j of its input
// into its channel for j; once chunk k has arrived from every peer it is summed in rank order
// (sum_in_rank_order, this rank's own chunk read where it lies) straight from the slots: bitwise
// the sums of the alltoall path, with no receive buffer.
//
// Every wait is bounded: a job that makes no progress for its timeout fails, naming the ranks it
// waits for; a peer whose process is gone (or a zombie) fails it at once. Ranks must run their jobs
// in the same order (one worker thread per transport does: RingReduceScatter's).
// Thread-safety: connect() is collective and runs on the caller's thread; all_gather() and
// reduce() are called from one thread at a time (the worker's).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
}  // namespace c10d

namespace fsdp::detail {

class ShmTransport {
 public:
  static constexpr int64_t kSlotBytes = 256 << 10;  // a multiple of every element size
  static constexpr int64_t kSlots = 4;              // per channel: 1 MiB per peer per transport

  // FSDP_TRANSPORT: "auto" (default: shared memory when every rank is on this host, in this
  // network namespace, and the segments can be made; TCP otherwise, with a warning when the ranks
  // do share the host), "shm" (shared memory or an error saying why not) or "tcp".
  enum class Mode { kAuto, kShm, kTcp };
  static Mode mode_from_env();

  // Collective over the `world` ranks of a communicator, in the same order on every rank relative
  // to the communicator's other collectives. `key` names the transport uniquely among those made
  // on `store`. Returns nullptr on every rank when shared memory cannot serve all of them (or mode
  // is kTcp); throws fsdp::Error in mode kShm then. Every store wait is bounded by `timeout`.
  static std::unique_ptr<ShmTransport> connect(c10d::Store& store, const std::string& key, int rank,
                                               int world, Mode mode,
                                               std::chrono::milliseconds timeout);
  ~ShmTransport();
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  // into[j][i] receives peer j's pieces[i] (into[rank] untouched); sizes as
  // RingReduceScatter::run_all_gather_pieces. Tensors contiguous, on CPU.
  void all_gather(const std::vector<std::vector<at::Tensor>>& into,
                  const std::vector<at::Tensor>& pieces, std::chrono::milliseconds timeout);
  // output (n) = sum over ranks in rank order of block `rank` of each rank's input (N*n), divided
  // by N when `average`; output may be this rank's own block of the input.
  void reduce(const at::Tensor& output, const at::Tensor& input, bool average,
              std::chrono::milliseconds timeout);

  // Makes the running job (if any) and every later one fail at their next idle turn (within
  // kTick) instead of waiting for their peers: the owner is being destroyed. Any thread.
  void abort() { aborted_ = true; }

  struct Segment;  // a mapped segment (shm_transport.cpp)

 private:
  ShmTransport(int rank, int world);
  struct Stream;
  bool send_some(Stream& s);  // fills free slots of s's channel; true if it moved anything
  struct Progress {
    bool moved;  // something was received or summed
    bool done;   // everything was
  };
  // Runs one job: sends what fits of every stream in `out` and calls `receive` (which adds to the
  // list it is given the ranks it still needs) until both are done, sleeping while neither moves.
  void drive(std::vector<Stream>& out, const std::function<Progress(std::vector<int>&)>& receive,
             std::chrono::milliseconds timeout);
  void ring(int peer);  // rings peer's doorbell
  // Sleeps until the doorbell rings after `seen` (or a short tick), checking peers' processes and
  // the job's deadline; `waiting_for` names the ranks this rank still waits on.
  void idle(uint32_t seen, const std::vector<int>& waiting_for,
            std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout);
  uint32_t bell() const;

  int rank_, world_;
  uint64_t jobs_ = 0;  // the sequence number of the next job
  std::atomic<bool> aborted_{false};
  std::vector<std::unique_ptr<Segment>> seg_;           // by rank; seg_[rank_] is this rank's own
  std::vector<int64_t> pid_;                            // by rank
  std::chrono::steady_clock::time_point last_check_{};  // of the peers' processes
};

}  // namespace fsdp::detail
