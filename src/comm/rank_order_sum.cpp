#include "rank_order_sum.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>
#include <cstring>

namespace fsdp::detail {
namespace {

// Elements summed per pass through the accumulator (8 KiB of fp32: well inside L1).
constexpr int64_t kSpan = 2048;

// One span of `len` elements: out = ((rows[0] + rows[1]) + rows[2]) + ..., each row read once and
// the output written once. The first two rows and the last one go straight between the rows and
// the output; rows in between add into a span-sized accumulator that stays in L1. Elementwise
// loops: the output may be one of the rows exactly (ivdep: no dependence across elements). Always
// inlined, so that full spans (len == kSpan, a constant) get a loop count the compiler knows and
// vectorises at -O2.
template <class T, class Acc>
__attribute__((always_inline)) inline void sum_span(T* out, const T* const* rows, int count,
                                                    int64_t off, int64_t len, bool average,
                                                    Acc* acc) {
  const Acc divisor = static_cast<Acc>(count);
  T* o = out + off;
  const T* first = rows[0] + off;
  if (count == 1) {
    if (average) {
#pragma GCC ivdep
      for (int64_t i = 0; i < len; ++i) o[i] = static_cast<T>(static_cast<Acc>(first[i]) / divisor);
    } else if (o != first) {
      std::memcpy(o, first, len * sizeof(T));
    }
    return;
  }
  const T* second = rows[1] + off;
  if (count == 2 && average) {
#pragma GCC ivdep
    for (int64_t i = 0; i < len; ++i)
      o[i] = static_cast<T>((static_cast<Acc>(first[i]) + static_cast<Acc>(second[i])) / divisor);
    return;
  }
  if (count == 2) {
#pragma GCC ivdep
    for (int64_t i = 0; i < len; ++i)
      o[i] = static_cast<T>(static_cast<Acc>(first[i]) + static_cast<Acc>(second[i]));
    return;
  }
  for (int64_t i = 0; i < len; ++i)
    acc[i] = static_cast<Acc>(first[i]) + static_cast<Acc>(second[i]);
  for (int j = 2; j + 1 < count; ++j) {
    const T* row = rows[j] + off;
    for (int64_t i = 0; i < len; ++i) acc[i] += static_cast<Acc>(row[i]);
  }
  const T* last = rows[count - 1] + off;
  if (average) {
#pragma GCC ivdep
    for (int64_t i = 0; i < len; ++i)
      o[i] = static_cast<T>((acc[i] + static_cast<Acc>(last[i])) / divisor);
    return;
  }
#pragma GCC ivdep
  for (int64_t i = 0; i < len; ++i) o[i] = static_cast<T>(acc[i] + static_cast<Acc>(last[i]));
}

template <class T, class Acc>
void sum_rows(const at::Tensor& output, const std::vector<at::Tensor>& rows, bool average) {
  std::vector<const T*> src;
  src.reserve(rows.size());
  for (const auto& r : rows) src.push_back(r.data_ptr<T>());
  T* out = output.data_ptr<T>();
  const int count = static_cast<int>(src.size());
  const int64_t n = output.numel();
  Acc acc[kSpan];
  int64_t off = 0;
  for (; off + kSpan <= n; off += kSpan)
    sum_span<T, Acc>(out, src.data(), count, off, kSpan, average, acc);
  if (off < n) sum_span<T, Acc>(out, src.data(), count, off, n - off, average, acc);
}

}  // namespace

void sum_in_rank_order(const at::Tensor& output, const std::vector<at::Tensor>& rows,
                       bool average) {
  FSDP_CHECK(!rows.empty(), "sum_in_rank_order: no rows to sum");
  FSDP_CHECK(output.is_cpu() && output.is_contiguous(),
             "sum_in_rank_order: the output must be a contiguous CPU tensor");
  for (const auto& r : rows)
    FSDP_CHECK(
        r.is_cpu() && r.is_contiguous() && r.numel() == output.numel() &&
            r.scalar_type() == output.scalar_type(),
        "sum_in_rank_order: every row must be a contiguous CPU tensor of the output's dtype ",
        output.scalar_type(), " and length ", output.numel(), " (got ", r.scalar_type(), ", ",
        r.numel(), ")");
  switch (output.scalar_type()) {
    case at::kFloat:
      return sum_rows<float, float>(output, rows, average);
    case at::kDouble:
      return sum_rows<double, double>(output, rows, average);
    case at::kHalf:
      return sum_rows<at::Half, float>(output, rows, average);
    case at::kBFloat16:
      return sum_rows<at::BFloat16, float>(output, rows, average);
    default:
      break;
  }
  // Integers sum in int64 (as at::sum does) and wrap to the dtype once at the end.
  FSDP_CHECK(!average, "sum_in_rank_order: an average of ", output.scalar_type(),
             " tensors would be truncated; reduce with a sum and divide, or use a floating dtype");
  switch (output.scalar_type()) {
    case at::kLong:
      return sum_rows<int64_t, int64_t>(output, rows, false);
    case at::kInt:
      return sum_rows<int32_t, int64_t>(output, rows, false);
    case at::kChar:
      return sum_rows<int8_t, int64_t>(output, rows, false);
    case at::kByte:
      return sum_rows<uint8_t, int64_t>(output, rows, false);
    default:
      FSDP_CHECK(false, "sum_in_rank_order: dtype ", output.scalar_type(),
                 " is not summed here (fp32, fp64, fp16, bf16, 8/32/64-bit ints)");
  }
}

}  // namespace fsdp::detail
