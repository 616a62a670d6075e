// Causal self-attention through at::scaled_dot_product_attention where LibTorch has it (2.x), and
// the same mathematics written out where it does not (1.13, which predates it). The models call
// this and never test the LibTorch version themselves (src/compat.h).
// Thread-safety: stateless.
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdp::compat {

// softmax(q k^T / sqrt(D) + causal mask) v. q: (B, H, T, D); k, v: (B, Hkv, T, D) with H a
// multiple of Hkv (grouped-query attention: query head h reads key/value head h / (H / Hkv), as
// transformers' repeat_kv). Returns (B, H, T, D).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Whether causal_attention runs at::scaled_dot_product_attention (false on LibTorch 1.13).
bool has_scaled_dot_product_attention();

}  // namespace fsdp::compat
