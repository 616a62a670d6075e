#include "rank_order_sum.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>
#include <array>
#include <utility>

namespace fsdp::detail {
namespace {

// Elements summed per pass (8 KiB of fp32: well inside L1); a constant for full spans, so that the
// compiler knows their loop count and vectorises them at -O2.
constexpr int64_t kSpan = 2048;
// Up to this many rows are summed in one pass straight from the rows to the output; more go
// through an accumulator.
constexpr int kDirectRows = 8;

// One span of `len` elements from `off`, C rows: out = ((rows[0] + rows[1]) + ...) [/ C] in one
// pass, every row read once and the output written once (a left fold over a parameter pack: the
// rank order, with no loop over rows in the way of vectorising). ivdep: the output may be one of
// the rows exactly, and elements do not depend on each other.
template <class T, class Acc, bool kAverage, size_t... I>
__attribute__((always_inline)) inline void sum_direct(T* out, const T* const* rows, int64_t off,
                                                      int64_t len, std::index_sequence<I...>) {
  constexpr Acc divisor = static_cast<Acc>(sizeof...(I));
  const T* r[] = {(rows[I] + off)...};
  T* o = out + off;
#pragma GCC ivdep
  for (int64_t i = 0; i < len; ++i) {
    const Acc s = (... + static_cast<Acc>(r[I][i]));
    o[i] = static_cast<T>(kAverage ? s / divisor : s);
  }
}

// More rows than kDirectRows: the first two into an accumulator that stays in L1, the rows in
// between added to it, the last one added on the way to the output.
template <class T, class Acc, bool kAverage>
__attribute__((always_inline)) inline void sum_through(T* out, const T* const* rows, int count,
                                                       int64_t off, int64_t len, Acc* acc) {
  const Acc divisor = static_cast<Acc>(count);
  for (int64_t i = 0; i < len; ++i)
    acc[i] = static_cast<Acc>(rows[0][off + i]) + static_cast<Acc>(rows[1][off + i]);
  for (int j = 2; j + 1 < count; ++j) {
    const T* row = rows[j] + off;
    for (int64_t i = 0; i < len; ++i) acc[i] += static_cast<Acc>(row[i]);
  }
  const T* last = rows[count - 1] + off;
  T* o = out + off;
#pragma GCC ivdep
  for (int64_t i = 0; i < len; ++i) {
    const Acc s = acc[i] + static_cast<Acc>(last[i]);
    o[i] = static_cast<T>(kAverage ? s / divisor : s);
  }
}

// Every span of the output, full spans with their constant length.
template <class T, class Acc, bool kAverage, int C>
void sum_spans(T* out, const T* const* rows, int count, int64_t n) {
  Acc acc[C == 0 ? kSpan : 1];
  auto span = [&](int64_t off, int64_t len) {
    if constexpr (C == 0) {
      sum_through<T, Acc, kAverage>(out, rows, count, off, len, acc);
    } else {
      sum_direct<T, Acc, kAverage>(out, rows, off, len, std::make_index_sequence<C>());
    }
  };
  int64_t off = 0;
  for (; off + kSpan <= n; off += kSpan) span(off, kSpan);
  if (off < n) span(off, n - off);
}

// sum_spans for 1..kDirectRows rows, indexed by the count less one.
template <class T, class Acc, bool kAverage, size_t... C>
constexpr auto direct_sums(std::index_sequence<C...>) {
  return std::array{&sum_spans<T, Acc, kAverage, static_cast<int>(C) + 1>...};
}

template <class T, class Acc, bool kAverage>
void sum_by_count(T* out, const T* const* rows, int count, int64_t n) {
  static constexpr auto direct =
      direct_sums<T, Acc, kAverage>(std::make_index_sequence<kDirectRows>());
  if (count <= kDirectRows) return direct[count - 1](out, rows, count, n);
  sum_spans<T, Acc, kAverage, 0>(out, rows, count, n);
}

template <class T, class Acc>
void sum_rows(const at::Tensor& output, const std::vector<at::Tensor>& rows, bool average) {
  std::vector<const T*> src;
  src.reserve(rows.size());
  for (const auto& r : rows) src.push_back(r.data_ptr<T>());
  T* out = output.data_ptr<T>();
  const int count = static_cast<int>(src.size());
  if (average) {
    sum_by_count<T, Acc, true>(out, src.data(), count, output.numel());
  } else {
    sum_by_count<T, Acc, false>(out, src.data(), count, output.numel());
  }
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
  // Integers sum in 64 bits (as at::sum does) and wrap to the dtype once at the end: unsigned, so
  // that the wrap is defined (a signed overflow would be undefined behaviour); the bits are those
  // of two's-complement int64 arithmetic.
  FSDP_CHECK(!average, "sum_in_rank_order: an average of ", output.scalar_type(),
             " tensors would be truncated; reduce with a sum and divide, or use a floating dtype");
  switch (output.scalar_type()) {
    case at::kLong:
      return sum_rows<int64_t, uint64_t>(output, rows, false);
    case at::kInt:
      return sum_rows<int32_t, uint64_t>(output, rows, false);
    case at::kChar:
      return sum_rows<int8_t, uint64_t>(output, rows, false);
    case at::kByte:
      return sum_rows<uint8_t, uint64_t>(output, rows, false);
    default:
      FSDP_CHECK(false, "sum_in_rank_order: dtype ", output.scalar_type(),
                 " is not summed here (fp32, fp64, fp16, bf16, 8/32/64-bit ints)");
  }
}

}  // namespace fsdp::detail
