// ExchangeWorker: runs an Exchange's jobs one at a time, in the order they were issued, so that
// every rank runs the same point-to-point jobs in the same order. A communicator has two
// (all-gathers and reduce-scatters, so that gathers never queue behind reductions), each over its
// own Exchange.
//
// Who runs a job depends on the exchange (Exchange::waiter_may_run):
// - TCP: the worker's thread, as soon as the job is queued (its sends block).
// - Shared memory: the threads that use the job run it, so that a small collective costs no
//   hand-off between threads (on a machine whose cores all train, waking a worker and being woken
//   by it cost more than the copies themselves): the thread that issues it, or polls its Work,
//   moves what it can without waiting (the job yields, and resumes later where it stopped); the
//   thread that waits for its Work runs it, and the jobs queued before it, to the end. The
//   worker's thread is the backstop: it runs a job that has waited kBackstop with nobody running
//   it (nobody waits for it yet: the result is wanted later, or this rank waits on the other
//   exchange first, which its peers may need this job to finish), so every job progresses without
//   a waiter, and ranks that wait for the two exchanges in different orders cannot deadlock.
// Thread-safety: run() from one thread at a time; the returned Work may be waited from any thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "exchange.h"

namespace fsdp::detail {

class ExchangeWorker {
 public:
  // How long a job may sit in the queue, nobody running it, before the worker's thread runs it
  // (shared memory); also how often a worker with jobs about looks. fsdp-bench --preset overhead
  // at N=2 (2026-12-06, interleaved, 4 rounds): 1 ms, 0.056-0.064 s per step; 20 ms, 0.047-0.062
  // (the worker's wake-ups take the cores the training needs); issuers, pollers and waiters ran
  // all but 0.3% of the jobs either way.
  static constexpr auto kBackstop = std::chrono::milliseconds(20);

  explicit ExchangeWorker(std::unique_ptr<Exchange> exchange);
  // The running job finishes or fails soon (the exchange is aborted); queued ones fail.
  ~ExchangeWorker();
  ExchangeWorker(const ExchangeWorker&) = delete;
  ExchangeWorker& operator=(const ExchangeWorker&) = delete;

  // Queues `job` (run with the exchange, on the worker's thread or a waiter's); the Work completes
  // when it returns, or fails with what it threw. The thread starts with the first job.
  c10::intrusive_ptr<c10d::Work> run(c10d::OpType op, std::function<void(Exchange&)> job);

  // How often the worker's thread has woken from a sleep (a notification, or its own timer).
  int64_t worker_wakeups() const;

  struct State;  // the queue and the exchange, shared with the Works (which may outlive this)

 private:
  std::shared_ptr<State> state_;
  std::thread thread_;  // started by the first run()
};

}  // namespace fsdp::detail
