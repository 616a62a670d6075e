// AsyncSaver (fsdp/checkpoint_async.h): the foreground copies into the staging buffers, a
// background thread writes and commits.
//
// [Note: asynchronous checkpoints]
// A save has cross-rank steps: the agreement after rank 0 prepares the directory, the one after
// every rank wrote its file, the gather of the files' checksums for the index, the agreement after
// the index, and under HSDP replica 0's outcome sent to the other replicas. They run on the
// background thread while the training thread issues its own collectives, and a Communicator is
// used from one thread at a time, whose collectives every rank issues in the same order. So the
// background thread uses communicators of its own, split from the model's shard (and replicate)
// communicator at the first save_async(): an independent ordering lane with its own process
// group, on which only background threads issue collectives, one save at a time. The splits are
// made on the training thread, where every rank calls save_async() in the same order.
// Chosen over the c10d store (set/wait keys with timeouts): the agreements are then the very ones
// save() runs (commit_files), a rank that dies mid-save is named at once by the process group's
// failure message instead of at a store timeout, and the store client, which the training
// thread's lanes also use, is not shared between threads.
// What runs on the training thread: the call agreement of an explicit collective (a rank that
// skips a save stops every rank by name, as with save()), the buffer check (a small all-gather;
// no collective when the model has no buffers) and the copy into the staging buffers. A failure
// to stage is carried into the background's first agreement, which raises it on every rank. The
// writes, the fsyncs and the checksums run in the background. On fsdp-train's default job the
// step is held about 3 ms per save, of which the copy of 4.8 MB is about 1 ms and the call
// agreement's round most of the rest (fsdp-bench --async-save).
#include <ATen/ATen.h>
#include <fsdp/checkpoint_async.h>
#include <fsdp/state_dict.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <thread>

#include "checkpoint/checkpoint_common.h"
#include "checkpoint/save_phases.h"
#include "checkpoint/test_hooks.h"
#include "comm/rank_agreement.h"
#include "core/explicit_collective.h"
#include "util/mutex.h"

namespace fsdp::checkpoint {

using detail::cat;
using namespace internal;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The message of an fsdp::Error without its "fsdp: " prefix, for nesting in another message.
std::string unprefixed(const std::string& m) { return m.rfind("fsdp: ", 0) == 0 ? m.substr(6) : m; }

// The background writes running in this process (save_phases.h).
struct BackgroundWrites {
  detail::Mutex mu;
  std::condition_variable_any cv;
  int running FSDP_GUARDED_BY(mu) = 0;
};
BackgroundWrites& background_writes() {
  static BackgroundWrites* writes = new BackgroundWrites;  // never destroyed: a writer thread
  return *writes;                                          // may outlive static destruction
}

}  // namespace

namespace internal {

void background_write_began() {
  BackgroundWrites& w = background_writes();
  detail::MutexLock lock(w.mu);
  ++w.running;
}

void background_write_ended() {
  BackgroundWrites& w = background_writes();
  {
    detail::MutexLock lock(w.mu);
    --w.running;
  }
  w.cv.notify_all();
}

void wait_for_background_writes(std::chrono::milliseconds timeout, const std::string& who) {
  BackgroundWrites& w = background_writes();
  detail::MutexLock lock(w.mu);
  const auto until = Clock::now() + timeout;
  while (w.running > 0)
    if (w.cv.wait_until(w.mu, until) == std::cv_status::timeout && w.running > 0)
      throw Error(cat(who, ": an asynchronous save of this process is still writing after ",
                      timeout.count(), " ms; call AsyncSaver::wait() before saving synchronously"));
}

}  // namespace internal

struct AsyncSaver::Impl {
  AsyncSaveOptions options;
  Staging staging;
  // The background lanes: split from the model's shard and replicate communicators.
  Communicator* split_from = nullptr;
  std::shared_ptr<Communicator> shard, replicate;
  std::function<void(const std::string&)> on_commit;
  AsyncSaveStats stats;

  // The save in flight. Written by the background thread, read after join().
  std::thread thread;
  std::string ckpt;  // its step directory
  std::exception_ptr error;
  double write_s = 0;
  std::atomic<bool> finished{true};

  void ensure_lanes(const FSDPModule& root);
  // What the background thread works from, taken on the training thread.
  struct Task {
    RankFile file;
    std::string dir;
    TrainState state;
    test_hooks::Taken hooks;
    bool writes = false;        // replica 0 (or no HSDP): this rank writes its file
    std::string staging_error;  // this rank could not stage: raised at the first agreement
    std::function<void(const std::string&)> on_commit;  // a copy taken at the start
  };
  void run(const Task& task);
  // Joins the save in flight and returns its failure message ("" when none); statistics updated.
  std::string collect();
};

void AsyncSaver::Impl::ensure_lanes(const FSDPModule& root) {
  Communicator& model = root.communicator();
  if (split_from == &model) return;
  FSDP_CHECK(split_from == nullptr,
             "checkpoint save_async: this AsyncSaver saved a model sharded over another "
             "communicator before; use one AsyncSaver per model");
  // Collective over the model's ranks, in the same order on every rank (save_async is).
  shard = model.split("checkpoint-async");
  if (root.replicate_communicator())
    replicate = root.replicate_communicator()->split("checkpoint-async");
  split_from = &model;
}

