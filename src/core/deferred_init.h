// Deferred initialisation inside the library: which tensors were built under fsdp::deferred_init
// and still wait for their values (include/fsdp/deferred_init.h is the public side).
//
// Such a tensor is a CPU tensor of its full shape with no bytes, marked with the Python dispatch
// key like a resharded parameter (core/guard.h), so that any operator reaching it before
// fsdp::materialize fails with a clear error instead of reading nothing.
// Thread-safety: the registry is guarded by a mutex.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/communicator.h>

namespace fsdp::detail::deferred {

// True while `t` (or a tensor sharing its storage) was built under deferred_init and has not been
// materialised.
bool is_pending(const at::Tensor& t);
void add_pending(const at::Tensor& t);     // t: storageless, carrying the Python key
void remove_pending(const at::Tensor& t);  // materialised (or its recording dropped)

// If `param` is a module parameter that fully_shard manages (it was pending when sharded), copies
// this rank's rows of `full` (its values, full shape) into the shard and returns the ranks that
// shard it (to compare the values across them); the full parameter stays without bytes. Null for
// any other tensor.
Communicator* deliver_to_shard(const at::Tensor& param, const at::Tensor& full);

}  // namespace fsdp::detail::deferred
