#include "compat/attention.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <torch/version.h>

#include <cmath>
#include <limits>

namespace fsdp::compat {
namespace {

// (B, Hkv, T, D) -> (B, Hkv * n_rep, T, D), each key/value head repeated n_rep times in place
// (transformers' repeat_kv): every rank and both LibTorch versions see the same layout.
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, h, n_rep, t, d}).reshape({b, h * n_rep, t, d});
}

}  // namespace

#if TORCH_VERSION_MAJOR >= 2

bool has_scaled_dot_product_attention() { return true; }

at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, bool is_causal) {
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, is_causal);
}

#else

bool has_scaled_dot_product_attention() { return false; }

at::Tensor scaled_dot_product_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        bool) {
  throw Error(detail::cat("at::scaled_dot_product_attention needs LibTorch 2.0 or newer; this is ",
                          TORCH_VERSION, ": use the written-out attention"));
}

#endif

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(1) % k.size(1) == 0,
              "causal_attention: q (B, H, T, D) and k, v (B, Hkv, T, D) with Hkv dividing H");
  const int64_t n_rep = q.size(1) / k.size(1);
  const at::Tensor kr = repeat_kv(k, n_rep), vr = repeat_kv(v, n_rep);
  if (has_scaled_dot_product_attention())
    return scaled_dot_product_attention(q, kr, vr, /*is_causal=*/true);
  // The math of scaled_dot_product_attention's reference path: scores, the future masked to
  // -inf, softmax over keys.
  const int64_t t = q.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  auto scores = at::matmul(q, kr.transpose(-2, -1)) * scale;  // (B, H, T, T)
  const auto future = at::ones({t, t}, q.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores, -1), vr);
}

}  // namespace fsdp::compat
