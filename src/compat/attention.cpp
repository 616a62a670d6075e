#include "compat/attention.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <torch/version.h>

namespace fsdp::compat {

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

}  // namespace fsdp::compat
