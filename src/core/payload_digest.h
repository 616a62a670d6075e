// Digests of a collective's payload, for verified collectives (core/verified.h): the XXH3 of a part
// of its bytes (exact: any changed bit changes it, and both sides hash the same bytes), and a
// linear sketch of a part of its values (a fixed pseudo-random projection with weights +-1,
// summed in fp64, with the sums of absolute values and of squares that bound its rounding:
// [Note: verified collectives] in docs/design.md). Both read a rotating part of the payload when
// asked to (rotating_part), so that every byte is covered within `period` steps.
// Thread-safety: pure functions of their arguments.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fsdp::detail {

// Units [lo, hi) of a payload (bytes for a digest, elements for a sketch).
struct Part {
  int64_t lo = 0, hi = 0;
  int64_t size() const { return hi - lo; }
};

// The part of a payload of `units` checked in step `step` for the group registered as `group`:
// the whole payload when `period` is 1, else its (step + group) % period-th of `period` equal
// slices, so that any `period` consecutive steps cover all of it.
Part rotating_part(int64_t units, int64_t step, int64_t group, int period);

// XXH3 of bytes [bytes.lo, bytes.hi) of the concatenation of `pieces` (contiguous tensors, copied
// to host memory when elsewhere).
uint64_t digest_bytes(const std::vector<at::Tensor>& pieces, Part bytes);
uint64_t digest_bytes(const at::Tensor& t, Part bytes);

// A linear sketch over elements [lo, hi): sum_i w_i x_i with w_i = +-1 a pure function of `seed`
// and the element's index i (so every rank projects a block alike), and sum_i |x_i|, sum_i x_i^2.
// Evaluated in fp64 in blocks of 64: each sum is within gamma(64 + n / 64 + 1) * sum_i |x_i| of
// its exact value (gamma(k) = k u / (1 - k u), u = 2^-53); fp32, bf16 and fp16 convert exactly.
struct Sketch {
  double signed_sum = 0, abs_sum = 0, square_sum = 0;
};
// REQUIRES: `t` 1-D, contiguous, float, double, bfloat16 or half (copied to host when elsewhere).
Sketch sketch_values(const at::Tensor& t, Part elements, uint64_t seed);

// The fp64 rounding factor gamma(k) of a sum of k terms.
double fp64_gamma(int64_t k);

}  // namespace fsdp::detail
