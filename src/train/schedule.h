// Learning-rate schedule of fsdp-train: linear warmup, then cosine decay to a floor.
// Thread-safety: plain values.
#pragma once

#include <cstdint>

namespace fsdp::train {

struct LrSchedule {
  double peak = 3e-3;      // reached at the end of warmup
  int64_t warmup = 0;      // steps of linear warmup
  int64_t total = 1;       // total steps; the last step (total - 1) uses exactly `floor()`
  double min_ratio = 0.1;  // floor = peak * min_ratio

  double floor() const { return peak * min_ratio; }
  // Rate used by the optimizer at step s (0-based):
  //   s < warmup:  peak * (s + 1) / warmup
  //   otherwise:   floor + (peak - floor) * 0.5 * (1 + cos(pi * p)),
  //                p = (s - warmup) / max(1, total - 1 - warmup), clamped to [0, 1]
  double at(int64_t step) const;
};

}  // namespace fsdp::train
