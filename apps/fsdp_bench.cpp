// fsdp-bench: benchmark dispatcher. Each mode is one flag or option here plus one run_* function in
// bench/<mode>_bench.{h,cpp} (bench/sweeps.h for the multi-run ones); this file only parses
// arguments, (re)launches ranks and dispatches.
//
//   fsdp-bench --comm [--nproc N]            collective bus bandwidth (bench/comm_bench.h)
//   fsdp-bench --mode M [--nproc N]          GPT training step time of one mode
//   (bench/train_bench.h) fsdp-bench --compare [--nproc N]         every mode and PyTorch's DDP and
//   FSDP2 (torch 2.15, bench/torch_ddp.py) over --rounds
//                                            rounds, then the median ratios (bench/sweeps.h)
//   fsdp-bench --memory-scaling              peak RSS of fsdp and ddp at N = 1, 2, 4 (--preset mem)
//   fsdp-bench --max-model --nproc N --memory-mb M   deepest GPT that fits, ddp vs fsdp
//   fsdp-bench --optimizer-step [--nproc N]  the optimizer step alone on the GPT's shards: fused
//                                            fsdp::optim against torch::optim
//                                            (bench/optimizer_bench.h)
//   fsdp-bench --async-save [--preset mem] --nproc N   asynchronous against synchronous checkpoints
//                                            (bench/async_save_bench.h)
//
// With --nproc N (and not already a launched rank), fsdp-bench re-executes itself under fsdp-run
// from its own directory with N ranks and passes rank 0's stdout through without the "[rank 0] "
// prefix, so stdout holds exactly what rank 0 printed (e.g. JSON lines). Other ranks' stdout and
// every rank's stderr go to stderr. Under a launcher (fsdp-run, torchrun, mpirun, srun) run it
// without --nproc. --compare --nproc N starts fresh ranks for each mode and round, so that one
// mode's peak memory and allocator state do not carry into the next; under a launcher it runs the
// modes one after another in the same ranks, once, without the Python peers.
#include <fcntl.h>
#include <fsdp/error.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "async_save_bench.h"
#include "checkpointing_bench.h"
#include "comm_bench.h"
#include "moe_bench.h"
#include "optimizer_bench.h"
#include "sweeps.h"
#include "train/malloc.h"
#include "train_bench.h"
#include "verify_bench.h"

namespace {

// The Python of the Python peers: that of the venv scripts/torch_pip.sh makes (torch 2.15), at
// $TORCH_PIP_VENV where set (the Makefile's variable), else at the Makefile's default.
std::string default_peer_python() {
  if (const char* venv = std::getenv("TORCH_PIP_VENV"); venv && *venv)
    return std::string(venv) + "/bin/python3";
  return "/opt/fsdp-cpp/torch215/bin/python3";
}

// Set in the environment of ranks started by relaunch(): they must not relaunch again.
constexpr const char* kChildMarker = "FSDP_BENCH_CHILD";

std::string self_dir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  FSDP_CHECK(n > 0, "cannot resolve /proc/self/exe to find fsdp-run next to fsdp-bench");
  std::string path(buf, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/'));
}

// This program's arguments without --nproc and its value.
std::vector<std::string> args_without_nproc(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--nproc") {
      ++i;  // skip its value
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0) continue;
    out.push_back(a);
  }
  return out;
}

