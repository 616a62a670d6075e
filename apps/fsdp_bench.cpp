// fsdp-bench: benchmark dispatcher. Each mode is one flag or option here plus one run_* function in
// bench/<mode>_bench.{h,cpp}; this file only parses arguments, (re)launches ranks and dispatches.
//
//   fsdp-bench --comm [--nproc N]     collective bus bandwidth (bench/comm_bench.h)
//   fsdp-bench --mode M [--nproc N]   GPT training step time of one mode (bench/train_bench.h)
//   fsdp-bench --compare [--nproc N]  all four training modes and a summary line
//
// With --nproc N (and not already a launched rank), fsdp-bench re-executes itself under fsdp-run
// from its own directory with N ranks and passes rank 0's stdout through without the "[rank 0] "
// prefix, so stdout holds exactly what rank 0 printed (e.g. JSON lines). Other ranks' stdout and
// every rank's stderr go to stderr. Under a launcher (fsdp-run, torchrun, mpirun, srun) run it
// without --nproc. --compare --nproc N starts fresh ranks for each mode, so that one mode's peak
// memory and allocator state do not carry into the next; under a launcher it runs the modes one
// after another in the same ranks.
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

#include "comm_bench.h"
#include "train_bench.h"

namespace {

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

// Runs `fsdp-run -n N -- <this program> ARGS` and filters its stdout; rank 0's lines also go to
// `on_line` when given. Returns fsdp-run's exit status. Must run before any tensor work (no fork
// after OpenMP starts).
int relaunch(int nproc, const std::vector<std::string>& program_args,
             const std::function<void(const std::string&)>& on_line = nullptr) {
  const std::string dir = self_dir();
  const std::string runner = dir + "/fsdp-run";
  FSDP_CHECK(::access(runner.c_str(), X_OK) == 0, "--nproc needs fsdp-run next to fsdp-bench, but ",
             runner, " is missing; build the fsdp-run target, or launch the ranks yourself: ",
             "fsdp-run -n ", nproc, " ", dir, "/fsdp-bench ARGS (without --nproc)");
  std::vector<std::string> args{runner, "-n", std::to_string(nproc), "--", dir + "/fsdp-bench"};
  args.insert(args.end(), program_args.begin(), program_args.end());
  int fds[2];
  FSDP_CHECK(::pipe(fds) == 0, "pipe() failed while starting fsdp-run");
  std::fflush(nullptr);
  pid_t pid = ::fork();
  FSDP_CHECK(pid >= 0, "fork() failed while starting fsdp-run");
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    ::close(fds[1]);
    ::setenv(kChildMarker, "1", 1);
    std::vector<char*> cargv;
    for (auto& a : args) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    ::execv(cargv[0], cargv.data());
    std::perror("fsdp-bench: exec fsdp-run");
    ::_exit(127);
  }
  ::close(fds[1]);
  FILE* in = ::fdopen(fds[0], "r");
  const std::string prefix = "[rank 0] ";
  char* line = nullptr;
  size_t cap = 0;
  for (ssize_t n; (n = ::getline(&line, &cap, in)) > 0;) {
    std::string l(line, static_cast<size_t>(n));
    if (l.rfind(prefix, 0) == 0) {
      std::cout << l.substr(prefix.size()) << std::flush;
      if (on_line) on_line(l.substr(prefix.size()));
    } else {
      std::cerr << l << std::flush;
    }
  }
  std::free(line);
  std::fclose(in);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void add_comm_options(CLI::App& app, fsdp::bench::CommBenchOptions& o) {
  auto* g = app.add_option_group("comm", "Options of --comm");
  g->add_option("--min-bytes", o.min_bytes, "smallest buffer in bytes")->capture_default_str();
  g->add_option("--max-bytes", o.max_bytes, "largest buffer in bytes")->capture_default_str();
  g->add_option("--step", o.step, "size multiplier between runs")->capture_default_str();
  // Shared with the training modes (CLI11 allows one --warmup): untimed steps there.
  g->add_option("--warmup", o.warmup, "untimed iterations per size (training: untimed steps)")
      ->capture_default_str();
  g->add_option("--iters", o.iters, "timed iterations per size (0: by size, 50 down to 6)")
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
  bool compare = false;
  std::vector<std::pair<std::string, CLI::Option*>> sizes;

  void add(CLI::App& app) {
    auto& o = options;
    auto* g = app.add_option_group("train", "Options of --mode and --compare (GPT training)");
    g->add_option("--mode", mode, "train one mode: local, ddp, fsdp, fsdp-noreshard")
        ->check(CLI::IsMember(fsdp::bench::compare_modes()));
    g->add_flag("--compare", compare, "run all four modes and print a summary line");
    g->add_option("--preset", o.preset, "default, or mem (parameters and optimizer state dominate)")
        ->check(CLI::IsMember({"default", "mem"}))
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
    g->add_option("--seed", o.seed, "weights and data seed")->capture_default_str();
    g->add_option("--trace", o.trace_dir,
                  "write a Chrome trace per rank to DIR/rank<k>.json (--compare: DIR/<mode>/)");
  }

  // After parsing: the preset's sizes, except those given on the command line.
  void resolve() {
    std::vector<std::string> given;
    for (auto& [name, opt] : sizes)
      if (opt->count() > 0) given.push_back(name);
    fsdp::bench::apply_preset(options, given);
    if (!mode.empty()) options.mode = mode;
  }

  // The arguments that run `mode` with these options in fresh ranks.
  std::vector<std::string> args_for(const std::string& m, const std::string& trace_dir) const {
    const auto& o = options;
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
    if (!trace_dir.empty()) a.insert(a.end(), {"--trace", trace_dir});
    return a;
  }
};

// --compare --nproc N: each mode in fresh ranks, then the summary from their lines.
int compare_relaunched(int nproc, const TrainCli& cli) {
  std::vector<std::string> lines;
  for (const auto& m : fsdp::bench::compare_modes()) {
    const std::string trace = cli.options.trace_dir.empty() ? "" : cli.options.trace_dir + "/" + m;
    const int rc =
        relaunch(nproc, cli.args_for(m, trace), [&](const std::string& l) { lines.push_back(l); });
    if (rc != 0) {
      std::cerr << "fsdp-bench: --compare: mode " << m << " failed with exit status " << rc << "\n";
      return rc;
    }
  }
  std::cout << fsdp::bench::summarize_compare(lines, std::cerr) << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp-bench: fsdp-cpp benchmarks.\n"
      "  --comm      bus bandwidth of all_gather, reduce_scatter and all_reduce (fp32, 64 KiB..64 "
      "MiB),\n"
      "              one JSON object per line and size on stdout (nccl-tests conventions).\n"
      "  --mode M    GPT training with AdamW: local, ddp, fsdp or fsdp-noreshard; one JSON line.\n"
      "  --compare   all four modes, one JSON line each, then a summary line with the ratios.\n"
      "Examples:\n"
      "  fsdp-bench --comm --nproc 4\n"
      "  fsdp-bench --compare --nproc 2\n"
      "  fsdp-bench --mode fsdp --nproc 2 --trace /tmp/trace   (open rank0.json in Perfetto)\n"
      "  fsdp-run -n 4 -- fsdp-bench --comm"};
  bool comm = false;
  int nproc = 0;
  app.add_flag("--comm", comm, "run the communication benchmark");
  app.add_option("--nproc", nproc,
                 "start this many local ranks through fsdp-run (omit under a launcher)")
      ->check(CLI::Range(1, 64));
  fsdp::bench::CommBenchOptions comm_options;
  add_comm_options(app, comm_options);
  TrainCli train;
  train.add(app);
  CLI11_PARSE(app, argc, argv);

  try {
    const bool training = train.compare || !train.mode.empty();
    if (comm + training != 1 || (train.compare && !train.mode.empty())) {
      std::cerr << "fsdp-bench: choose exactly one of --comm, --mode M, --compare (see --help)\n";
      return 2;
    }
    train.options.warmup = comm_options.warmup;  // one --warmup option serves both
    train.resolve();
    const bool launch = nproc > 0 && !std::getenv(kChildMarker);
    if (launch && train.compare) return compare_relaunched(nproc, train);
    if (launch) return relaunch(nproc, args_without_nproc(argc, argv));
    if (comm) return fsdp::bench::run_comm_bench(comm_options);
    if (train.compare) return fsdp::bench::run_train_compare(train.options);
    return fsdp::bench::run_train_bench(train.options);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
