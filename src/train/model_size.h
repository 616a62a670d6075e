// What the settings of fsdp-train cost before anything is allocated: the parameter count, the
// model FLOPs per token (for MFU) and an estimate of the memory of one rank, checked against the
// machine's MemAvailable so that a run that cannot fit is refused up front with the setting to
// change (docs/trainer.md, "Bounds"). Torch-free. Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "train/config.h"

namespace fsdp::train {

// 12 L C^2 + 13 L C + (V + T) C + 2 C (docs/trainer.md, "Model"), as a double (no overflow).
double parameter_count(const TrainConfig& cfg);

// Training FLOPs per token: 6 N + 12 L C T, with N the parameters without the position embedding
// (PaLM's appendix B, nanoGPT's estimate_mfu): 2 per multiply-add, forward + 2x backward.
double flops_per_token(const TrainConfig& cfg);

struct MemoryEstimate {
  double state_bytes = 0;       // sharded parameters, gradients, AdamW moments
  double gathered_bytes = 0;    // unsharded groups alive at once (root + two blocks, + grads)
  double activation_bytes = 0;  // saved for backward by one micro-batch, plus the logits
  double runtime_bytes = 0;     // LibTorch, Gloo and the process itself
  double total() const { return state_bytes + gathered_bytes + activation_bytes + runtime_bytes; }
};

// One rank of `world_size` (unsharded when world_size is 1 or cfg.no_shard).
MemoryEstimate estimate_memory(const TrainConfig& cfg, int world_size);

// MemAvailable of /proc/meminfo in bytes; 0 when unreadable.
double mem_available_bytes();

// Throws fsdp::Error when local_ranks ranks of this estimate exceed `available` bytes, naming the
// largest term's settings and the fix. available = 0: no check.
void check_memory_bounds(const TrainConfig& cfg, int world_size, int local_ranks, double available);

std::string format_bytes(double bytes);  // "1.5 GiB", "320 MiB"

}  // namespace fsdp::train