// Runs ARGS[0] with ARGS, calling `on_line` for every line of its stdout; stderr is inherited.
// Returns its exit status. Must run before any tensor work (no fork after OpenMP starts).
int run_piped(const std::vector<std::string>& args,
              const std::function<void(const std::string&)>& on_line) {
  int fds[2];
  FSDP_CHECK(::pipe(fds) == 0, "pipe() failed while starting ", args[0]);
  std::fflush(nullptr);
  pid_t pid = ::fork();
  FSDP_CHECK(pid >= 0, "fork() failed while starting ", args[0]);
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    ::close(fds[1]);
    ::setenv(kChildMarker, "1", 1);
    std::vector<char*> cargv;
    for (auto& a : args) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    ::execv(cargv[0], cargv.data());
    std::perror(("fsdp-bench: exec " + args[0]).c_str());
    ::_exit(127);
  }
  ::close(fds[1]);
  FILE* in = ::fdopen(fds[0], "r");
  char* line = nullptr;
  size_t cap = 0;
  for (ssize_t n; (n = ::getline(&line, &cap, in)) > 0;) {
    std::string l(line, static_cast<size_t>(n));
    if (!l.empty() && l.back() == '\n') l.pop_back();
    on_line(l);
  }
  std::free(line);
  std::fclose(in);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Runs `fsdp-run -n N -- <this program> ARGS` and filters its stdout: rank 0's lines go to
// `on_line` when given, else to stdout; every other line to stderr. Returns fsdp-run's status.
int relaunch(int nproc, const std::vector<std::string>& program_args,
             const std::function<void(const std::string&)>& on_line = nullptr) {
  const std::string dir = self_dir();
  const std::string runner = dir + "/fsdp-run";
  FSDP_CHECK(::access(runner.c_str(), X_OK) == 0, "--nproc needs fsdp-run next to fsdp-bench, but ",
             runner, " is missing; build the fsdp-run target, or launch the ranks yourself: ",
             "fsdp-run -n ", nproc, " ", dir, "/fsdp-bench ARGS (without --nproc)");
  std::vector<std::string> args{runner, "-n", std::to_string(nproc), "--", dir + "/fsdp-bench"};
  args.insert(args.end(), program_args.begin(), program_args.end());
  const std::string prefix = "[rank 0] ";
  return run_piped(args, [&](const std::string& l) {
    if (l.rfind(prefix, 0) != 0) {
      std::cerr << l << std::endl;
    } else if (on_line) {
      on_line(l.substr(prefix.size()));
    } else {
      std::cout << l.substr(prefix.size()) << std::endl;
    }
  });
}

void add_comm_options(CLI::App& app, fsdp::bench::CommBenchOptions& o) {
  auto* g = app.add_option_group("comm", "Options of --comm");
  g->add_option("--min-bytes", o.min_bytes, "smallest buffer in bytes")->capture_default_str();
  g->add_option("--max-bytes", o.max_bytes, "largest buffer in bytes")->capture_default_str();
  g->add_option("--step", o.step, "size multiplier between runs")->capture_default_str();
  // Shared with the training modes (CLI11 allows one --warmup): untimed steps there.
  g->add_option("--warmup", o.warmup, "untimed iterations per size (training: untimed steps)")
      ->capture_default_str();
  g->add_option("--iters", o.iters, "timed iterations per size (0: by size, 50 down to 20)")
      ->capture_default_str();
  g->add_option("--ops", o.ops, "collectives to run: all_gather reduce_scatter all_reduce")
      ->delimiter(',')
      ->capture_default_str();
}

// Options of --mode and --compare. The size options are remembered so that --preset does not
// override what the user set.
struct TrainCli {
  fsdp::bench::TrainBenchOptions options;
  std::string mode;
  bool compare = false, memory_scaling = false, max_model = false, no_torch_ddp = false,
       no_fsdp2 = false;
  int rounds = 3;
  double memory_mb = 0;
  std::vector<int> worlds = {1, 2, 4};
  std::string python = default_peer_python(), torch_ddp_script = FSDP_BENCH_DIR "/torch_ddp.py";
  CLI::Option* preset_option = nullptr;
  std::vector<std::pair<std::string, CLI::Option*>> sizes;

