// The phases of one checkpoint save, shared by the synchronous save() (checkpoint_save.cpp) and the
// asynchronous AsyncSaver (async_save.cpp), so that both commit by the same rules
// ([Note: checkpoint atomicity]): collect() copies a rank's bytes to the host, commit_files()
// writes them and commits the index. Internal to the checkpoint code.
// Thread-safety: collect() on the thread that trains (it reads the model and the optimizer);
// commit_files() on any one thread per communicator (its collectives are on `comm` only).
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/checkpoint.h>
#include <fsdp/safetensors.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/optim_state.h"
#include "checkpoint/test_hooks.h"

namespace fsdp::checkpoint::internal {

// Host buffers that a save's bytes are copied into and that are kept for the next save, so that
// an asynchronous save costs the caller one memory copy (no allocation, no page faults after the
// first). Buffers are matched by position, shape and dtype; pinned host memory for CUDA sources.
class Staging {
 public:
  // A host tensor holding a copy of `src` (0-d: one row), reusing buffer `slot` when it fits.
  at::Tensor copy(size_t slot, const at::Tensor& src);
  // Drops the buffers past the last slot used (the model shrank, or rank 0 changed).
  void trim(size_t used);
  uint64_t bytes() const;

 private:
  std::vector<at::Tensor> buffers_;
};

// What one rank writes: its shards' rows (and their optimizer state), and on rank 0 the buffers.
struct RankFile {
  std::vector<at::Tensor> keep;  // the host copies the views point into
  std::vector<safetensors::TensorView> views;
  std::vector<std::pair<int64_t, int64_t>> rows;
  std::vector<int64_t> dims;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<bool> replicated;
  OptKind kind = OptKind::kNone;

  void add(const std::string& name, at::Tensor host, std::pair<int64_t, int64_t> r, int64_t dim,
           std::vector<int64_t> shape, bool repl);
};

// This rank's file: its shards and their optimizer state (rank 0 also the buffers). With
// `staging` every tensor is copied into it, so that the model and the optimizer may change while
// the file is written; without, host tensors may be the shards themselves (CPU), which the caller
// must not change before commit_files() returns.
RankFile collect(const FSDPModule& root, torch::optim::Optimizer* opt, int rank, Staging* staging);

// Phases 1-3 of [Note: checkpoint atomicity] over `comm`: rank 0 prepares DIR/step_<step>, every
// rank writes its file, rank 0 writes the index last; each phase ends in an agreement, so a
// failure on one rank raises on every rank. `prior_error` (a rank's failure before this, e.g. in
// collect()) is raised together at the first agreement. `hooks`: the test seams taken for this
// save (test_hooks.h). Returns the step directory.
std::string commit_files(const std::string& dir, const RankFile& file, const TrainState& state,
                         Communicator& comm, const std::string& prior_error,
                         const test_hooks::Taken& hooks);

// The background writes of this process's AsyncSavers (async_save.cpp): save() waits until none
// is running before it writes, so that it never writes a step directory that a background write
// is writing too (the same temporaries, the files of two saves in one step). begin() when a
// background write starts, end() when its thread is done; wait_idle() throws fsdp::Error naming
// `who` when one is still running after `timeout` (every background step has a timeout of its own).
// Thread-safety: any thread.
void background_write_began();
void background_write_ended();
void wait_for_background_writes(std::chrono::milliseconds timeout, const std::string& who);

}  // namespace fsdp::checkpoint::internal
