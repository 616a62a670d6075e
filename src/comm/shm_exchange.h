// ShmExchange: the Exchange (exchange.h) through shared memory, for ranks on one host, instead of
// loopback TCP (which spent ~0.18 s of system CPU per step of the default benchmark in the
// kernel's copies and wake-ups, docs/performance.md).
//
// Each rank owns one segment per exchange (a POSIX shared-memory object, unlinked as soon as
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
// from the peer's channel into their places. Block exchange: rank r writes block j of its input
// into its channel for j; once chunk k (one slot) has arrived from every peer, the consumer reads
// it straight from the slots: no receive buffer.
//
// Every wait is bounded: a job that makes no progress for its timeout fails, naming the ranks it
// waits for; a peer whose process is gone (or a zombie) fails it at once.
// Thread-safety: connect() is collective and runs on the caller's thread; jobs run on one thread
// at a time (the ExchangeWorker's, or a waiter's that it hands them to).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "exchange.h"
#include "shm_segment.h"

namespace c10d {
class Store;
}  // namespace c10d

namespace fsdp::detail {

class ShmExchange final : public Exchange {
 public:
  static constexpr int64_t kSlotBytes = shm::kSlotBytes;
  static constexpr int64_t kSlots = shm::kSlots;

  // Collective over the `world` ranks of a communicator, in the same order on every rank relative
  // to the communicator's other collectives. `key` names the exchange uniquely among those made
  // on `store`. Returns nullptr on every rank when shared memory cannot serve all of them (the
  // ranks are on several hosts, or segments cannot be made), with a warning when they do share
  // this host; when `required`, throws fsdp::Error saying why instead. Every store wait is bounded
  // by `timeout`.
  static std::unique_ptr<ShmExchange> connect(c10d::Store& store, const std::string& key, int rank,
                                              int world, bool required,
                                              std::chrono::milliseconds timeout);
  ~ShmExchange() override;
  ShmExchange(const ShmExchange&) = delete;
  ShmExchange& operator=(const ShmExchange&) = delete;

  void all_gather(const std::vector<std::vector<at::Tensor>>& into,
                  const std::vector<at::Tensor>& pieces,
                  std::chrono::milliseconds timeout) override;
  // Chunks of one slot (kSlotBytes).
  void exchange_blocks(const at::Tensor& input, int64_t n, const ChunkConsumer& consume,
                       std::chrono::milliseconds timeout) override;
  // The running job (if any) and every later one fail at their next idle turn (within a tick).
  void abort() override { aborted_ = true; }
  bool waiter_may_run() const override { return true; }
  void set_patience(Patience patience) override { patience_ = patience; }

 private:
  ShmExchange(int rank, int world);
  struct Stream;
  struct Job;
  bool send_some(Stream& s);  // fills free slots of s's channel; true if it moved anything
  struct Progress {
    bool moved;  // something was received or summed
    bool done;   // everything was
  };
  // Runs `job`: sends what fits of every stream in its `out` and calls `receive` (which adds to
  // the list it is given the ranks it still needs) until both are done, sleeping while neither
  // moves. Under Patience::yield it keeps the job (suspended_) and throws Yielded instead of
  // sleeping.
  void drive(std::unique_ptr<Job> job,
             const std::function<Progress(Job&, std::vector<int>&)>& receive,
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
  Patience patience_;  // set_patience(): how idle() waits, or whether the job yields instead
  // A job that yielded (Patience::yield), resumed by the next call.
  std::unique_ptr<Job> suspended_;
  // The job suspended, or a new one (its sequence number drawn, its streams to make by the caller).
  std::unique_ptr<Job> resume_or_start(std::chrono::milliseconds timeout);
  std::vector<std::unique_ptr<shm::Segment>> seg_;      // by rank; seg_[rank_] is this rank's own
  std::vector<int64_t> pid_;                            // by rank
  std::chrono::steady_clock::time_point last_check_{};  // of the peers' processes
};

}  // namespace fsdp::detail
