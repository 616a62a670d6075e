#include "train/launch.h"

#include <fsdp/error.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>

#include "train/progress.h"
#include "util/env.h"

namespace fsdp::train {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) {
  if (g_stop_signal != 0) {
    // Second signal: the user insists.
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_stop_signal = sig;
}

bool path_exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

}  // namespace

std::string self_exe_path() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  FSDP_CHECK(n > 0, "cannot read /proc/self/exe (", std::strerror(errno), ")");
  return std::string(buf, static_cast<size_t>(n));
}

void exec_local_ranks(int nproc, const std::vector<std::string>& args) {
  const std::string self = self_exe_path();
  const std::string launcher = self.substr(0, self.find_last_of('/')) + "/fsdp-run";
  FSDP_CHECK(::access(launcher.c_str(), X_OK) == 0, "the local launcher '", launcher,
             "' is missing or not executable; build it (ninja fsdp-run) or run one process per "
             "rank under torchrun/mpirun/srun, or use --nproc 1");
  std::vector<std::string> argv{launcher, "-n", std::to_string(nproc), "--", self};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  if (::isatty(1)) ::setenv(kTtyEnv, "1", 1);
  std::fflush(stdout);
  std::fflush(stderr);
  ::execv(launcher.c_str(), cargv.data());
  throw Error(detail::cat("cannot execute the local launcher '", launcher, "' (",
                          std::strerror(errno), ")"));
}

std::string default_run_dir() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "runs/%Y%m%d-%H%M%S", &tm);
  std::string dir = buf;
  for (int k = 2; path_exists(dir); ++k) dir = std::string(buf) + "-" + std::to_string(k);
  return dir;
}

int local_ranks(int world_size) {
  // Hints from the launcher; anything but a count of ranks is ignored.
  for (const char* name :
       {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"})
    if (auto local = detail::env_int_hint(name, 1, (1 << 20) - 1)) return static_cast<int>(*local);
  return world_size;
}

int threads_per_rank(int requested, int world_size) {
  if (requested > 0) return requested;
  const int local = local_ranks(world_size);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, local));
}

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
}

bool stop_requested() { return g_stop_signal != 0; }
int stop_signal() { return static_cast<int>(g_stop_signal); }

}  // namespace fsdp::train
