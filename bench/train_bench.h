// fsdp-bench training modes: step time, exposed communication, bytes and peak memory of GPT
// training under four data-parallel strategies with the same per-rank batch (docs/performance.md).
//
//   local           every rank trains its own copy with no communication at all: the compute floor
//                   (all ranks run at once, so they share the machine as in the other modes)
//   ddp             replicated parameters; PyTorch's DDP reducer (c10d::Reducer,
//   bench/ddp_reducer.h)
//                   all-reduces the mean gradients in 25 MB buckets (1 MB first) from
//                   AccumulateGrad hooks, overlapped with backward, as torch's Python DDP does
//   fsdp            fully_shard on every block and the root, reshard after forward (ZeRO-3)
//   fsdp-noreshard  the same without resharding the blocks after forward (ZeRO-2-like)
//   fsdp-unverified fsdp with verified collectives off: the cost of the check, fsdp's step over
//                   this one (summary: verify_over_unverified)
//   (--mixed-precision bf16: the fsdp modes gather and reduce-scatter in bf16, half the bytes)
//
// Training memory (train_memory_mb, every mode): the peak resident set from just before the model
// is built minus the resident set there, the worst rank; the Python peers (bench/torch_ddp.py)
// report the same. peak_rss_mb is the high-water mark of the training steps alone (absolute).
//
// Every mode uses AdamW, the same initial weights (one seed) and the same synthetic token batches,
// so all four see the same loss at step 1, and ddp and the fsdp modes the same losses throughout
// (up to float summation order). Rank 0 prints one JSON line per mode (keys in TrainResult order);
// summarize_compare() turns the four lines into the closing summary line.
//
// Free of torch headers, so the fsdp-bench dispatcher stays light.
// Thread-safety: run from the main thread.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace fsdp::bench {

struct TrainBenchOptions {
  std::string mode = "fsdp";  // local, ddp, fsdp, fsdp-noreshard, fsdp-unverified
  // "default", "mem" (parameters and optimizer state dominate), "overhead" (48 blocks of width
  // 64, seq 16, batch 1: compute near zero) or "train" (fsdp-train's default job); explicit size
  // options override it
  std::string preset = "default";
  int64_t layers = 8;
  int64_t width = 512;
  int64_t heads = 8;
  int64_t seq = 256;
  int64_t batch = 2;      // sequences per rank and step
  int steps = 5;          // timed steps
  int warmup = 2;         // untimed steps before them
  int threads = 1;        // intra-op threads per rank (at::set_num_threads)
  double bucket_mb = 25;  // ddp bucket size
  double lr = 3e-4;
  uint64_t seed = 1234;
  std::string trace_dir;  // non-empty: write <trace_dir>/rank<k>.json
  // fsdp modes: "bf16" gathers and computes in bfloat16 (fsdp-train's --mixed-precision policy),
  // halving the all-gather and reduce-scatter bytes; "none": fp32.
  std::string mixed_precision = "none";
  // fsdp: K >= 2 keeps 1/K of each block after forward, gathered within K ranks in backward
  // (reshard_after_forward = K, hpZ); 0: off.
  int reshard_after_forward_world = 0;
  std::string forward_prefetch = "auto";  // --mode fsdp: auto, off or unshard (fsdp-train's)
  std::string optimizer = "fused";        // fsdp-train's --optimizer: fused or torch (AdamW)
  // The sharded modes' verified collectives (fsdp-train's --verify-collectives): on, full or off;
  // fsdp-unverified is always off.
  std::string verify_collectives = "on";
  // The sharded modes' quantized collectives (fsdp-train's --quantize-gather/--quantize-reduce).
  std::string quantize_gather = "none", quantize_reduce = "none";
};

// The sizes `preset` stands for; fields the user set explicitly (`explicit_sizes`, option names
// without dashes: "layers", "width", "heads", "seq", "batch") keep their value.
void apply_preset(TrainBenchOptions& options, const std::vector<std::string>& explicit_sizes);

// The modes --compare runs, in order.
const std::vector<std::string>& compare_modes();

// Whether `mode` shards (fsdp, fsdp-noreshard, fsdp-unverified): the modes --mixed-precision and
// the quantized collectives apply to.
bool is_sharded(const std::string& mode);

// Runs one mode on the ranks of the current launch; rank 0 prints its JSON line. Returns the exit
// code.
int run_train_bench(const TrainBenchOptions& options);

// Runs every mode of compare_modes() in this process, one after another (used under an external
// launcher; with --nproc the dispatcher starts fresh ranks per mode instead, so that peak memory
// of one mode does not carry into the next), then prints the summary on rank 0.
int run_train_compare(TrainBenchOptions options);

// From the JSON lines of the four modes: the summary JSON line (fsdp_over_local, fsdp_over_ddp,
// noreshard_over_ddp, fsdp_mem_over_ddp on train_memory_mb, bytes ratios, checks). Writes a
// "WARNING" line to `warnings` for every cross-mode check that fails (step-1 losses differ, final
// losses of ddp and fsdp differ, bytes off the volume model). Throws fsdp::Error when a mode's line
// is missing.
std::string summarize_compare(const std::vector<std::string>& json_lines, std::ostream& warnings);

}  // namespace fsdp::bench
