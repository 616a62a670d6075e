// Which storages were built under fsdp::deferred_init and still wait for their values, and the
// recordings that will give them their values (core/deferred_recording.h).
#include "core/deferred_init.h"

#include <algorithm>
#include <unordered_map>

#include "core/deferred_recording.h"
#include "util/mutex.h"

namespace fsdp::detail::deferred {
namespace {

using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

WeakStorage weak_of(c10::StorageImpl* impl) {
  return WeakStorage(c10::intrusive_ptr<c10::StorageImpl>::unsafe_reclaim_from_nonowning(impl));
}

struct Pending {
  Mutex mu;
  // Keyed by storage: shallow copies made while building (make_variable, detach) and views share
  // it. The weak reference keeps the address from being reused by another storage (a real
  // parameter's) while the entry exists, however long the tensors live.
  std::unordered_map<const c10::StorageImpl*, WeakStorage> storages FSDP_GUARDED_BY(mu);
  size_t swept_at FSDP_GUARDED_BY(mu) = 64;
  std::vector<std::shared_ptr<Recording>> recordings FSDP_GUARDED_BY(mu);

  // Entries whose storage no tensor holds any more can never be asked about again.
  void sweep() FSDP_REQUIRES(mu) {
    for (auto it = storages.begin(); it != storages.end();)
      it = it->second.expired() ? storages.erase(it) : std::next(it);
    swept_at = std::max<size_t>(64, 2 * storages.size());
  }
};

Pending& pending() {
  static auto* p = new Pending();  // never destroyed: tensors may outlive static destruction
  return *p;
}

c10::StorageImpl* key_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

}  // namespace

bool is_pending(const at::Tensor& t) {
  const auto* k = key_of(t);
  if (!k) return false;
  auto& p = pending();
  MutexLock lock(p.mu);
  return p.storages.count(k) > 0;
}

void add_pending(const at::Tensor& t) {
  auto* k = key_of(t);
  if (!k) return;
  auto& p = pending();
  MutexLock lock(p.mu);
  p.storages.emplace(k, weak_of(k));
  if (p.storages.size() >= p.swept_at) p.sweep();
}

void remove_pending(const at::Tensor& t) {
  auto& p = pending();
  MutexLock lock(p.mu);
  p.storages.erase(key_of(t));
}

// ---------------------------------------------------------------------------------------------
// Recordings
// ---------------------------------------------------------------------------------------------
Geometry Geometry::of(const at::Tensor& t) {
  return Geometry{t.sizes().vec(), t.strides().vec(), t.storage_offset(), t.scalar_type()};
}

bool Geometry::operator==(const Geometry& o) const {
  return sizes == o.sizes && strides == o.strides && offset == o.offset && dtype == o.dtype;
}

bool Step::writes(int64_t value) const {
  for (const auto& r : refs)
    if (r.value == value && r.written) return true;
  return false;
}

int64_t Recording::value_of(const at::Tensor& t) const {
  if (!t.defined() || !t.has_storage()) return -1;
  auto it = by_storage.find(t.storage().unsafeGetStorageImpl());
  return it == by_storage.end() ? -1 : it->second;
}

TensorRef Recording::ref_of(const at::Tensor& t, int64_t value) const {
  TensorRef r;
  r.value = value;
  r.geometry = Geometry::of(t);
  r.whole = r.geometry == values[value].geometry;
  r.wrapped = t.unsafeGetTensorImpl()->is_wrapped_number();
  return r;
}

void add_recording(std::shared_ptr<Recording> r) {
  auto& p = pending();
  MutexLock lock(p.mu);
  p.recordings.push_back(std::move(r));
}

void drop_recording(const Recording& r) {
  forget_recording(r);
  auto& p = pending();
  MutexLock lock(p.mu);
  for (const auto& [impl, id] : r.by_storage) p.storages.erase(impl);
}

void forget_recording(const Recording& r) {
  auto& p = pending();
  MutexLock lock(p.mu);
  auto& all = p.recordings;
  all.erase(std::remove_if(all.begin(), all.end(), [&](const auto& x) { return x.get() == &r; }),
            all.end());
}

std::shared_ptr<Recording> find_recording(const at::Tensor& t, TensorRef* ref) {
  auto& p = pending();
  MutexLock lock(p.mu);
  for (const auto& r : p.recordings) {
    const int64_t v = r->value_of(t);
    if (v >= 0) {
      *ref = r->ref_of(t, v);
      return r;
    }
    for (const auto& k : r->known)
      if (k.tensor._unsafe_get_target() == t.unsafeGetTensorImpl() && !k.tensor.expired()) {
        *ref = k.ref;
        return r;
      }
  }
  return nullptr;
}

}  // namespace fsdp::detail::deferred
