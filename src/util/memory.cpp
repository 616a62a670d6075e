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

std::string malloc_settings() {
  const auto mmap = detail::env_string("MALLOC_MMAP_THRESHOLD_");
  const auto trim = detail::env_string("MALLOC_TRIM_THRESHOLD_");
  if (!mmap && !trim) return "default";
  return "mmap_threshold=" + mmap.value_or("default") +
         " trim_threshold=" + trim.value_or("default");
}

}  // namespace fsdp::memory
