// Fused attention, which LibTorch 1.13 lacks: at::scaled_dot_product_attention arrived in 2.0
// (flash and memory-efficient kernels on CUDA; on the CPU a fused flash kernel of the same
// mathematics, or the written-out composite where its conditions do not hold). Code outside compat
// asks here whether it exists and calls it here, and never tests the LibTorch version itself.
// Thread-safety: stateless.
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdp::compat {

// Whether this LibTorch has at::scaled_dot_product_attention.
bool has_scaled_dot_product_attention();

// softmax(q k^T / sqrt(hd) [+ causal mask]) v through at::scaled_dot_product_attention: q, k, v
// (B, heads, T, hd) -> (B, heads, T, hd), no dropout, the default scale. REQUIRES:
// has_scaled_dot_product_attention() (throws fsdp::Error naming the LibTorch version otherwise).
at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, bool is_causal);

// softmax(q k^T / sqrt(D) + causal mask) v. q: (B, H, T, D); k, v: (B, Hkv, T, D) with H a
// multiple of Hkv (grouped-query attention: query head h reads key/value head h / (H / Hkv), as
// transformers' repeat_kv). Returns (B, H, T, D). Fused where LibTorch has it, written out on 1.13.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

}  // namespace fsdp::compat
