// Learning-rate schedule of fsdp-train: linear warmup, then cosine decay to a floor; a resumed run
// that changes the end (--steps, --min-lr-ratio) continues with a new cosine segment from the rate
// it had reached, so the rate never jumps (docs/trainer.md, "Optimizer and schedule").
// Thread-safety: plain values.
#pragma once

#include <cstdint>

namespace fsdp::train {

struct LrSchedule {
  double peak = 3e-3;      // reached at the end of warmup
  int64_t warmup = 0;      // steps of linear warmup
  int64_t total = 1;       // total steps
  double min_ratio = 0.1;  // floor = peak * min_ratio
  // A segment started by a resume that changed the end: from step restart_step on, the cosine
  // runs from restart_lr to the floor. restart_step < 0: none.
  int64_t restart_step = -1;
  double restart_lr = 0;

  double floor() const { return peak * min_ratio; }
  // Rate used by the optimizer at step s (0-based):
  //   s < warmup:        peak * (s + 1) / warmup
  //   s >= restart_step: floor + (restart_lr - floor) * 0.5 * (1 + cos(pi * q)),
  //                      q = (s - restart_step) / max(1, total - 1 - restart_step), in [0, 1]
  //   otherwise:         floor + (peak - floor) * 0.5 * (1 + cos(pi * p)),
  //                      p = (s - warmup) / max(1, total - 1 - warmup), clamped to [0, 1]
  double at(int64_t step) const;

  // The schedule of a run resumed at `step` with a new total and floor ratio: unchanged when both
  // are unchanged or the step is still in warmup (the warmup does not depend on them); otherwise a
  // new segment starting at this schedule's rate at `step`.
  LrSchedule extended(int64_t step, int64_t new_total, double new_min_ratio) const;
};

}  // namespace fsdp::train
