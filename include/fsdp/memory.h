// Process memory as the kernel sees it (resident set), for benchmarks and the trainer.
// Thread-safety: stateless reads of /proc/self.
#pragma once

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

}  // namespace fsdp::memory
