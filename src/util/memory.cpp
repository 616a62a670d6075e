#include <fsdp/error.h>
#include <fsdp/memory.h>
#include <malloc.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "util/env.h"

namespace fsdp::memory {
namespace {
double status_mb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string k = key;
  while (std::getline(f, line))
    if (line.rfind(k, 0) == 0) return std::stod(line.substr(k.size())) / 1024.0;  // kB -> MB
  return 0;
}
}  // namespace

double current_rss_mb() { return status_mb("VmRSS:"); }
double peak_rss_mb() { return status_mb("VmHWM:"); }

bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  return f.good();
}

void trim() { ::malloc_trim(0); }

double heap_in_use_mb() {
  const struct mallinfo2 m = ::mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd) / (1024.0 * 1024.0);
}

void use_steady_malloc() {
  bool applied = false;
#ifdef __GLIBC__
  constexpr int kMmapThreshold = 32 << 20;  // glibc's largest dynamic threshold
  constexpr int kTrimThreshold = 256 << 20;
  applied = ::mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 &&
            ::mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
  if (applied) {
    ::setenv("MALLOC_MMAP_THRESHOLD_", std::to_string(kMmapThreshold).c_str(), 1);
    ::setenv("MALLOC_TRIM_THRESHOLD_", std::to_string(kTrimThreshold).c_str(), 1);
  }
#endif
  FSDP_CHECK(applied,
             "fixed malloc thresholds (--malloc steady) need glibc's malloc, which this "
             "process does not use; run with --malloc default");
}

std::string malloc_settings() {
  const auto mmap = detail::env_string("MALLOC_MMAP_THRESHOLD_");
  const auto trim = detail::env_string("MALLOC_TRIM_THRESHOLD_");
  if (!mmap && !trim) return "default";
  return "mmap_threshold=" + mmap.value_or("default") +
         " trim_threshold=" + trim.value_or("default");
}

}  // namespace fsdp::memory
