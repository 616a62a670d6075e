#include "core/guard.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <fsdp/error.h>

#include <mutex>
#include <unordered_map>

#include "compat.h"
#include "core/group.h"

namespace fsdp::detail::guard {
namespace {

struct Entry {
  std::weak_ptr<Group> group;
  size_t index = 0;
};

std::mutex& mu() {
  static std::mutex m;
  return m;
}
std::unordered_map<const c10::TensorImpl*, Entry>& entries() {
  static std::unordered_map<const c10::TensorImpl*, Entry> e;
  return e;
}

std::string describe(const c10::TensorImpl* impl) {
  std::lock_guard<std::mutex> lock(mu());
  auto it = entries().find(impl);
  if (it == entries().end()) return "a resharded parameter";
  auto g = it->second.group.lock();
  if (!g) return "a resharded parameter";
  const auto& p = g->params()[it->second.index];
  return detail::cat("parameter '", g->prefix(), p.name(), "' of sharded module '", g->name(),
                     "' (", g->type_name(), ")");
}

// The boxed kernel every operator reaches when an argument is a guarded (resharded) parameter.
void reject(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::TensorImpl* found = nullptr;
  const size_t n = op.schema().arguments().size();
  for (const auto& v : torch::jit::last(*stack, n)) {
    if (v.isTensor() && v.toTensor().unsafeGetTensorImpl()->is_python_dispatch())
      found = v.toTensor().unsafeGetTensorImpl();
    if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList().vec())
        if (t.defined() && t.unsafeGetTensorImpl()->is_python_dispatch())
          found = t.unsafeGetTensorImpl();
    if (found) break;
  }
  throw Error(detail::cat(
      op.schema().name(), " was called on ", describe(found),
      ", whose full storage is freed (resharded). A sharded module's full parameters exist only "
      "inside its forward and backward. Fix: call the module through its fsdp::Sharded holder "
      "(block(x), not block->forward(x)) and use its parameters only inside that forward; to read "
      "values outside it, use the local shards (FSDPModule::named_parameters()), or call unshard() "
      "on the module's FSDPModule first and reshard() after; build the optimizer on "
      "FSDPModule::parameters(), not on the model's."));
}

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] { compat::register_for_all_operators_at_python_key(&reject); });
}

}  // namespace

void watch(const at::Tensor& param, std::weak_ptr<Group> group, size_t index) {
  install_once();
  std::lock_guard<std::mutex> lock(mu());
  entries()[param.unsafeGetTensorImpl()] = Entry{std::move(group), index};
}

void forget(const at::Tensor& param) {
  // The mark stays while the storage is freed: the tensor may outlive its group.
  std::lock_guard<std::mutex> lock(mu());
  entries().erase(param.unsafeGetTensorImpl());
}

void set_active(const at::Tensor& param, bool on) {
  param.unsafeGetTensorImpl()->set_python_dispatch(on);
}

}  // namespace fsdp::detail::guard
