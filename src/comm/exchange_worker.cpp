#include "exchange_worker.h"

#include <fsdp/error.h>

namespace fsdp::detail {

// A Work completed by the worker's thread (c10d::Work::finish is protected), with a future for
// completion callbacks (the communicator's trace spans).
class ExchangeWork : public c10d::Work {
 public:
  explicit ExchangeWork(c10d::OpType op) : c10d::Work(-1, op) {}
  void complete(std::exception_ptr error) {
    finish(error);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
    }
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_ =
      c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
};

struct ExchangeWorker::Job {
  std::function<void(Exchange&)> run;
  c10::intrusive_ptr<ExchangeWork> work;
};

ExchangeWorker::ExchangeWorker(std::unique_ptr<Exchange> exchange)
    : exchange_(std::move(exchange)) {}

ExchangeWorker::~ExchangeWorker() {
  std::thread worker;
  {
    MutexLock lock(mu_);
    stopping_ = true;
    worker = std::move(thread_);
  }
  exchange_->abort();  // a job waiting for its peers ends soon
  cv_.notify_all();
  if (worker.joinable()) worker.join();
}

c10::intrusive_ptr<c10d::Work> ExchangeWorker::run(c10d::OpType op,
                                                   std::function<void(Exchange&)> job) {
  auto work = c10::make_intrusive<ExchangeWork>(op);
  {
    MutexLock lock(mu_);
    queue_.push_back(Job{std::move(job), work});
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  }
  cv_.notify_one();
  return work;
}

void ExchangeWorker::loop() {
  for (;;) {
    Job job;
    {
      MutexLock lock(mu_);
      while (!stopping_ && queue_.empty()) cv_.wait(mu_);
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      if (stopping_) {
        job.work->complete(std::make_exception_ptr(
            Error("the communicator was destroyed before this collective ran")));
        continue;
      }
    }
    try {
      job.run(*exchange_);
      job.work->complete(nullptr);
    } catch (...) {
      job.work->complete(std::current_exception());
    }
  }
}

}  // namespace fsdp::detail
