// ExchangeWorker: one thread that runs an Exchange's jobs in the order they were issued, so that
// every rank runs the same point-to-point jobs in the same order, off the thread that trains. A
// communicator has two (all-gathers and reduce-scatters, so that gathers never queue behind
// reductions), each over its own Exchange.
// Thread-safety: run() from one thread at a time; the returned Work may be waited from any thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "exchange.h"
#include "util/mutex.h"

namespace fsdp::detail {

class ExchangeWorker {
 public:
  explicit ExchangeWorker(std::unique_ptr<Exchange> exchange);
  // The running job finishes or fails soon (the exchange is aborted); queued ones fail.
  ~ExchangeWorker();
  ExchangeWorker(const ExchangeWorker&) = delete;
  ExchangeWorker& operator=(const ExchangeWorker&) = delete;

  // Queues `job` (run on the worker's thread with the exchange); the Work completes when it
  // returns, or fails with what it threw. The thread starts with the first job.
  c10::intrusive_ptr<c10d::Work> run(c10d::OpType op, std::function<void(Exchange&)> job);

 private:
  struct Job;
  void loop();

  std::unique_ptr<Exchange> exchange_;  // used by the worker's thread only, once jobs run
  Mutex mu_;
  std::condition_variable_any cv_;
  std::deque<Job> queue_ FSDP_GUARDED_BY(mu_);
  bool stopping_ FSDP_GUARDED_BY(mu_) = false;
  std::thread thread_ FSDP_GUARDED_BY(mu_);  // started by the first run()
};

}  // namespace fsdp::detail
