#include "exchange_worker.h"

#include <fsdp/error.h>

#include <atomic>
#include <condition_variable>
#include <deque>

#include "util/mutex.h"

namespace fsdp::detail {

namespace {
using Clock = std::chrono::steady_clock;
using Patience = Exchange::Patience;
// How each runner waits for the peers (Exchange::set_patience): a waiter watches their doorbell a
// while before sleeping (its core would idle anyway); the worker's thread briefly (it shares its
// core with the training); the thread that issues or polls a job does what it can without waiting
// and leaves the rest (the job yields). Measured: fsdp-bench --preset overhead, N=2, every job run
// on the thread that issued it, 0 / 30 / 150 us: 0.066 / 0.053 / 0.045 s per step (2026-12-06);
// the worker's 30 us, fsdp-bench --comm at N=4, 1-64 MiB: reduce-scatter / all-gather 0.62-1.05
// without it, 0.74-1.26 with it, training steps unchanged (2026-12-02).
constexpr auto kWaiterSpin = std::chrono::microseconds(150);
constexpr auto kWorkerSpin = std::chrono::microseconds(30);
const Patience kWorker{kWorkerSpin, false};
const Patience kIssuerOrPoller{std::chrono::microseconds(0), true};
// A worker with nothing queued for this long sleeps until the next job wakes it, instead of
// looking every kBackstop.
constexpr auto kParkAfter = std::chrono::milliseconds(200);
}  // namespace

// A Work completed by whichever thread ran its job (c10d::Work::finish is protected), with a
// future for completion callbacks (the communicator's trace spans). Where the exchange allows,
// waiting for it runs the queued jobs up to it, and polling it moves them as far as they go
// without waiting (exchange_worker.h).
class ExchangeWork : public c10d::Work {
 public:
  ExchangeWork(c10d::OpType op, std::weak_ptr<ExchangeWorker::State> state)
      : c10d::Work(-1, op), state_(std::move(state)) {}
  void complete(std::exception_ptr error) {
    finish(error);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
    }
  }
  bool done() { return c10d::Work::isCompleted(); }
  bool wait(std::chrono::milliseconds timeout) override;
  bool isCompleted() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::weak_ptr<ExchangeWorker::State> state_;
  c10::intrusive_ptr<c10::ivalue::Future> future_ =
      c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
};

struct ExchangeWorker::State {
  struct Job {
    std::function<void(Exchange&)> run;
    c10::intrusive_ptr<ExchangeWork> work;
    Clock::time_point queued;
  };

  explicit State(std::unique_ptr<Exchange> e)
      : exchange(std::move(e)), by_waiter(exchange->waiter_may_run()) {}

  // Pops the front job and runs it with `patience` (mu released meanwhile), or fails it once
  // stopping. False when the job yielded: it is back at the front of the queue.
  bool run_front(const Patience& patience) FSDP_REQUIRES(mu);
  // A waiter: runs the jobs up to w (or waits for whoever runs them) until w completes or `until`.
  void run_until(ExchangeWork& w, Clock::time_point until);
  // A poller: moves the jobs up to w as far as they go without waiting.
  void poll(ExchangeWork& w);
  // The worker's thread: every job at once (TCP), or those queued kBackstop with nobody running
  // them (shared memory).
  void loop();

  const std::unique_ptr<Exchange> exchange;  // used by the thread that set `running`
  const bool by_waiter;                      // exchange->waiter_may_run()
  Mutex mu;
  // Waiters sleep on `cv` (a job finished or yielded), the worker's thread on `worker_cv` (a job
  // for a parked worker; stop): a job that ends wakes no worker that is only waiting for the
  // backstop's time to pass.
  std::condition_variable_any cv;
  std::condition_variable_any worker_cv;
  std::deque<Job> queue FSDP_GUARDED_BY(mu);
  bool running FSDP_GUARDED_BY(mu) = false;  // a thread runs the job popped last
  bool parked FSDP_GUARDED_BY(mu) = false;   // the worker sleeps until notified
  bool stopping FSDP_GUARDED_BY(mu) = false;
  std::atomic<int64_t> wakeups{0};  // the worker's thread, out of a wait on worker_cv
};

