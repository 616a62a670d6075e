// fsdp-bench --optimizer-step: the optimizer step alone on the shards of the training benchmark's
// GPT (--preset and the size options; fully_shard over the launched ranks, the trainer's two
// parameter groups), fsdp::optim's fused AdamW and SGD against LibTorch's torch::optim ones, in
// interleaved rounds on every rank at once (as in training, the ranks share the cores). Three
// contenders per optimizer, each stepping its own copy of the same shards with the same gradients:
//   fused           fsdp::optim on the shards themselves (one flat storage per group: one pass
//                   per group and parameter group)
//   fused-separate  fsdp::optim on copies that are tensors of their own (a pass per parameter)
//   torch           torch::optim on such copies (LibTorch's operations, one parameter at a time)
// The benchmark checks its own result: after every round the three copies hold the same bits
// (parameters and state). Rank 0 prints one JSON line per optimizer: milliseconds per step
// (median over steps of the slowest rank; the median of the rounds, with their [min, max]), torch
// over fused (per round, then the median and range), bitwise equality.
#pragma once

#include "train_bench.h"

namespace fsdp::bench {

// Runs under a launcher (fsdp-bench re-executes itself under fsdp-run for --nproc); uses the
// sizes, threads, steps, warmup and seed of `options` and `rounds` rounds. Returns the exit code.
int run_optimizer_bench(const TrainBenchOptions& options, int rounds);

}  // namespace fsdp::bench
