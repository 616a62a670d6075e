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

// A report's value: how the reporting rank's wait ended.
constexpr uint8_t kReportTimedOut = 1;
constexpr uint8_t kReportFailed = 2;

// The blocking part: report, then poll for the others until all reported or `grace` passed,
// reading how the waits of those that reported ended (present keys: get() does not block).
Census report_and_wait(c10d::Store& store, const std::string& key, int rank, int size,
                       std::chrono::milliseconds grace, bool timed_out) {
  store.set(census_key(key, rank),
            std::vector<uint8_t>{timed_out ? kReportTimedOut : kReportFailed});
  const auto begin = std::chrono::steady_clock::now();
  const auto deadline = begin + grace;
  // A rank whose connection closed asks whether a peer timed out (such a peer reports within
  // moments of closing it); a peer that died never reports, so waiting out the grace for it would
  // only delay the error.
  const auto no_timeout_by = begin + std::min(grace, std::chrono::milliseconds(1000));
  Census out;
  out.complete = true;
  for (;;) {
    out.absent.clear();
    out.timed_out.clear();
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      if (!store.check({census_key(key, r)})) {
        out.absent.push_back(r);
        continue;
      }
      const std::vector<uint8_t> v = store.get(census_key(key, r));
      if (v.size() == 1 && v[0] == kReportTimedOut) out.timed_out.push_back(r);
    }
    const auto now = std::chrono::steady_clock::now();
    if (out.absent.empty() || now >= deadline) return out;
    if (!timed_out && out.timed_out.empty() && now >= no_timeout_by) return out;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace

std::chrono::milliseconds census_grace(std::chrono::milliseconds timeout) {
  return std::clamp(timeout / 4, std::chrono::milliseconds(1000), std::chrono::milliseconds(5000));
}

Census census_of(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int rank,
                 int size, std::chrono::milliseconds grace, bool timed_out) {
  if (!store || size <= 1) return {};
  // On a thread of its own, abandoned when the store does not answer: a stopped store server
  // accepts the request and never replies, and no store call takes a deadline of its own.
  auto task =
      std::make_shared<std::packaged_task<Census()>>([store, key, rank, size, grace, timed_out] {
        return report_and_wait(*store, key, rank, size, grace, timed_out);
      });
  auto result = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (result.wait_for(grace + std::chrono::milliseconds(1000)) != std::future_status::ready)
    return {};
  try {
    return result.get();
  } catch (const std::exception&) {
    return {};  // the store failed (its server exited): nothing is known
  }
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