bool ExchangeWorker::State::run_front(const Patience& patience) {
  Job job = std::move(queue.front());
  queue.pop_front();
  if (stopping) {
    job.work->complete(std::make_exception_ptr(
        Error("the communicator was destroyed before this collective ran")));
    return true;
  }
  running = true;
  mu.unlock();
  bool yielded = false;
  std::exception_ptr error;
  try {
    exchange->set_patience(patience);
    job.run(*exchange);
  } catch (const Exchange::Yielded&) {
    yielded = true;
  } catch (...) {
    error = std::current_exception();
  }
  if (!yielded) job.work->complete(error);
  mu.lock();
  if (yielded && stopping) {  // the worker has failed the queue already: nobody would run it
    job.work->complete(std::make_exception_ptr(
        Error("the communicator was destroyed before this collective finished")));
  } else if (yielded) {
    queue.push_front(std::move(job));
  }
  running = false;
  cv.notify_all();
  return !yielded;
}

void ExchangeWorker::State::run_until(ExchangeWork& w, Clock::time_point until) {
  MutexLock lock(mu);
  // Until w completes it is queued or running; whoever runs a job clears `running` after
  // completing its Work (or putting it back), and notifies.
  while (!w.done() && Clock::now() < until) {
    if (!running && !queue.empty()) {
      run_front(Patience{kWaiterSpin, false, until});
    } else if (until == Clock::time_point::max()) {
      cv.wait(mu);
    } else {
      cv.wait_until(mu, until);
    }
  }
}

void ExchangeWorker::State::poll(ExchangeWork& w) {
  MutexLock lock(mu);
  while (!w.done() && !running && !queue.empty())
    if (!run_front(kIssuerOrPoller)) return;
}

void ExchangeWorker::State::loop() {
  MutexLock lock(mu);
  auto last_busy = Clock::now();
  while (!stopping) {
    const auto now = Clock::now();
    if (running || !queue.empty()) last_busy = now;
    if (!running && !queue.empty()) {
      const auto age = now - queue.front().queued;
      if (!by_waiter || age >= kBackstop) {
        run_front(kWorker);
        continue;
      }
      worker_cv.wait_for(mu, kBackstop - age);
    } else if (!by_waiter || now - last_busy >= kParkAfter) {
      parked = true;
      worker_cv.wait(mu);
      parked = false;
      last_busy = Clock::now();
    } else {
      worker_cv.wait_for(mu, kBackstop);
    }
    wakeups.fetch_add(1, std::memory_order_relaxed);
  }
  // Stopping: the queued jobs fail (a waiter may still be finishing the running one).
  while (!queue.empty()) run_front(kWorker);
}

bool ExchangeWork::wait(std::chrono::milliseconds timeout) {
  if (auto state = state_.lock(); state && state->by_waiter) {
    // c10d's kNoTimeout (0): no limit of the wait's own; the job's still applies.
    const bool limited = timeout > std::chrono::milliseconds(0);
    const auto start = Clock::now();
    state->run_until(*this, limited ? start + timeout : Clock::time_point::max());
    if (!done()) {  // `timeout` has passed: the base class times out, with the time left
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(start + timeout - Clock::now());
      return c10d::Work::wait(std::max(left, std::chrono::milliseconds(1)));
    }
  }
  return c10d::Work::wait(timeout);
}

bool ExchangeWork::isCompleted() {
  if (done()) return true;
  if (auto state = state_.lock(); state && state->by_waiter) state->poll(*this);
  return done();
}

ExchangeWorker::ExchangeWorker(std::unique_ptr<Exchange> exchange)
    : state_(std::make_shared<State>(std::move(exchange))) {}

ExchangeWorker::~ExchangeWorker() {
  {
    MutexLock lock(state_->mu);
    state_->stopping = true;
  }
  state_->exchange->abort();  // a job waiting for its peers ends soon
  state_->cv.notify_all();
  state_->worker_cv.notify_all();
  if (thread_.joinable()) thread_.join();
}

c10::intrusive_ptr<c10d::Work> ExchangeWorker::run(c10d::OpType op,
                                                   std::function<void(Exchange&)> job) {
  auto work = c10::make_intrusive<ExchangeWork>(op, state_);
  bool wake = false;
  State& s = *state_;
  {
    MutexLock lock(s.mu);
    s.queue.push_back(State::Job{std::move(job), work, Clock::now()});
    if (!thread_.joinable()) thread_ = std::thread([state = state_] { state->loop(); });
    if (!s.by_waiter) {
      wake = true;
    } else {
      wake = s.parked;
      // Nothing runs before it: this thread sends what it can and takes what has arrived.
      if (!s.running && s.queue.size() == 1) s.run_front(kIssuerOrPoller);
    }
  }
  if (wake) s.worker_cv.notify_all();
  return work;
}

int64_t ExchangeWorker::worker_wakeups() const {
  return state_->wakeups.load(std::memory_order_relaxed);
}

}  // namespace fsdp::detail