  void add(CLI::App& app) {
    auto& o = options;
    auto* g = app.add_option_group("train", "Options of --mode and --compare (GPT training)");
    g->add_option("--mode", mode,
                  "train one mode: local, ddp, fsdp, fsdp-noreshard, fsdp-unverified")
        ->check(CLI::IsMember(fsdp::bench::compare_modes()));
    g->add_flag("--compare", compare,
                "run all five modes and PyTorch's DDP and FSDP2 (Python, torch 2.15), over "
                "--rounds rounds, then a summary");
    g->add_option("--rounds", rounds, "--compare: rounds, the mode order rotated in each")
        ->check(CLI::Range(1, 100))
        ->capture_default_str();
    g->add_flag("--no-torch-ddp", no_torch_ddp, "--compare: leave out PyTorch's DDP");
    g->add_flag("--no-fsdp2", no_fsdp2, "--compare: leave out PyTorch's FSDP2");
    g->add_option("--python", python,
                  "--compare: python3 with torch 2.15 for the peers, bench/torch_ddp.py "
                  "(default: $TORCH_PIP_VENV/bin/python3 when set, else scripts/torch_pip.sh's "
                  "venv)")
        ->capture_default_str();
    g->add_option("--torch-ddp-script", torch_ddp_script,
                  "--compare: the Python peers (PyTorch's DDP and FSDP2)")
        ->capture_default_str();
    g->add_flag("--memory-scaling", memory_scaling,
                "peak RSS of fsdp and ddp at each of --worlds (default --preset mem)");
    g->add_option("--worlds", worlds, "--memory-scaling: world sizes")
        ->delimiter(',')
        ->check(CLI::Range(1, 64))
        ->capture_default_str();
    g->add_flag("--max-model", max_model,
                "deepest GPT of --width whose peak RSS per rank fits --memory-mb, ddp and fsdp "
                "(default --preset mem)");
    g->add_option("--memory-mb", memory_mb, "--max-model: per-rank budget in MB");
    preset_option = g->add_option("--preset", o.preset,
                                  "default, mem (parameters and optimizer state dominate), "
                                  "overhead (48 x 64, seq 16, batch 1: compute near zero; "
                                  "--compare then also reports microseconds per group and step "
                                  "above the floor, and runs PyTorch's model without wrapper) or "
                                  "train (fsdp-train's default job: 4 layers, width 128, seq 64, "
                                  "8 rows per rank)")
                        ->check(CLI::IsMember({"default", "mem", "overhead", "train"}))
                        ->capture_default_str();
    for (auto [name, field, help] : {std::tuple{"layers", &o.layers, "transformer blocks"},
                                     std::tuple{"width", &o.width, "embedding width"},
                                     std::tuple{"heads", &o.heads, "attention heads"},
                                     std::tuple{"seq", &o.seq, "sequence length"},
                                     std::tuple{"batch", &o.batch, "sequences per rank and step"}})
      sizes.emplace_back(
          name, g->add_option(std::string("--") + name, *field, help)->capture_default_str());
    g->add_option("--steps", o.steps, "timed steps")->capture_default_str();
    g->add_option("--threads", o.threads, "intra-op threads per rank")->capture_default_str();
    g->add_option("--bucket-mb", o.bucket_mb, "ddp gradient bucket size in MiB")
        ->capture_default_str();
    g->add_option("--lr", o.lr, "AdamW learning rate")->capture_default_str();
    g->add_option("--optimizer", o.optimizer,
                  "the C++ modes' AdamW: fused (fsdp::optim::AdamW, fsdp-train's default) or "
                  "torch (torch::optim::AdamW); the Python peers use torch.optim.AdamW")
        ->check(CLI::IsMember({"fused", "torch"}))
        ->capture_default_str();
    g->add_option("--seed", o.seed, "weights and data seed")->capture_default_str();
    g->add_option("--mixed-precision", o.mixed_precision,
                  "--mode fsdp/fsdp-noreshard: bf16 gathers, computes and reduce-scatters in "
                  "bfloat16 (half the bytes per step); none: fp32. --compare: for fsdp, "
                  "fsdp-noreshard and PyTorch's FSDP2 (MixedPrecisionPolicy(param_dtype=bf16, "
                  "reduce_dtype=bf16)); local, ddp and PyTorch's DDP stay fp32")
        ->check(CLI::IsMember({"none", "bf16"}))
        ->capture_default_str();
    g->add_option("--forward-prefetch", o.forward_prefetch,
                  "--mode fsdp/fsdp-noreshard: auto (the implicit prefetch of the next block), "
                  "off, or unshard (FSDPModule::unshard(true) of block i + 1 before block i)")
        ->check(CLI::IsMember({"auto", "off", "unshard"}))
        ->capture_default_str();
    g->add_option("--reshard-after-forward-world", o.reshard_after_forward_world,
                  "--mode fsdp: K >= 2 keeps 1/K of each block's parameters after forward and "
                  "gathers them within K consecutive ranks in backward (reshard_after_forward=K, "
                  "hpZ); 0: off")
        ->capture_default_str();
    g->add_option("--verify-collectives", o.verify_collectives,
                  "the fsdp modes' verified collectives: on (a rotating 1/8 of each collective "
                  "per step), full (every byte) or off; fsdp-unverified is off, so --compare's "
                  "verify_over_unverified is the check's cost")
        ->check(CLI::IsMember({"on", "full", "off"}))
        ->capture_default_str();
    g->add_option("--quantize-gather", o.quantize_gather,
                  "the fsdp modes all-gather the weights on a quantized wire: none, bf16 or int8 "
                  "(fsdp/quantized.h)")
        ->check(CLI::IsMember({"none", "bf16", "int8"}))
        ->capture_default_str();
    g->add_option("--quantize-reduce", o.quantize_reduce,
                  "the fsdp modes reduce-scatter the gradients on a quantized wire summed in "
                  "fp32: none, bf16 or int8")
        ->check(CLI::IsMember({"none", "bf16", "int8"}))
        ->capture_default_str();
    g->add_option("--trace", o.trace_dir,
                  "write a Chrome trace per rank to DIR/rank<k>.json (--compare: DIR/<mode>/)");
  }

