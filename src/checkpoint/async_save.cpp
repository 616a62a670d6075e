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
// What runs on the training thread: the call agreement of an explicit collective, the buffer check
// (a small all-gather), the copy into the staging buffers, and one agreement on its outcome, so
// that a rank that cannot stage raises at once on every rank. The writes, the fsyncs and the
// checksums run in the background.
#include <ATen/ATen.h>
#include <fsdp/checkpoint_async.h>
#include <fsdp/state_dict.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <thread>

#include "checkpoint/checkpoint_common.h"
#include "checkpoint/save_phases.h"
#include "checkpoint/test_hooks.h"
#include "comm/rank_agreement.h"
#include "core/call_agreement.h"

namespace fsdp::checkpoint {

using detail::cat;
using namespace internal;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The message of an fsdp::Error without its "fsdp: " prefix, for nesting in another message.
std::string unprefixed(const std::string& m) {
  return m.rfind("fsdp: ", 0) == 0 ? m.substr(6) : m;
}

}  // namespace

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
  // The background thread's work; `on_commit_fn`: a copy of on_commit taken when it started.
  void run(const RankFile& file, const std::string& dir, const TrainState& state,
           const test_hooks::Taken& hooks, bool writes,
           const std::function<void(const std::string&)>& on_commit_fn);
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
  if (root.replicate_communicator()) replicate = root.replicate_communicator()->split("checkpoint-async");
  split_from = &model;
}

void AsyncSaver::Impl::run(const RankFile& file, const std::string& dir, const TrainState& state,
                           const test_hooks::Taken& hooks, bool writes,
                           const std::function<void(const std::string&)>& on_commit_fn) {
  const auto t0 = Clock::now();
  // This thread only (Linux: a thread's nice value is its own); a failure leaves it as it was.
  if (options.low_priority) (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
  try {
    if (hooks.delay.count() > 0) std::this_thread::sleep_for(hooks.delay);
    std::exception_ptr failure;
    if (writes) {
      try {
        commit_files(dir, file, state, *shard, {}, hooks);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (replicate) {  // HSDP: replica 0's outcome to every replica, as save() sends it
      auto failed = at::tensor(std::vector<int64_t>{failure ? 1 : 0}, at::kLong);
      replicate->broadcast(failed, 0).wait();
      if (!failure && failed.item<int64_t>() != 0)
        throw Error(cat("replica 0, which writes for every replica under HSDP, failed (its error "
                        "says why)"));
    }
    if (failure) std::rethrow_exception(failure);
    if (on_commit_fn) on_commit_fn(ckpt);
  } catch (...) {
    error = std::current_exception();
  }
  write_s = seconds_since(t0);
  finished.store(true);
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
    return cat("the asynchronous checkpoint save of '", ckpt, "' failed in the background: ",
               message, ". That step is not saved (the step directory has no index.json); the "
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
  if (!failure.empty()) std::fprintf(stderr, "fsdp: %s (no wait() collected it)\n", failure.c_str());
}

std::string AsyncSaver::save_async(const std::string& dir, const FSDPModule& root,
                                   torch::optim::Optimizer* opt, const TrainState& state) {
  const auto t0 = Clock::now();
  fsdp::detail::agree_explicit_collective(root,
                                          fsdp::detail::CallAgreement::Explicit::kCheckpointSave);
  // At most one save in flight: the previous one's failure belongs to its own step and is raised
  // here, before anything of this step is started. No agreement is needed: commit_files raised it
  // on every rank already (only an on_commit failure is one rank's), and after a peer died the
  // model's communicators could not carry one.
  const bool waits = impl_->thread.joinable();
  if (const std::string failure = impl_->collect(); !failure.empty()) throw Error(failure);
  const double waited = waits ? seconds_since(t0) : 0.0;
  FSDP_CHECK(state.step >= 0, "checkpoint save_async: step ", state.step, " is negative");

  // Stage (replica 0 under HSDP: it writes for every replica), then agree on the outcome on every
  // rank of the model, before the background starts.
  const auto& replicas = root.replicate_communicator();
  const bool writes = !replicas || replicas->rank() == 0;
  const std::string ckpt = dir + "/" + step_dir_name(state.step);
  const auto hooks = test_hooks::take();
  auto file = std::make_shared<RankFile>();
  std::string error;
  if (writes) {
    check_buffers_agree(root, cat("checkpoint save '", ckpt, "' keeps rank 0's values"));
    error = fsdp::detail::error_of([&] {
      *file = collect(root, opt, root.communicator().rank(), &impl_->staging);
    });
  }
  fsdp::detail::raise_together(root.communicator(), replicas.get(), error, "checkpoint save");
  impl_->ensure_lanes(root);

  impl_->ckpt = ckpt;
  impl_->finished.store(false);
  impl_->thread = std::thread([impl = impl_.get(), file, dir, state, hooks, writes,
                               on_commit = impl_->on_commit] {
    impl->run(*file, dir, state, hooks, writes, on_commit);
  });
  AsyncSaveStats& s = impl_->stats;
  s.saves += 1;
  s.last_waited_s = waited;
  s.waited_s += waited;
  s.last_blocked_s = seconds_since(t0);
  s.blocked_s += s.last_blocked_s;
  s.staging_bytes = impl_->staging.bytes();
  return ckpt;
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
