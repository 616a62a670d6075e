// fsdp-bench --async-save: what an asynchronous checkpoint (checkpoint::AsyncSaver) costs the
// training step, against a synchronous checkpoint::save of the same state, side by side in one
// run. fsdp-train's GPT and AdamW (train/model_setup.h; --preset train, the default here, is
// fsdp-train's default job; --preset mem the wide model whose checkpoint is large) train on
// synthetic batches; each round takes baseline steps, a synchronous save (timed) and K steps after
// it, then an asynchronous save (the time it holds the step) and K steps after it (timed, and
// marked whether its background write was still running: the overlapped steps), then two
// asynchronous saves back to back (the second waits for the first: that wait). Rank 0 prints one
// JSON line per round and a summary line with the medians, the ratios and issue 49's targets
// (blocking <= one step and <= 10% of a synchronous save; the steps that overlap the write <= 5%
// slower than the same steps after the synchronous save: the median over rounds of each round's
// ratio, with the range; overlap_over_baseline: against the steps far from any save).
// Free of torch headers. Thread-safety: run from the main thread.
#pragma once

#include <string>

#include "train_bench.h"

namespace fsdp::bench {

struct AsyncSaveBenchOptions {
  TrainBenchOptions train;  // sizes (preset), threads, seed, lr, warmup, steps (baseline steps)
  int rounds = 3;
  std::string save_dir;      // where the checkpoints go; empty: a temporary directory
  bool low_priority = true;  // AsyncSaveOptions::low_priority of the writer thread
};

// Runs under a launcher (fsdp-bench re-executes itself under fsdp-run for --nproc).
int run_async_save_bench(const AsyncSaveBenchOptions& options);

}  // namespace fsdp::bench
