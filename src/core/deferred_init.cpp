#include "core/deferred_init.h"

#include <mutex>
#include <unordered_set>

namespace fsdp::detail::deferred {
namespace {

struct Pending {
  std::mutex mu;
  // Keyed by storage: shallow copies made while building (make_variable, detach) share it.
  std::unordered_set<const c10::StorageImpl*> storages;
};

Pending& pending() {
  static auto* p = new Pending();  // never destroyed: tensors may outlive static destruction
  return *p;
}

const c10::StorageImpl* key_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

}  // namespace

bool is_pending(const at::Tensor& t) {
  const auto* k = key_of(t);
  if (!k) return false;
  auto& p = pending();
  std::lock_guard<std::mutex> lock(p.mu);
  return p.storages.count(k) > 0;
}

void add_pending(const at::Tensor& t) {
  auto& p = pending();
  std::lock_guard<std::mutex> lock(p.mu);
  p.storages.insert(key_of(t));
}

void remove_pending(const at::Tensor& t) {
  auto& p = pending();
  std::lock_guard<std::mutex> lock(p.mu);
  p.storages.erase(key_of(t));
}

}  // namespace fsdp::detail::deferred
