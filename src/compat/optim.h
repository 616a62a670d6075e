// How torch::optim::Optimizer::state() is keyed. 1.13: a std::string, c10::guts::to_string of the
// parameter's TensorImpl* (its "0x..." form). 2.x (since c10::guts::to_string was removed): the
// TensorImpl* itself, as a void*. Either way the identity is the TensorImpl object: set_data
// keeps a parameter's state, a new tensor object does not have one.
//
// Also: whether ATen's float and double sqrt is the correctly rounded IEEE one. A LibTorch built
// with MKL (PyPI's wheel) takes it from MKL's vector library (vsSqrt, vdSqrt in high-accuracy
// mode), which is not: about one float in 150 differs in its last bit. Without MKL (Debian's
// 1.13) ATen's Vectorized sqrt is the hardware instruction. fsdp::optim's AdamW matches either
// (src/optim/adamw.cpp).
#pragma once

#include <ATen/Config.h>
#include <ATen/core/Tensor.h>
#include <torch/version.h>

#include <string>

#if TORCH_VERSION_MAJOR < 2
#include <c10/util/C++17.h>  // c10::guts::to_string
#endif

namespace fsdp::compat {

constexpr bool kAtenSqrtIsIeee = !AT_MKL_ENABLED();

#if TORCH_VERSION_MAJOR >= 2
using OptimStateKey = void*;
inline OptimStateKey optim_state_key(const at::Tensor& p) { return p.unsafeGetTensorImpl(); }
#else
using OptimStateKey = std::string;
inline OptimStateKey optim_state_key(const at::Tensor& p) {
  return c10::guts::to_string(p.unsafeGetTensorImpl());
}
#endif

}  // namespace fsdp::compat
