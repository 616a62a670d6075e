#include <fsdp/error.h>
#include <fsdp/trace.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

namespace fsdp::trace {
namespace {

struct Event {
  std::string name, category, track;
  int64_t start_us, duration_us;
};

// The timeline is process-wide by nature (one file per rank), like torch.profiler's.
struct Recorder {
  std::atomic<bool> on{false};
  std::mutex mu;
  std::vector<Event> events;
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

}  // namespace

void enable(bool on) { recorder().on.store(on, std::memory_order_relaxed); }
bool enabled() { return recorder().on.load(std::memory_order_relaxed); }

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void complete(const std::string& name, const std::string& category, int64_t start_us,
              int64_t duration_us, const std::string& track) {
  if (!enabled()) return;
  auto& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.push_back({name, category, track, start_us, std::max<int64_t>(duration_us, 0)});
}

Span::Span(std::string name, std::string category, std::string track)
    : name_(std::move(name)), category_(std::move(category)), track_(std::move(track)) {
  if (enabled()) start_ = now_us();
}

Span::~Span() {
  if (start_ >= 0) complete(name_, category_, start_, now_us() - start_, track_);
}

size_t write_chrome_json(const std::string& path, int rank) {
  auto& r = recorder();
  std::vector<Event> events;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    events = r.events;
  }
  std::map<std::string, int> tids;
  nlohmann::json list = nlohmann::json::array();
  int64_t t0 = events.empty() ? 0 : events.front().start_us;
  for (const auto& e : events) t0 = std::min(t0, e.start_us);
  for (const auto& e : events) {
    auto [it, inserted] = tids.emplace(e.track, static_cast<int>(tids.size()));
    list.push_back({{"ph", "X"},
                    {"name", e.name},
                    {"cat", e.category},
                    {"ts", e.start_us - t0},
                    {"dur", e.duration_us},
                    {"pid", rank},
                    {"tid", it->second}});
  }
  for (const auto& [track, tid] : tids)
    list.push_back({{"ph", "M"},
                    {"name", "thread_name"},
                    {"pid", rank},
                    {"tid", tid},
                    {"args", {{"name", track}}}});
  list.push_back({{"ph", "M"},
                  {"name", "process_name"},
                  {"pid", rank},
                  {"tid", 0},
                  {"args", {{"name", "rank " + std::to_string(rank)}}}});
  std::ofstream f(path);
  FSDP_CHECK(f.good(), "trace: cannot write '", path, "'; check that the directory exists");
  f << nlohmann::json{{"traceEvents", list}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  FSDP_CHECK(f.good(), "trace: writing '", path, "' failed (disk full?)");
  return events.size();
}

void clear() {
  auto& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.clear();
}

}  // namespace fsdp::trace
