// fsdp-bench: benchmark dispatcher. Each mode is one flag or option here plus one run_* function in
// bench/<mode>_bench.{h,cpp}; this file only parses arguments, (re)launches ranks and dispatches.
//
//   fsdp-bench --comm [--nproc N]     collective bus bandwidth (bench/comm_bench.h)
//
// With --nproc N (and not already a launched rank), fsdp-bench re-executes itself under fsdp-run
// from its own directory with N ranks and passes rank 0's stdout through without the "[rank 0] "
// prefix, so stdout holds exactly what rank 0 printed (e.g. JSON lines). Other ranks' stdout and
// every rank's stderr go to stderr. Under a launcher (fsdp-run, torchrun, mpirun, srun) run it
// without --nproc.
#include <fcntl.h>
#include <fsdp/error.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "comm_bench.h"

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

// Runs `fsdp-run -n N -- <this program> ARGS` (ARGS without --nproc) and filters its stdout.
// Returns fsdp-run's exit status. Must run before any tensor work (no fork after OpenMP starts).
int relaunch(int nproc, int argc, char** argv) {
  const std::string dir = self_dir();
  const std::string runner = dir + "/fsdp-run";
  FSDP_CHECK(::access(runner.c_str(), X_OK) == 0, "--nproc needs fsdp-run next to fsdp-bench, but ",
             runner, " is missing; build the fsdp-run target, or launch the ranks yourself: ",
             "fsdp-run -n ", nproc, " ", dir, "/fsdp-bench ARGS (without --nproc)");
  std::vector<std::string> args{runner, "-n", std::to_string(nproc), "--", dir + "/fsdp-bench"};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--nproc") {
      ++i;  // skip its value
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0) continue;
    args.push_back(a);
  }
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
  g->add_option("--warmup", o.warmup, "untimed iterations per size")->capture_default_str();
  g->add_option("--iters", o.iters, "timed iterations per size (0: by size, 50 down to 6)")
      ->capture_default_str();
  g->add_option("--ops", o.ops, "collectives to run: all_gather reduce_scatter all_reduce")
      ->delimiter(',')
      ->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp-bench: fsdp-cpp benchmarks.\n"
      "  --comm   bus bandwidth of all_gather, reduce_scatter and all_reduce (fp32, 64 KiB..64 "
      "MiB),\n"
      "           one JSON object per line and size on stdout (nccl-tests conventions).\n"
      "Examples:\n"
      "  fsdp-bench --comm --nproc 4\n"
      "  fsdp-run -n 4 -- fsdp-bench --comm"};
  bool comm = false;
  int nproc = 0;
  app.add_flag("--comm", comm, "run the communication benchmark");
  app.add_option("--nproc", nproc,
                 "start this many local ranks through fsdp-run (omit under a launcher)")
      ->check(CLI::Range(1, 64));
  fsdp::bench::CommBenchOptions comm_options;
  add_comm_options(app, comm_options);
  // Training modes (--mode ..., --compare) register their options here and dispatch below.
  CLI11_PARSE(app, argc, argv);

  try {
    if (!comm) {
      std::cerr << "fsdp-bench: nothing to run; choose a mode, e.g. --comm (see --help)\n";
      return 2;
    }
    if (nproc > 0 && !std::getenv(kChildMarker)) return relaunch(nproc, argc, argv);
    if (comm) return fsdp::bench::run_comm_bench(comm_options);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
