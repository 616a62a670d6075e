// fsdp-bench --moe: a mixture-of-experts GPT (fsdp::models::MoEGPT, one group per expert) whose
// ranks call only the experts their tokens are routed to, against the same with every expert
// reduce-scattered every step (set_reduce_scatter_unused_params: zeros for experts no rank chose)
// and against every expert called on every rank (what FSDP2 requires: a skipped expert runs on an
// empty batch), in interleaved rounds on one model and the same batches. Per variant: step time
// (median [min, max] over rounds), bytes sent and collectives per step (every lane of the world
// communicator, rank 0) and expert calls per rank and step. Rank 0 prints one JSON line per
// variant and a summary line (routed over every expert, routed over reducing unused experts:
// step and bytes). Free of torch headers. Thread-safety: run from the main thread.
#pragma once

#include <cstdint>

namespace fsdp::bench {

struct MoEBenchOptions {
  int64_t experts = 16, top_k = 2, tokens = 2, layers = 2, width = 256;
  int steps = 5, warmup = 1, rounds = 3;
};

// Runs under a launcher (fsdp-bench re-executes itself under fsdp-run for --nproc). Returns the
// exit code.
int run_moe_bench(const MoEBenchOptions& options);

}  // namespace fsdp::bench