  // After parsing: the preset's sizes, except those given on the command line.
  void resolve() {
    if ((memory_scaling || max_model) && preset_option->count() == 0) options.preset = "mem";
    std::vector<std::string> given;
    for (auto& [name, opt] : sizes)
      if (opt->count() > 0) given.push_back(name);
    fsdp::bench::apply_preset(options, given);
    if (!mode.empty()) options.mode = mode;
  }

  // The arguments that run `mode` with these options (and `layers` blocks when > 0) in fresh
  // ranks; for "torch-ddp" and "fsdp2", those of bench/torch_ddp.py. --mixed-precision applies to
  // the sharded modes only.
  std::vector<std::string> args_for(const std::string& m, const std::string& trace_dir,
                                    int64_t layers = 0) const {
    auto o = options;
    if (layers > 0) o.layers = layers;
    auto num = [](auto v) {
      std::ostringstream s;
      s << v;
      return s.str();
    };
    std::vector<std::string> a = {"--mode",      m,
                                  "--preset",    o.preset,
                                  "--layers",    num(o.layers),
                                  "--width",     num(o.width),
                                  "--heads",     num(o.heads),
                                  "--seq",       num(o.seq),
                                  "--batch",     num(o.batch),
                                  "--steps",     num(o.steps),
                                  "--warmup",    num(o.warmup),
                                  "--threads",   num(o.threads),
                                  "--bucket-mb", num(o.bucket_mb),
                                  "--lr",        num(o.lr),
                                  "--seed",      num(o.seed)};
    if (m != "torch-ddp" && m != "fsdp2" && m != "torch-local")
      a.insert(a.end(), {"--optimizer", o.optimizer});
    const bool sharded = fsdp::bench::is_sharded(m) || m == "fsdp2";
    if (sharded && o.mixed_precision != "none")
      a.insert(a.end(), {"--mixed-precision", o.mixed_precision});
    if ((m == "fsdp" || m == "fsdp-unverified") && o.reshard_after_forward_world > 0)
      a.insert(a.end(), {"--reshard-after-forward-world", num(o.reshard_after_forward_world)});
    if (fsdp::bench::is_sharded(m))
      a.insert(a.end(), {"--verify-collectives", o.verify_collectives, "--quantize-gather",
                         o.quantize_gather, "--quantize-reduce", o.quantize_reduce});
    if (m == "torch-ddp" || m == "fsdp2" || m == "torch-local") {
      // bench/torch_ddp.py --mode; sizes are explicit
      a[1] = m == "fsdp2" ? "fsdp2" : m == "torch-local" ? "local" : "ddp";
      return a;
    }
    if (!trace_dir.empty()) a.insert(a.end(), {"--trace", trace_dir});
    return a;
  }
};

