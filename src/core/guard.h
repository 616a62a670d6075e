// The resharded-parameter guard: any operation on a full parameter whose storage is freed throws
// an fsdp::Error naming the parameter and the fix, instead of reading freed memory.
//
// A resharded parameter keeps its full shape (autograd's saved tensors and accumulators refer to
// it) but has no bytes. ATen kernels do not check that, so reading it (a logging call, a parent
// reducing a child's weight, an optimizer built on the full parameters) would crash. The guard
// marks such a tensor with LibTorch's Python dispatch key, which no other tensor in a C++ process
// carries, and registers a boxed kernel for every operator at that key; metadata (sizes, dtype,
// requires_grad, grad) stays readable. [Note: the resharded-parameter guard] in docs/design.md.
// The guard never starts a collective: an element's parameter read inside the root's forward
// waits for the gather that forward issued when it began (Root::use_element).
// Process-wide, as the interception handler that reads it is (it sees tensors, not roots).
// Thread-safety: the registry is guarded by a mutex; set_active runs on the owning thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

namespace c10 {
class OperatorHandle;
struct IValue;
}  // namespace c10

namespace fsdp::detail {
struct Binding;
namespace guard {

// Remembers which group (through its binding) and parameter a full parameter belongs to.
void watch(const at::Tensor& param, std::weak_ptr<Binding> binding, size_t index);
void forget(const at::Tensor& param);  // its group is gone (the mark stays if still freed)
// On: the parameter's storage is freed and every operation on it throws.
void set_active(const at::Tensor& param, bool on);

// The gradient a full parameter is left with once its gradient was reduce-scattered into the
// shard: full shape, no bytes, guarded. An optimizer (or clip_grad_norm_, or a logging read) built
// on the full parameters then fails naming the parameter and the fix, instead of silently skipping
// a parameter without gradient. Zeroing it (Module::zero_grad, Optimizer::zero_grad) is allowed and
// does nothing. The group clears it before the parameter's next forward.
at::Tensor moved_grad_marker(const at::Tensor& param, std::weak_ptr<Binding> binding, size_t index);
void forget_marker(const at::Tensor& t);  // its group is gone

// While one is installed on a thread, every operator that reaches the Python key on that thread
// goes to the interceptor instead of the guard (deferred initialisation's recorder, which also
// includes the key in the thread's dispatch set). Nested scopes restore the previous one.
using Interceptor = std::function<void(const c10::OperatorHandle&, std::vector<c10::IValue>*)>;
void install();  // registers the interception handler (once per process)
class ScopedInterceptor {
 public:
  explicit ScopedInterceptor(Interceptor f);
  ~ScopedInterceptor();
  ScopedInterceptor(const ScopedInterceptor&) = delete;
  ScopedInterceptor& operator=(const ScopedInterceptor&) = delete;

 private:
  Interceptor fn_;
  const Interceptor* previous_;
};

}  // namespace guard
}  // namespace fsdp::detail
