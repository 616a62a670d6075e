// Stand-in for a LibTorch header that Debian's libtorch-dev 1.13 does not ship, so that
// <torch/csrc/distributed/c10d/reducer.hpp> (c10d::Reducer, PyTorch's DDP reducer, which is in
// libtorch_cpu) can be included. reducer.hpp needs only two names from it: the gradient callback
// type (checked there by a static_assert) and the context pointer type, held in a private member
// whose layout (a shared_ptr and an atomic pointer) does not depend on the class. Nothing here is
// called: every use of the context is inside libtorch. CMakeLists.txt adds this directory to
// fsdp-bench's include path only when the real header is missing.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

namespace torch::distributed::autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};
using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace torch::distributed::autograd
