// fsdp-bench --verify-detection: verified collectives (docs/verified_collectives.md) against
// injected faults. For each case (a flipped bit in the bytes one rank sent in an all-gather, as
// they arrive; in a block one rank sends in a reduce-scatter, after it was sketched; in a reduced
// value; over shared memory and TCP; fp32 and bf16 wires; an int8 quantized gather's wire) it
// trains a small GPT for one step `injections` times with one bit flipped at random (rank,
// collective of the step, element, bit: src/core/content_faults.h), the full check on, and counts
// the flips caught in their step (every rank throwing the same error) and missed, by bit class.
// Rank 0 prints one JSON line per case and a markdown table. Free of torch headers.
// Thread-safety: run from the main thread, in every rank (under fsdp-run).
#pragma once

#include <cstdint>

namespace fsdp::bench {

struct VerifyDetectionOptions {
  int injections = 100;  // per case
  uint64_t seed = 1;
};

int run_verify_detection(const VerifyDetectionOptions& options);

}  // namespace fsdp::bench