void AsyncSaver::Impl::run(const Task& task) {
  const auto t0 = Clock::now();
  // This thread only (Linux: a thread's nice value is its own); a failure leaves it as it was.
  if (options.low_priority) (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
  try {
    if (task.hooks.delay.count() > 0) std::this_thread::sleep_for(task.hooks.delay);
    std::exception_ptr failure;
    if (task.writes) {
      try {
        commit_files(task.dir, task.file, task.state, *shard, task.staging_error, task.hooks);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (replicate) {  // HSDP: replica 0's outcome to every replica, as save() sends it
      auto failed = at::tensor(std::vector<int64_t>{failure ? 1 : 0}, at::kLong);
      replicate->broadcast(failed, 0).wait();
      if (!failure && failed.item<int64_t>() != 0)
        throw Error(
            cat("replica 0, which writes for every replica under HSDP, failed (its error "
                "says why)"));
    }
    if (failure) std::rethrow_exception(failure);
    if (task.on_commit) task.on_commit(ckpt);
  } catch (...) {
    error = std::current_exception();
  }
  write_s = seconds_since(t0);
  finished.store(true);
  background_write_ended();
}

std::string AsyncSaver::Impl::collect() {
  if (!thread.joinable()) return {};
  thread.join();
  std::string message;
  if (error) {
    try {
      std::rethrow_exception(std::exchange(error, nullptr));
    } catch (const std::exception& e) {
      message = unprefixed(e.what());
    } catch (...) {
      message = "an exception of unknown type";
    }
    return cat("the asynchronous checkpoint save of '", ckpt,
               "' failed in the background: ", message,
               ". That step is not saved (the step directory has no index.json); the "
               "previous complete checkpoint is still the latest");
  }
  stats.committed += 1;
  stats.write_s += write_s;
  stats.last_write_s = write_s;
  return {};
}

AsyncSaver::AsyncSaver(AsyncSaveOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = options;
}

AsyncSaver::~AsyncSaver() {
  const std::string failure = impl_->collect();
  if (!failure.empty())
    std::fprintf(stderr, "fsdp: %s (no wait() collected it)\n", failure.c_str());
}

std::string AsyncSaver::save_async(const std::string& dir, const FSDPModule& root,
                                   torch::optim::Optimizer* opt, const TrainState& state) {
  const auto t0 = Clock::now();
  internal::refuse_elastic(root, "checkpoint save_async");
  fsdp::detail::agree_explicit_collective(root, fsdp::detail::protocol::Explicit::kCheckpointSave);
  // At most one save in flight: the previous one's failure belongs to its own step and is raised
  // here, before anything of this step is started. No agreement is needed: commit_files raised it
  // on every rank already (only an on_commit failure is one rank's), and after a peer died the
  // model's communicators could not carry one.
  const bool waits = impl_->thread.joinable();
  const auto wait_start = Clock::now();
  if (const std::string failure = impl_->collect(); !failure.empty()) throw Error(failure);
  const double waited = waits ? seconds_since(wait_start) : 0.0;
  FSDP_CHECK(state.step >= 0, "checkpoint save_async: step ", state.step, " is negative");

  // Stage (replica 0 under HSDP: it writes for every replica). A failure to stage is raised on
  // every rank by the background's first agreement (commit_files' prior_error).
  const auto& replicas = root.replicate_communicator();
  impl_->ensure_lanes(root);  // collective on the first call only
  auto task = std::make_shared<Impl::Task>();
  task->dir = dir;
  task->state = state;
  task->hooks = test_hooks::take();
  task->writes = !replicas || replicas->rank() == 0;
  task->on_commit = impl_->on_commit;
  if (task->writes) {
    // Buffers are saved from rank 0: say so when the ranks' copies differ (a small all-gather).
    check_buffers_agree(root, cat("checkpoint save '", dir, "/", step_dir_name(state.step),
                                  "' keeps rank 0's values"));
    task->staging_error = fsdp::detail::error_of(
        [&] { task->file = collect(root, opt, root.communicator().rank(), &impl_->staging); });
  }
  impl_->ckpt = dir + "/" + step_dir_name(state.step);
  impl_->finished.store(false);
  background_write_began();
  try {
    impl_->thread = std::thread([impl = impl_.get(), task] { impl->run(*task); });
  } catch (...) {
    background_write_ended();
    throw;
  }
  AsyncSaveStats& s = impl_->stats;
  s.saves += 1;
  s.last_waited_s = waited;
  s.waited_s += waited;
  s.last_blocked_s = seconds_since(t0);
  s.blocked_s += s.last_blocked_s;
  s.staging_bytes = impl_->staging.bytes();
  return impl_->ckpt;
}

void AsyncSaver::wait() {
  if (const std::string failure = impl_->collect(); !failure.empty()) throw Error(failure);
}

bool AsyncSaver::in_flight() const { return impl_->thread.joinable(); }

bool AsyncSaver::done() const { return impl_->finished.load(); }

void AsyncSaver::set_on_commit(std::function<void(const std::string& ckpt)> fn) {
  impl_->on_commit = std::move(fn);
}

const AsyncSaveStats& AsyncSaver::stats() const { return impl_->stats; }

}  // namespace fsdp::checkpoint
