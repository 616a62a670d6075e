// Fused attention, which LibTorch 1.13 lacks: at::scaled_dot_product_attention arrived in 2.0
// (flash and memory-efficient kernels on CUDA; on the CPU a fused flash kernel of the same
// mathematics, or the written-out composite where its conditions do not hold). Code outside compat
// asks here whether it exists and calls it here. Thread-safety: stateless.
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

}  // namespace fsdp::compat