// The sweeps' runs: fsdp-bench in fresh ranks, and the Python DDP peer.
fsdp::bench::Launch bench_launch() {
  return [](int nproc, const std::vector<std::string>& args, std::vector<std::string>& lines) {
    return relaunch(nproc, args, [&](const std::string& l) { lines.push_back(l); });
  };
}

fsdp::bench::Launch torch_launch(const TrainCli& cli) {
  if (cli.no_torch_ddp && cli.no_fsdp2) return nullptr;
  if (::access(cli.python.c_str(), X_OK) != 0 ||
      ::access(cli.torch_ddp_script.c_str(), R_OK) != 0) {
    std::cerr << "fsdp-bench: --compare: no Python peers (" << cli.python << " or "
              << cli.torch_ddp_script
              << " is missing; scripts/torch_pip.sh makes the venv of torch 2.15, or pass "
                 "--python); fsdp_over_torch_ddp and fsdp_over_fsdp2 are left out\n";
    return nullptr;
  }
  return [&cli](int nproc, const std::vector<std::string>& args, std::vector<std::string>& lines) {
    std::vector<std::string> argv{cli.python, cli.torch_ddp_script, "--nproc",
                                  std::to_string(nproc)};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_piped(argv, [&](const std::string& l) {
      if (!l.empty() && l[0] == '{') lines.push_back(l);
    });
  };
}

fsdp::bench::ArgsFor args_for(const TrainCli& cli) {
  return [&cli](const std::string& m, int64_t layers) {
    const std::string trace = cli.options.trace_dir.empty() ? "" : cli.options.trace_dir + "/" + m;
    return cli.args_for(m, trace, layers);
  };
}

// What the parsed command line asks for: one benchmark, here or through fsdp-run.
struct Request {
  bool comm = false, checkpointing = false, moe = false, optimizer_step = false, async_save = false,
       verify_detection = false;
  std::string save_dir, writer_priority = "low";
  fsdp::bench::VerifyDetectionOptions verify_options;
  fsdp::bench::MoEBenchOptions moe_options;
  int nproc = 0;
  std::string malloc_policy = "default";
  fsdp::bench::CommBenchOptions comm_options;
  TrainCli train;
};

