// Process memory as the kernel sees it (resident set), for benchmarks and the trainer, and the
// trainer's malloc settings. Thread-safety: the readers are stateless reads of /proc/self;
// use_steady_malloc changes process-wide settings (call it at the start of main, before threads).
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

// glibc malloc with fixed thresholds, for training loops (docs/performance.md, fifth pass): blocks
// up to 32 MiB come from the heap, and the heap's free top is returned to the kernel only beyond
// 256 MiB. glibc's default thresholds move with the sizes of the blocks a process has freed, so a
// step's activations and gradients may instead be mapped afresh every step and cost a page fault
// per 4 KiB. Applies to this process (mallopt) and, through MALLOC_MMAP_THRESHOLD_ and
// MALLOC_TRIM_THRESHOLD_, to the processes it starts. An application's choice: the library never
// calls it. Throws fsdp::Error where malloc is not glibc's (it refuses the thresholds).
void use_steady_malloc();
// "default", or the thresholds this process's malloc was given through the environment (which
// use_steady_malloc also sets): "mmap_threshold=... trim_threshold=...".
std::string malloc_settings();

}  // namespace fsdp::memory
