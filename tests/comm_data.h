// Seeded test data for the communicator tests and the comm benchmark's self-check: every rank can
// build what every other rank contributed, so references are computed locally.
// Thread-safety: stateless.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>

namespace fsdp::testing {

// The integer dtype with the same width as `t`, for bit-exact comparisons and random bit patterns.
inline at::ScalarType bits_dtype(at::ScalarType t) {
  switch (c10::elementSize(t)) {
    case 1:
      return at::kChar;
    case 2:
      return at::kShort;
    case 4:
      return at::kInt;
    default:
      return at::kLong;
  }
}

// True when a and b hold the same bytes (NaN payloads included).
inline bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  return at::equal(a.contiguous().view(bits_dtype(a.scalar_type())),
                   b.contiguous().view(bits_dtype(b.scalar_type())));
}

// `n` arbitrary bit patterns of dtype `t` (NaNs, infinities and subnormals included): what a
// transport (all-gather, broadcast) must deliver unchanged.
inline at::Tensor random_bits(int64_t n, uint64_t seed, at::ScalarType t) {
  auto gen = at::detail::createCPUGenerator(seed);
  const int64_t lim = c10::elementSize(t) == 1   ? (1 << 7)
                      : c10::elementSize(t) == 2 ? (1 << 15)
                      : c10::elementSize(t) == 4 ? (int64_t{1} << 31)
                                                 : (int64_t{1} << 62);
  return at::randint(-lim, lim, {n}, gen, at::TensorOptions(bits_dtype(t))).view(t);
}

// `n` values of dtype `t` that are multiples of 2^-12 with |x| < 8. A sum over up to 8 ranks is
// then exact in fp32 (at most 18 significant bits), in any order, so a reduction has exactly one
// correct answer: the exact sum rounded once to the output dtype. Accumulating in fp16/bf16 would
// round intermediate sums and miss it.
inline at::Tensor exact_sum_values(int64_t n, uint64_t seed, at::ScalarType t) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto x = at::randn({n}, gen, at::TensorOptions(at::kDouble));
  x = x.mul_(2.5).clamp_(-7.9, 7.9).mul_(4096).round_().div_(4096);
  return x.to(t);
}

// Values whose sum depends on the order of addition: normal draws scaled over 2^-20..2^20, with
// signed zeros among them.
inline at::Tensor order_sensitive_values(int64_t n, uint64_t seed, at::ScalarType t) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto x = at::randn({n}, gen, at::TensorOptions(at::kDouble));
  auto scale = at::pow(2.0, at::randint(-20, 21, {n}, gen, at::TensorOptions(at::kDouble)));
  x.mul_(scale);
  if (n > 8) x.narrow(0, 0, n / 8).zero_().neg_();  // -0.0
  return x.to(t);
}

}  // namespace fsdp::testing