int run_request(Request& q, int argc, char** argv) {
  TrainCli& train = q.train;
  const bool comm = q.comm, checkpointing = q.checkpointing;
  const int nproc = q.nproc;
  const std::string& malloc_policy = q.malloc_policy;
  fsdp::bench::CommBenchOptions& comm_options = q.comm_options;
  // --malloc steady: the same fixed thresholds in every rank and in the Python peer (the
  // environment reaches the processes started from here), so that modes are compared on their
  // code rather than on glibc's allocation history (docs/performance.md, Memory).
  if (malloc_policy == "steady") fsdp::train::use_steady_malloc();
  const bool sweep = train.compare || train.memory_scaling || train.max_model;
  if (comm + checkpointing + q.moe + q.optimizer_step + q.async_save + q.verify_detection +
          !train.mode.empty() + train.compare + train.memory_scaling + train.max_model !=
      1) {
    std::cerr << "fsdp-bench: choose exactly one of --comm, --activation-checkpointing, --moe, "
                 "--optimizer-step, --async-save, --verify-detection, --mode M, --compare, "
                 "--memory-scaling, --max-model (see --help)\n";
    return 2;
  }
  if (train.options.mixed_precision != "none" && train.mode.empty() && !train.compare) {
    std::cerr << "fsdp-bench: --mixed-precision " << train.options.mixed_precision
              << " applies to the fsdp training modes: add --mode fsdp, --mode fsdp-noreshard or "
                 "--compare\n";
    return 2;
  }
  train.options.warmup = comm_options.warmup;  // one --warmup option serves both
  // --async-save times fsdp-train's default job unless a preset is given.
  if (q.async_save && train.preset_option->count() == 0) train.options.preset = "train";
  train.resolve();
  const bool child = std::getenv(kChildMarker) != nullptr;
  if (sweep && !child && (nproc > 0 || !train.compare)) {
    if (train.compare)
      return fsdp::bench::compare_rounds({nproc, train.rounds, !train.no_torch_ddp, !train.no_fsdp2,
                                          !train.no_fsdp2 && train.options.preset == "overhead"},
                                         args_for(train), bench_launch(), torch_launch(train),
                                         std::cout, std::cerr);
    if (train.memory_scaling)
      return fsdp::bench::memory_scaling(train.worlds, args_for(train), bench_launch(), std::cout,
                                         std::cerr);
    FSDP_CHECK(nproc > 0, "--max-model needs --nproc N (the world size to fit)");
    return fsdp::bench::max_model(nproc, train.memory_mb, args_for(train), bench_launch(),
                                  std::cout, std::cerr);
  }
  FSDP_CHECK(!train.memory_scaling && !train.max_model,
             "--memory-scaling and --max-model start their own ranks: run them without a "
             "launcher");
  if (nproc > 0 && !child) return relaunch(nproc, args_without_nproc(argc, argv));
  if (comm) return fsdp::bench::run_comm_bench(comm_options);
  if (checkpointing) return fsdp::bench::run_checkpointing_bench(train.options);
  if (q.optimizer_step) return fsdp::bench::run_optimizer_bench(train.options, train.rounds);
  if (q.async_save) {
    fsdp::bench::AsyncSaveBenchOptions a;
    a.train = train.options;
    a.rounds = train.rounds;
    a.save_dir = q.save_dir;
    a.low_priority = q.writer_priority == "low";
    return fsdp::bench::run_async_save_bench(a);
  }
  if (q.moe) {
    q.moe_options.steps = train.options.steps;
    q.moe_options.warmup = train.options.warmup;
    q.moe_options.rounds = train.rounds;
    return fsdp::bench::run_moe_bench(q.moe_options);
  }
  if (q.verify_detection) return fsdp::bench::run_verify_detection(q.verify_options);
  if (train.compare) return fsdp::bench::run_train_compare(train.options);
  return fsdp::bench::run_train_bench(train.options);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp-bench: fsdp-cpp benchmarks.\n"
      "  --comm      bus bandwidth of all_gather, reduce_scatter and all_reduce (fp32, 64 KiB..64 "
      "MiB),\n"
      "              one JSON object per line and size on stdout (nccl-tests conventions).\n"
      "  --mode M    GPT training with AdamW: local, ddp, fsdp, fsdp-noreshard or fsdp-unverified\n"
      "              (fsdp with verified collectives off); one JSON line.\n"
      "  --compare   all five modes and PyTorch's DDP and FSDP2 (torch 2.15), one JSON line each,\n"
      "              over --rounds rounds; then a summary line with the median ratios and their\n"
      "              ranges (--mixed-precision bf16: fsdp, fsdp-noreshard and FSDP2 in bf16).\n"
      "  --memory-scaling   fsdp and ddp peak RSS at N=1,2,4 beside 16P/N (--preset mem).\n"
      "  --max-model --nproc N --memory-mb M   deepest GPT that fits M MB per rank, ddp vs fsdp.\n"
      "  --activation-checkpointing   fsdp GPT training without and with checkpointed blocks:\n"
      "              activation memory held after forward, peak RSS, step time, loss equality.\n"
      "  --moe       a mixture-of-experts GPT, one group per expert: ranks calling only their\n"
      "              routed experts against every expert on every rank (--rounds rounds).\n"
      "  --optimizer-step   the optimizer step alone on the GPT's shards: fsdp::optim's fused\n"
      "              AdamW and SGD against torch::optim's (--rounds rounds, the size options).\n"
      "  --async-save   asynchronous against synchronous checkpoints of fsdp-train's job (or\n"
      "              --preset mem): the time a save holds the step, the overlapped steps' "
      "slowdown.\n"
      "  --verify-detection   verified collectives against --injections random bit flips per\n"
      "              case (all-gather, reduce-scatter; shm, tcp; fp32, bf16): caught / missed.\n"
      "Examples:\n"
      "  fsdp-bench --comm --nproc 4\n"
      "  fsdp-bench --compare --nproc 2\n"
      "  fsdp-bench --mode fsdp --nproc 2 --trace /tmp/trace   (open rank0.json in Perfetto)\n"
      "  fsdp-run -n 4 -- fsdp-bench --comm"};
  Request q;
  app.add_flag("--comm", q.comm, "run the communication benchmark");
  app.add_flag("--optimizer-step", q.optimizer_step,
               "time the optimizer step alone on the GPT's shards: fused against LibTorch's");
  app.add_flag("--activation-checkpointing", q.checkpointing,
               "activation memory saved by checkpointing the blocks (the training size options)");
  app.add_option("--malloc", q.malloc_policy,
                 "glibc malloc in every rank and peer: default, or steady (fixed mmap and trim "
                 "thresholds: MALLOC_MMAP_THRESHOLD_=32 MiB, MALLOC_TRIM_THRESHOLD_=256 MiB)")
      ->check(CLI::IsMember({"default", "steady"}))
      ->capture_default_str();
  app.add_option("--nproc", q.nproc,
                 "start this many local ranks through fsdp-run (omit under a launcher)")
      ->check(CLI::Range(1, 64));
  auto* async = app.add_option_group("async-save", "Options of --async-save");
  async->add_flag("--async-save", q.async_save,
                  "asynchronous checkpoints (checkpoint::AsyncSaver) against synchronous saves in "
                  "one run: blocking time, slowdown of the overlapped steps (--preset train: "
                  "fsdp-train's default job, the default here; mem; --rounds, --steps baseline "
                  "steps per round)");
  async->add_option("--save-dir", q.save_dir,
                    "--async-save: where the checkpoints go (default: a temporary directory, "
                    "removed after)");
  async
      ->add_option("--writer-priority", q.writer_priority,
                   "--async-save: low (the library's default: nice 19 for the writer thread) or "
                   "normal")
      ->check(CLI::IsMember({"low", "normal"}))
      ->capture_default_str();
  auto* moe = app.add_option_group("moe", "Options of --moe");
  moe->add_flag("--moe", q.moe, "the mixture-of-experts benchmark");
  moe->add_option("--experts", q.moe_options.experts, "--moe: experts per layer")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  moe->add_option("--top-k", q.moe_options.top_k, "--moe: experts each token is routed to")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  moe->add_option("--tokens", q.moe_options.tokens, "--moe: tokens per rank and step")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  moe->add_option("--moe-layers", q.moe_options.layers,
                  "--moe: layers (a block and an expert layer each)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  moe->add_option("--moe-width", q.moe_options.width, "--moe: model width")
      ->check(CLI::Range(2, 1 << 16))
      ->capture_default_str();
  auto* verify = app.add_option_group("verify", "Options of --verify-detection");
  verify->add_flag("--verify-detection", q.verify_detection,
                   "verified collectives against injected bit flips: caught and missed per case "
                   "(docs/verified_collectives.md)");
  verify
      ->add_option("--injections", q.verify_options.injections,
                   "--verify-detection: injections per case")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  add_comm_options(app, q.comm_options);
  q.train.add(app);
  CLI11_PARSE(app, argc, argv);

  try {
    return run_request(q, argc, argv);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
