// Process memory as the kernel sees it (resident set) and as malloc counts it, for benchmarks and
// the trainer. Readers only: the library never changes malloc's settings (fsdp-train's and
// fsdp-bench's --malloc is theirs, src/train/malloc.h). Thread-safety: stateless reads.
#pragma once

#include <string>

namespace fsdp::memory {

double current_rss_mb();  // VmRSS
double peak_rss_mb();     // VmHWM: the high-water mark since start or the last reset
// Resets the high-water mark to the current RSS (Linux clear_refs); false when not permitted.
bool reset_peak_rss();
// Returns freed heap memory to the kernel (glibc malloc_trim), so RSS reflects live memory.
void trim();
// Bytes malloc has handed out and not had back (glibc mallinfo2: arenas and mmapped blocks), in
// MB: live tensors, unlike RSS, which also holds freed pages until trimmed.
double heap_in_use_mb();

// "default", or the thresholds this process's malloc was given through the environment
// (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_): "mmap_threshold=... trim_threshold=...".
std::string malloc_settings();

}  // namespace fsdp::memory
