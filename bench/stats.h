// Small statistics shared by fsdp-bench's runs: the median of a sample and rounding for printing.
// Free of torch headers.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace fsdp::bench {

// The median of `v` (the mean of the two middle values for an even count); 0 for no values.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// `x` rounded to a multiple of 1/scale (scale 1e3: three decimals).
inline double round_to(double x, double scale) { return std::round(x * scale) / scale; }

}  // namespace fsdp::bench
