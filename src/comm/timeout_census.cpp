#include "timeout_census.h"

#include <fsdp/error.h>

#include <algorithm>
#include <fstream>
#include <future>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace fsdp::detail {
namespace {

std::string census_key(const std::string& key, int rank) {
  return cat("fsdp/census/", key, "/", rank);
}

// The blocking part: report, then poll for the others until all reported or `grace` passed.
std::vector<int> report_and_wait(c10d::Store& store, const std::string& key, int rank, int size,
                                 std::chrono::milliseconds grace) {
  store.set(census_key(key, rank), std::vector<uint8_t>{1});
  const auto deadline = std::chrono::steady_clock::now() + grace;
  std::vector<int> absent;
  for (;;) {
    absent.clear();
    for (int r = 0; r < size; ++r)
      if (r != rank && !store.check({census_key(key, r)})) absent.push_back(r);
    if (absent.empty() || std::chrono::steady_clock::now() >= deadline) return absent;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace

std::chrono::milliseconds census_grace(std::chrono::milliseconds timeout) {
  return std::clamp(timeout / 4, std::chrono::milliseconds(1000), std::chrono::milliseconds(5000));
}

Census census_of(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int rank,
                 int size, std::chrono::milliseconds grace) {
  Census out;
  if (!store || size <= 1) return out;
  // On a thread of its own, abandoned when the store does not answer: a stopped store server
  // accepts the request and never replies, and no store call takes a deadline of its own.
  auto task = std::make_shared<std::packaged_task<std::vector<int>()>>(
      [store, key, rank, size, grace] { return report_and_wait(*store, key, rank, size, grace); });
  auto result = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (result.wait_for(grace + std::chrono::milliseconds(1000)) != std::future_status::ready)
    return out;
  try {
    out.absent = result.get();
    out.complete = true;
  } catch (const std::exception&) {
    // The store failed (its server exited): nothing is known.
  }
  return out;
}

std::string process_state(int64_t pid) {
  if (pid <= 0) return {};
  std::ifstream stat(cat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return {};
  const auto close = line.rfind(')');  // the state follows the command name in parentheses
  if (close == std::string::npos || close + 2 >= line.size()) return {};
  switch (line[close + 2]) {
    case 'T':
      return "its process is stopped (SIGSTOP, SIGTSTP or Ctrl-Z: state T; SIGCONT resumes it)";
    case 't':
      return "its process is stopped by a debugger (state t)";
    case 'D':
      return "its process is in uninterruptible sleep (state D: waiting for a disk or a network "
             "file system)";
    default:
      return {};
  }
}

}  // namespace fsdp::detail
