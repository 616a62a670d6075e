// The quantized wire's encoding (fsdp/quantized.h), shared by the gather transform and the
// reduce-scatter: n values as bf16 (2n bytes), or as int8 with one fp32 scale per block of
// `block` values (4 ceil(n / block) bytes of scales, then n bytes), or as they are (kNone).
// Deterministic: the same values give the same bytes on every rank.
// Thread-safety: pure functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/quantized.h>

#include <cstdint>

namespace fsdp::quant {

// Bytes for n values of `dtype` (the dtype only matters for kNone).
int64_t encoded_bytes(int64_t n, Quantization q, at::ScalarType dtype, int block);
// `x`: flat, floating, n values; writes encoded_bytes(n, ...) bytes at `out`.
void encode(const at::Tensor& x, uint8_t* out, Quantization q, int block);
// The n values encoded at `in`, decoded into fp32 at `out` (kNone: `dtype` values converted).
void decode(const uint8_t* in, int64_t n, Quantization q, at::ScalarType dtype, int block,
            float* out);
// The checks of a block size (64..256) and a dtype (floating), naming the setting.
void check_block(int block);

}  // namespace fsdp::quant
