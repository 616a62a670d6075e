// fsdp-bench's multi-run benchmarks, driven from the dispatcher: each run is a fresh set of ranks
// (a Launch) that prints one JSON line per mode; these functions choose the runs, interleave them
// and reduce their lines (docs/performance.md).
//
//   compare_rounds   --compare: every mode (and PyTorch's DDP and FSDP2, bench/torch_ddp.py) in
//                    each of R rounds, the order rotated per round; the median ratio over rounds
//                    with its [min, max]
//   memory_scaling   --memory-scaling: peak RSS per rank of fsdp and ddp at N = 1, 2, 4 beside
//                    the model states' 16P/N
//   max_model        --max-model: the deepest GPT of the given width whose peak RSS per rank fits
//                    a budget, for ddp and for fsdp
//
// Free of torch headers. Thread-safety: run from the main thread.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

namespace fsdp::bench {

// Runs ARGS on `nproc` fresh ranks; appends rank 0's JSON lines to `lines`; returns the exit code.
using Launch =
    std::function<int(int nproc, const std::vector<std::string>& args, std::vector<std::string>&)>;
// The command-line arguments of one run of `mode` ("local", "ddp", "fsdp", "fsdp-noreshard", or
// "torch-ddp", "fsdp2" and "torch-local" for the Python peers) with `layers` blocks (0: the
// configured depth) and `trace`.
using ArgsFor = std::function<std::vector<std::string>(const std::string& mode, int64_t layers)>;

// The 1-, 5- and 15-minute load averages (/proc/loadavg), reported beside every figure.
std::vector<double> load_average();

struct CompareSpec {
  int nproc = 2;
  int rounds = 3;
  bool torch_ddp = true;  // also run PyTorch's DDP (when `torch_launch` is set)
  bool fsdp2 = true;      // also run PyTorch's FSDP2 (when `torch_launch` is set)
  // also run PyTorch's model without a wrapper (torch-local: the Python floor; --preset overhead)
  bool torch_local = false;
};

// --compare over rounds: prints every run's line as it comes, then the summary JSON line. A
// failed fsdp-bench run fails the comparison; a failed Python peer is reported and left out.
// `torch_launch` runs the Python peers (bench/torch_ddp.py), null: none.
int compare_rounds(const CompareSpec& spec, const ArgsFor& args_for, const Launch& launch,
                   const Launch& torch_launch, std::ostream& out, std::ostream& err);

// The summary of `rounds` (each: the JSON lines of one round); exposed for the tests.
std::string summarize_rounds(const std::vector<std::vector<std::string>>& rounds,
                             std::ostream& warnings);

// --memory-scaling: fsdp and ddp at each world size in `worlds`; prints their lines, a Markdown
// table and a summary JSON line.
int memory_scaling(const std::vector<int>& worlds, const ArgsFor& args_for, const Launch& launch,
                   std::ostream& out, std::ostream& err);

// --max-model: for ddp and fsdp on `nproc` ranks, the most layers whose process peak RSS per rank
// stays within `memory_mb`; prints every probe's line and a summary JSON line.
int max_model(int nproc, double memory_mb, const ArgsFor& args_for, const Launch& launch,
              std::ostream& out, std::ostream& err);

}  // namespace fsdp::bench
