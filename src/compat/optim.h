// How torch::optim::Optimizer::state() is keyed. 1.13: a std::string, c10::guts::to_string of the
// parameter's TensorImpl* (its "0x..." form). 2.x (since c10::guts::to_string was removed): the
// TensorImpl* itself, as a void*. Either way the identity is the TensorImpl object: set_data
// keeps a parameter's state, a new tensor object does not have one.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/version.h>

#include <string>

#if TORCH_VERSION_MAJOR < 2
#include <c10/util/C++17.h>  // c10::guts::to_string
#endif

namespace fsdp::compat {

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
