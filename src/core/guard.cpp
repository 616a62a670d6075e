#include "core/guard.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <fsdp/error.h>

#include <mutex>
#include <optional>
#include <unordered_map>

#include "compat.h"
#include "compat/interception.h"
#include "core/binding.h"
#include "core/deferred_init.h"
#include "core/group.h"
#include "core/root.h"
#include "util/mutex.h"

namespace fsdp::detail::guard {
namespace {

struct Entry {
  std::weak_ptr<Binding> binding;
  size_t index = 0;
  bool moved_grad = false;  // a moved-gradient marker rather than a resharded parameter
};

// Keyed by storage: detached copies and views (autograd's saved tensors) share it.
const c10::StorageImpl* key_of(const at::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

// The guarded storages and what each belongs to. Process-wide, as the interception handler that
// reads it is (it sees tensors, not roots); groups add and remove their own entries.
class Entries {
 public:
  static Entries& get() {
    static Entries entries;
    return entries;
  }
  void set(const at::Tensor& t, Entry e) {
    MutexLock lock(mu_);
    map_[key_of(t)] = std::move(e);
  }
  void erase(const at::Tensor& t) {
    MutexLock lock(mu_);
    map_.erase(key_of(t));
  }
  std::optional<Entry> find(const c10::StorageImpl* impl) {
    MutexLock lock(mu_);
    auto it = map_.find(impl);
    if (it == map_.end()) return std::nullopt;
    return it->second;
  }

 private:
  Mutex mu_;
  std::unordered_map<const c10::StorageImpl*, Entry> map_ FSDP_GUARDED_BY(mu_);
};

std::optional<Entry> find(const c10::StorageImpl* impl) { return Entries::get().find(impl); }

std::string describe(const std::optional<Entry>& e) {
  auto b = e ? e->binding.lock() : nullptr;
  if (!b) return "a resharded parameter";
  const Group* g = b->group.get();
  const auto& p = g->params()[e->index];
  return detail::cat("parameter '", g->prefix(), p.name(), "' of sharded module '", g->name(),
                     "' (", g->type_name(), ")");
}

// Zeroing a moved-gradient marker (Module::zero_grad, Optimizer::zero_grad on the full
// parameters) is harmless: it has no values. detach returns the marker itself.
bool harmless_on_marker(const c10::OperatorHandle& op) {
  const auto& name = op.schema().name();
  return name == "aten::detach" || name == "aten::detach_" || name == "aten::zero_";
}

[[noreturn]] void reject_moved_grad(const c10::OperatorHandle& op, const std::optional<Entry>& e) {
  throw Error(detail::cat(
      op.schema().name(), " was called on the gradient of the full ", describe(e),
      ". fsdp-cpp reduce-scatters that gradient into the parameter's shard, so the full "
      "parameter's gradient holds nothing. This is what an optimizer or "
      "torch::nn::utils::clip_grad_norm_ built on model->parameters() does. Fix: build the "
      "optimizer on the root FSDPModule's parameters() (the shards), clip with "
      "fsdp::clip_grad_norm_(root, ...), and read gradients from root.named_parameters()"));
}

[[noreturn]] void reject_resharded(const c10::OperatorHandle& op, const std::optional<Entry>& e) {
  auto b = e ? e->binding.lock() : nullptr;
  const Group* g = b ? b->group.get() : nullptr;
  const std::string what = detail::cat(op.schema().name(), " was called on ", describe(e),
                                       ", whose full storage is freed (resharded). ");
  const bool in_backward = g && (g->training_state() == TrainingState::kPreBackward ||
                                 g->training_state() == TrainingState::kPostBackward);
  if (in_backward && !g->unshard_in_backward())
    throw Error(what +
                "set_unshard_in_backward(false) was set on its module, which leaves it resharded "
                "in backward, but backward reads this parameter (e.g. a weight whose input needs "
                "a gradient). Fix: leave unshard_in_backward on (the default) for this module");
  if (g && g->gathers_on_use())
    throw Error(what +
                "The module is an element sharded by fsdp::fully_shard_elements: its parameters "
                "are gathered when a forward of the sharded root begins and kept until that "
                "forward's backward ends. Fix: use them only inside the root's forward; to "
                "read values outside it, use the local shards (FSDPModule::named_parameters()), "
                "or call unshard() on the element's FSDPModule first and reshard() after");
  throw Error(what +
              "A sharded module's full parameters exist only inside its forward and backward. "
              "Fix: call the module through its fsdp::Sharded holder (block(x), not "
              "block->forward(x)) and use its parameters only inside that forward; to read values "
              "outside it, use the local shards (FSDPModule::named_parameters()), or call "
              "unshard() on the module's FSDPModule first and reshard() after; build the "
              "optimizer on FSDPModule::parameters(), not on the model's.");
}

// The guarded tensors among an operator's arguments.
std::vector<at::Tensor> guarded_arguments(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  std::vector<at::Tensor> out;
  const size_t n = op.schema().arguments().size();
  for (const auto& v : torch::jit::last(*stack, n)) {
    if (v.isTensor() && compat::interception::is_marked(v.toTensor())) out.push_back(v.toTensor());
    if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList().vec())
        if (t.defined() && compat::interception::is_marked(t)) out.push_back(t);
  }
  return out;
}

const thread_local Interceptor* t_interceptor = nullptr;

// The boxed kernel every operator reaches when an argument carries the Python key: a guarded
// (resharded) parameter, a moved-gradient marker, or a tensor built under deferred_init. The
// call proceeds only when every such argument has its values: a parameter of a group gathered
// meanwhile, or of an element group that gathers on use inside the root's forward
// (fully_shard_elements); anything else throws, naming the parameter and the fix.
void on_python_key(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (t_interceptor) return (*t_interceptor)(op, stack);
  const auto args = guarded_arguments(op, stack);
  for (const at::Tensor& t : args) {
    const auto entry = find(key_of(t));
    if (entry && entry->moved_grad) {
      if (!harmless_on_marker(op)) reject_moved_grad(op, entry);
      const size_t n = op.schema().arguments().size();
      at::Tensor self = torch::jit::peek(*stack, 0, n).toTensor();
      torch::jit::drop(*stack, n);
      stack->emplace_back(std::move(self));
      return;
    }
    if (!entry && deferred::is_pending(t))
      throw Error(detail::cat(op.schema().name(),
                              " was called on a tensor built under "
                              "fsdp::deferred_init that has no values yet. Fix: call "
                              "fsdp::materialize(model) (after fully_shard) before using it"));
    auto b = entry ? entry->binding.lock() : nullptr;
    if (b) b->group->check_materialized();  // sharded before its values came: name materialize
    const bool has_values =
        b && (b->group->shard_state() == ShardState::kUnsharded || b->root->use_element(*b->group));
    if (!has_values) reject_resharded(op, entry);
    // A shallow copy of a parameter gathered meanwhile keeps its mark: checked again at each use.
  }
  // Every argument has its values now: the operator runs below this key.
  compat::interception::Bypass below;
  op.callBoxed(stack);
}

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] { compat::interception::install(&on_python_key); });
}

}  // namespace

void watch(const at::Tensor& param, std::weak_ptr<Binding> binding, size_t index) {
  install_once();
  Entries::get().set(param, Entry{std::move(binding), index});
}

void forget(const at::Tensor& param) {
  // The mark stays while the storage is freed: the tensor may outlive its group.
  Entries::get().erase(param);
}

void set_active(const at::Tensor& param, bool on) { compat::interception::mark(param, on); }

at::Tensor moved_grad_marker(const at::Tensor& param, std::weak_ptr<Binding> binding,
                             size_t index) {
  install_once();
  at::Tensor m = compat::storageless_like(param);
  compat::interception::mark(m, true);
  // One marker per parameter for the group's life (forget_marker in ~Group): bounded entries.
  Entries::get().set(m, Entry{std::move(binding), index, /*moved_grad=*/true});
  return m;
}

void install() { install_once(); }

ScopedInterceptor::ScopedInterceptor(Interceptor f) : fn_(std::move(f)), previous_(t_interceptor) {
  install_once();
  t_interceptor = &fn_;
}

ScopedInterceptor::~ScopedInterceptor() { t_interceptor = previous_; }

void forget_marker(const at::Tensor& t) { Entries::get().erase(t); }

}  // namespace fsdp::detail::guard
