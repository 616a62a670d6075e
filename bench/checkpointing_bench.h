// fsdp-bench --activation-checkpointing: the activation memory that ShardOptions::
// activation_checkpointing saves, side by side in one run. The GPT of the training modes
// (--layers, --width, --seq, --batch...) is sharded as in mode fsdp, once without and once with
// checkpointed blocks, on the same ranks, weights and batches. Per variant: the heap memory still
// held when forward returns (the activations kept for backward, plus the gathered root), the
// step's peak RSS above the RSS before it, and the median step time; then the difference and
// whether the losses are bitwise equal. Rank 0 prints one JSON line per variant and a summary.
// Free of torch headers. Thread-safety: run from the main thread.
#pragma once

#include "train_bench.h"

namespace fsdp::bench {

// Runs under a launcher (fsdp-bench re-executes itself under fsdp-run for --nproc). Returns the
// exit code; a loss mismatch between the variants is a WARNING line on stderr and exit code 1.
int run_checkpointing_bench(const TrainBenchOptions& options);

}  // namespace fsdp::bench
