#include "train/schedule.h"

#include <algorithm>
#include <cmath>

namespace fsdp::train {

double LrSchedule::at(int64_t step) const {
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double span = static_cast<double>(std::max<int64_t>(1, total - 1 - warmup));
  const double p = std::clamp(static_cast<double>(step - warmup) / span, 0.0, 1.0);
  return floor() + (peak - floor()) * 0.5 * (1.0 + std::cos(M_PI * p));
}

}  // namespace fsdp::train
