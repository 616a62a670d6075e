#include "train/malloc.h"

#include <fsdp/error.h>
#include <malloc.h>

#include <cstdlib>
#include <string>

// GCC defines __SANITIZE_ADDRESS__ under -fsanitize=address; clang has __has_feature.
#if defined(__SANITIZE_ADDRESS__)
#define FSDP_TRAIN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FSDP_TRAIN_ASAN 1
#endif
#endif

namespace fsdp::train {

bool sanitizer_build() {
#ifdef FSDP_TRAIN_ASAN
  return true;
#else
  return false;
#endif
}

std::string resolve_malloc_policy(const std::string& policy) {
  if (policy != "auto") return policy;
  return sanitizer_build() ? "default" : "steady";
}

std::string describe_malloc_policy(const std::string& policy) {
  const std::string chosen = resolve_malloc_policy(policy);
  if (policy != "auto") return chosen;
  return sanitizer_build() ? chosen + " (auto: AddressSanitizer's allocator, no glibc thresholds)"
                           : chosen + " (auto)";
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

}  // namespace fsdp::train
