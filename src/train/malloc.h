// The malloc policy of fsdp-train and fsdp-bench (--malloc): an application's choice, which the
// library never makes. Torch-free. Thread-safety: use_steady_malloc changes process-wide settings
// (call it at the start of main, before threads); the rest is stateless.
#pragma once

#include <string>

namespace fsdp::train {

// True when this program was built with AddressSanitizer, whose allocator replaces glibc's and
// ignores its thresholds (mallopt).
bool sanitizer_build();

// --malloc as it applies: "auto" is "steady", or "default" in a sanitizer build; "steady" and
// "default" stay as given.
std::string resolve_malloc_policy(const std::string& policy);

// For the run's first line: "steady", "default", or "steady (auto)" / "default (auto: ...)".
std::string describe_malloc_policy(const std::string& policy);

// glibc malloc with fixed thresholds, for training loops (docs/performance.md, Memory): blocks
// up to 32 MiB come from the heap, and the heap's free top is returned to the kernel only beyond
// 256 MiB. glibc's default thresholds move with the sizes of the blocks a process has freed, so a
// step's activations and gradients may instead be mapped afresh every step and cost a page fault
// per 4 KiB. Applies to this process (mallopt) and, through MALLOC_MMAP_THRESHOLD_ and
// MALLOC_TRIM_THRESHOLD_, to the processes it starts. Throws fsdp::Error where malloc is not
// glibc's (it refuses the thresholds), as under AddressSanitizer.
void use_steady_malloc();

}  // namespace fsdp::train
