// Asynchronous sharded checkpoints: save_async() holds the training thread only while this rank's
// shards and optimizer state are copied into host staging buffers (pinned memory for CUDA
// tensors); the files and the index are then written and committed on a background thread, by the
// same rules as checkpoint::save() ([Note: checkpoint atomicity], docs/checkpoint.md): every rank
// renames its file into place, rank 0 writes index.json last, so a crash at any moment leaves the
// previous complete checkpoint the latest one.
//
// At most one save is in flight: the next save_async() first waits for the previous one (that
// wait is measured: AsyncSaveStats::waited_s). A failure of the background write (disk full, a
// peer rank that died) is kept and raised as fsdp::Error by the next save_async() or by wait(),
// on every rank; it is never dropped (the destructor reports one that nobody collected).
//
// The background commit needs cross-rank steps (agreements, the gather of the ranks' checksums).
// It runs them on communicators of its own, split from the model's at the first save_async(), so
// that they never share a communicator with the collectives training issues meanwhile
// ([Note: asynchronous checkpoints] in src/checkpoint/async_save.cpp).
//
// Thread-safety: one AsyncSaver per model, used from the thread that trains; save_async() is a
// collective (every rank calls it in the same order, like save()). wait() and the destructor
// block until the write in flight ends.
#pragma once

#include <fsdp/checkpoint.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace fsdp::checkpoint {

// Times of one rank's asynchronous saves, in seconds.
struct AsyncSaveStats {
  int64_t saves = 0;      // save_async() calls that started a write
  int64_t committed = 0;  // writes that completed (collected by wait() or the next save_async())
  // How long save_async() held the caller: the wait for the previous save, the copy into the
  // staging buffers and the agreements around it. Totals and the last call's.
  double blocked_s = 0, last_blocked_s = 0;
  double waited_s = 0, last_waited_s = 0;  // the part of blocked_s spent waiting for the previous
  double write_s = 0, last_write_s = 0;    // background time of the completed writes
  uint64_t staging_bytes = 0;              // host memory the staging buffers hold between saves
};

struct AsyncSaveOptions {
  // The background thread runs at the lowest CPU priority (nice 19, this thread only): on a host
  // whose cores the training keeps busy, the write then takes the gaps (the waits in collectives)
  // instead of slowing the steps it overlaps; it may take longer. false: the trainer's priority.
  bool low_priority = true;
};

class AsyncSaver {
 public:
  explicit AsyncSaver(AsyncSaveOptions options = {});
  // Waits for the save in flight. A failure that neither wait() nor a later save_async()
  // collected is written to stderr, since a destructor cannot throw: call wait() first.
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  // Collective: waits for the previous save (raising its failure), copies this rank's shards and
  // optimizer state (rank 0: also the buffers) into the staging buffers, and starts writing
  // DIR/step_<state.step> in the background; returns that directory. When it returns, the model
  // and the optimizer may change. Arguments as for save(); under HSDP replica 0 writes and the
  // other replicas wait for its outcome in the background. The staging buffers (one copy of this
  // rank's checkpoint bytes) are kept for the next save.
  std::string save_async(const std::string& dir, const FSDPModule& root,
                         torch::optim::Optimizer* opt, const TrainState& state);

  // Waits for the save in flight, if any, and raises its failure (once) as fsdp::Error naming the
  // step directory; the previous complete checkpoint is then still the latest.
  void wait();

  // A save was started and neither wait() nor a later save_async() has collected it yet.
  bool in_flight() const;
  // The save in flight has finished its background work (true when none is in flight).
  bool done() const;

  // Runs on the background thread of every rank after a save committed, with its step
  // directory (e.g. retention with keep_last on rank 0, which must not run before the commit).
  // An exception it throws is the save's failure on that rank alone. Takes effect from the next
  // save_async().
  void set_on_commit(std::function<void(const std::string& ckpt)> fn);

  const AsyncSaveStats& stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp::checkpoint
