// fsdp-bench --comm: bus bandwidth of the communicator's all-gather, reduce-scatter and all-reduce.
//
// Runs on the ranks of the current launch (torchrun/fsdp-run variables; one rank when none are
// set). Rank 0 prints one JSON object per line and size:
//   {"op": "all_gather", "bytes": 1048576, "world": 2, "busbw_gbps_median": ..,
//    "busbw_gbps_min": .., "busbw_gbps_max": .., ...}
// `bytes` and bus bandwidth follow nccl-tests: bytes is the whole buffer (all-gather output,
// reduce-scatter input, all-reduce buffer); busbw = bytes / time * (N-1)/N for all-gather and
// reduce-scatter, * 2(N-1)/N for all-reduce; time per iteration is the slowest rank's.
// Every (op, size) is checked once against a locally computed result before it is timed.
//
// Free of torch headers, so the fsdp-bench dispatcher stays light.
// Thread-safety: run from the main thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::bench {

struct CommBenchOptions {
  int64_t min_bytes = 64 << 10;  // smallest buffer
  int64_t max_bytes = 64 << 20;  // largest buffer; sizes go up by `step` from min_bytes
  int step = 4;
  int warmup = 2;  // untimed iterations per (op, size), after the correctness check
  int iters = 0;   // timed iterations; 0: from 50 at 64 KiB down to 20 from 16 MiB
  std::vector<std::string> ops = {"all_gather", "reduce_scatter", "all_reduce"};
};

// Runs the benchmark on this process's rank; returns the process exit code.
int run_comm_bench(const CommBenchOptions& options);

}  // namespace fsdp::bench
