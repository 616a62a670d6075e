#include "launcher_watch.h"

#include <fsdp/error.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <thread>

namespace fsdp::detail {
namespace {

constexpr auto kPoll = std::chrono::milliseconds(100);
constexpr auto kGrace = std::chrono::seconds(30);

std::string command_of(pid_t pid) {
  std::ifstream in(cat("/proc/", pid, "/comm"));
  std::string name;
  std::getline(in, name);
  return name;
}

// Runs for the life of the process (a detached thread: the watch is about the process, not about
// one communicator); touches nothing but its own copies and async-safe calls.
void watch(pid_t parent, std::string message) {
  while (::getppid() == parent) std::this_thread::sleep_for(kPoll);
  std::fputs(message.c_str(), stderr);
  std::fflush(stderr);
  ::kill(::getpid(), SIGTERM);
  std::this_thread::sleep_for(kGrace);
  const std::string last = cat("fsdp: pid ", ::getpid(), " did not stop within ", kGrace.count(),
                               " s of its launcher's exit; exiting now\n");
  std::fputs(last.c_str(), stderr);
  std::fflush(stderr);
  ::_exit(128 + SIGTERM);
}

}  // namespace

std::string launcher_gone_message(int rank, int64_t pid, const std::string& launcher) {
  return cat("fsdp: rank ", rank, " (pid ", pid, "): the launcher that started it, ", launcher,
             ", has exited (killed?); no launcher is left to restart or stop the ranks, so this "
             "rank stops now (as on SIGTERM) instead of training on as an orphan\n");
}

void watch_launcher(const RendezvousInfo& info) {
  if (!info.elastic_agent) return;
  static std::once_flag once;
  std::call_once(once, [&] {
    const pid_t parent = ::getppid();
    if (parent <= 1) return;  // already an orphan: there is nothing to watch
    const std::string launcher =
        cat("torchrun's elastic agent (pid ", parent, ", ", command_of(parent), ")");
    std::thread(watch, parent, launcher_gone_message(info.rank, ::getpid(), launcher)).detach();
  });
}

}  // namespace fsdp::detail
