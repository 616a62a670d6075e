// Operator interception: the one mechanism behind the resharded-parameter guard, the elements
// gathered on use (fully_shard_elements) and deferred_init's recorder. Those three call only this
// interface; how LibTorch is made to route the operators differs between versions and lives in
// compat/interception.cpp ([Note: operator interception] in docs/design.md).
//
// The mechanism: a marked tensor carries LibTorch's Python dispatch key, which nothing else in a
// C++ process uses, and every operator has a boxed kernel at that key that hands the call to the
// installed handler. Operators registered after install() (a library loaded later) get the kernel
// at the next install() or mark(). A marked tensor's metadata (sizes, dtype, grad) stays readable
// without the handler; .data(), variable_data() and autograd's detached copies stay marked.
// Thread-safety: install and mark may run on any thread; the scopes are per thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>
#include <string>
#include <vector>

namespace c10 {
class OperatorHandle;
struct IValue;
}  // namespace c10

namespace fsdp::compat::interception {

// The handler sees the operator and its boxed arguments on the stack; it either throws, or leaves
// the results there (usually by running the operator inside a Bypass).
using Handler = void (*)(const c10::OperatorHandle& op, std::vector<c10::IValue>* stack);

// Installs `handler` for the process (the first call registers the kernels; later calls with the
// same handler only cover operators registered since). A different handler is an error.
void install(Handler handler);

// Marks (or unmarks) t: every operator that gets t as an argument reaches the handler.
void mark(const at::Tensor& t, bool on);
bool is_marked(const at::Tensor& t);

// While one lives on a thread, every operator on that thread reaches the handler, factories (no
// tensor argument) included.
class InterceptAll {
 public:
  InterceptAll();

 private:
  c10::impl::IncludeDispatchKeyGuard include_;
};

// While one lives on a thread, operators run as if nothing were marked (the handler's own calls).
class Bypass {
 public:
  Bypass();

 private:
  c10::impl::ExcludeDispatchKeyGuard exclude_;
};

// "LibTorch <version>: <how operators are intercepted>", for errors and test failures.
std::string describe();

}  // namespace fsdp::compat::interception
