#include "train/schedule.h"

#include <algorithm>
#include <cmath>

namespace fsdp::train {
namespace {

double cosine(double from, double to, int64_t step, int64_t start, int64_t last) {
  const double span = static_cast<double>(std::max<int64_t>(1, last - start));
  const double p = std::clamp(static_cast<double>(step - start) / span, 0.0, 1.0);
  return to + (from - to) * 0.5 * (1.0 + std::cos(M_PI * p));
}

}  // namespace

double LrSchedule::at(int64_t step) const {
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (restart_step >= 0 && step >= restart_step)
    return cosine(restart_lr, floor(), step, restart_step, total - 1);
  return cosine(peak, floor(), step, warmup, total - 1);
}

LrSchedule LrSchedule::extended(int64_t step, int64_t new_total, double new_min_ratio) const {
  LrSchedule s = *this;
  if (new_total == total && new_min_ratio == min_ratio) return s;
  s.total = new_total;
  s.min_ratio = new_min_ratio;
  if (step < warmup) return s;
  s.restart_step = step;
  s.restart_lr = at(step);
  return s;
}

}  // namespace fsdp::train
