// Deferred initialisation's recording: the operators a model's construction applied to tensors
// that have no bytes yet, in order, so that materialize can replay them on real tensors.
// [Note: deferred initialisation] in docs/design.md.
//
// Values are identified by storage: every tensor built under deferred_init gets a storage of its
// own with no bytes (a "base"), and a view of it shares that storage with its own sizes, strides
// and offset, like a real view. Shallow copies (make_variable, detach) share the storage too, so
// each of them names the same value. An operator argument is therefore a value plus the geometry
// through which the operator saw it; replay hands the operator the real base itself or an alias of
// the real base's storage with that geometry.
// Thread-safety: a recording is written by the thread that builds and read by materialize, never
// both at once; the registry of live recordings is guarded by a mutex.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <memory>
#include <unordered_map>
#include <vector>

#include "core/guard.h"

namespace torch::nn {
class Module;
}

namespace fsdp::detail::deferred {

// How a tensor looks into its value's storage (sizes, strides and offset in its own elements).
struct Geometry {
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;
  static Geometry of(const at::Tensor& t);
  bool operator==(const Geometry& o) const;
  bool operator!=(const Geometry& o) const { return !(*this == o); }
};

// The bytes behind one storage built under deferred_init: a base and every view of it.
struct Value {
  Geometry geometry;  // the base's
  at::Tensor meta;    // its stand-in on the meta device (computes the shapes of results)
  // Holds the storage's address while recorded, so that no other storage can reuse it.
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t nbytes = 0;
};

// A tensor argument of a recorded operator.
struct TensorRef {
  int64_t value = -1;
  Geometry geometry;     // as the operator saw it
  bool whole = false;    // the value's own geometry: replay passes the base itself
  bool wrapped = false;  // a wrapped number (type promotion treats it as a scalar)
  bool written = false;  // the schema marks the argument as written (Tensor(a!))
  size_t position = 0;   // argument index
  int64_t element = -1;  // index in a list argument; -1 for a tensor argument
};

// One recorded operator call.
struct Step {
  explicit Step(c10::OperatorHandle h) : op(std::move(h)) {}
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // the call's arguments; argument tensors built under
                                  // deferred_init are left undefined (refs say which value)
  std::vector<TensorRef> refs;
  // Per return: the new values it created (one per tensor; a tensor list: one per element), or
  // none when it is not a tensor or aliases an argument.
  std::vector<std::vector<int64_t>> fresh;
  std::vector<int64_t> overwritten;  // values written entirely without being read (normal_, ...)
  bool writes(int64_t value) const;
};

struct Recording {
  std::vector<Value> values;
  std::vector<Step> steps;
  at::Tensor generator_state;  // the default CPU generator's state when deferred_init began
  std::unordered_map<const c10::StorageImpl*, int64_t> by_storage;
  // The model's parameters and buffers when the build returned a module, by identity: found even
  // if something (mixed precision's set_data) gives one a new storage before materialize.
  struct Known {
    c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
    TensorRef ref;
  };
  std::vector<Known> known;

  // The value `t` (built by this recording) refers to, or -1.
  int64_t value_of(const at::Tensor& t) const;
  TensorRef ref_of(const at::Tensor& t, int64_t value) const;
};

// The interceptor that records operators into `rec` (core/deferred_record.cpp).
guard::Interceptor make_recorder(Recording& rec);
// The default CPU generator's state, under its mutex.
at::Tensor generator_state();
void set_generator_state(const at::Tensor& state);

// Live recordings (built, not yet materialised).
void add_recording(std::shared_ptr<Recording> r);
void forget_recording(const Recording& r);  // materialize took it
void drop_recording(const Recording& r);    // a failed build: also un-marks its values
// The recording `t` was built by, with its reference; null when none.
std::shared_ptr<Recording> find_recording(const at::Tensor& t, TensorRef* ref);

}  // namespace fsdp::detail::deferred
