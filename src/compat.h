// The one place where LibTorch 1.13 and 2.x, Gloo and NCCL differ. Everything else in fsdp-cpp
// calls these functions and never tests TORCH_VERSION or the backend itself.
//
// 1.13 Gloo lacks reduce-scatter, _allgather_base, AVG and bf16 (verified; see docs/design.md).
// NCCL: compiled only where LibTorch's CMake config defines USE_C10D_NCCL (a CUDA build).
// 2.x: ProcessGroupGloo/NCCL derive from c10d::Backend; make_process_group wraps the backend in
// a c10d::ProcessGroup (compat/gloo.h), so callers hold a ProcessGroup on both versions. 2.x Gloo
// also has reduce-scatter, _allgather_base, AVG and bf16; all_gather_flat and exchange_blocks keep
// the 1.13 route on both (one code path; a possible 2.x speed-up, not a correctness matter).
// Other version differences: compat/autograd.h (node ownership), compat/optim.h (optimizer state
// keys), compat/reducer.h (c10d::Reducer), compat/interception.h (operator interception).
// Thread-safety: stateless functions.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

namespace fsdp::compat {

// Storage of a full-shaped parameter: release and re-create the bytes, keeping the TensorImpl,
// its sizes, version counter and autograd metadata.
void free_storage(const at::Tensor& t);
void alloc_storage(const at::Tensor& t);
bool storage_allocated(const at::Tensor& t);  // false once free_storage dropped the bytes
// Points t's storage at t's bytes inside `block` from `byte_offset` on, instead of allocating
// them: t holds a reference to block's storage until free_storage (pooled parameter storage).
void borrow_storage(const at::Tensor& t, const at::Tensor& block, size_t byte_offset);
// A tensor of t's shape and dtype with no bytes (guarded markers; never read by a kernel).
at::Tensor storageless_like(const at::Tensor& t);
// Elements [offset, offset + n) of a contiguous tensor as a 1-D tensor on its storage, made
// without the dispatcher (no autograd view, a version counter of its own): the pieces of a
// buffer that only the library's own copies read and write, a few per parameter per collective,
// where narrow() would cost more than the copy.
at::Tensor flat_alias(const at::Tensor& base, int64_t offset, int64_t n);
// The dtype autograd gives the gradients reaching the leaf `t`, each cast to it before they are
// summed and accumulated into t.grad() (Tensor::set_grad_dtype; t's own dtype restores the
// default). Returns false, doing nothing, on a LibTorch without it (1.13).
bool set_grad_dtype(const at::Tensor& t, at::ScalarType dtype);

// The dtype a tensor travels as on `backend` (bf16 is bit-cast to fp16 on Gloo).
at::ScalarType wire_dtype(at::ScalarType t, const std::string& backend);
// Whether the backend reduces `t` itself (else the caller sums in fp32 locally).
bool backend_reduces(at::ScalarType t, const std::string& backend);

// output (size * n) receives every rank's input (n); both contiguous, same dtype.
c10::intrusive_ptr<c10d::Work> all_gather_flat(c10d::ProcessGroup& pg, const at::Tensor& output,
                                               const at::Tensor& input);
// Exchanges blocks so that `received` (size * n) holds block `rank` of every rank's `input`.
// The caller sums `received.view({size, n})` over dim 0: a reduce-scatter that puts (N-1)/N of the
// buffer on the wire, like a ring.
c10::intrusive_ptr<c10d::Work> exchange_blocks(c10d::ProcessGroup& pg, const at::Tensor& received,
                                               const at::Tensor& input);

// A TCPStore (server or client) that gives up within o.timeout, as 1.13's does. 2.x's client
// retries a refused connection after a back-off and took 5.3 s to give up with a 2 s timeout, so
// on 2.x it is built on a helper thread and abandoned at the limit (the thread ends by itself).
c10::intrusive_ptr<c10d::Store> make_tcp_store(const std::string& host,
                                               const c10d::TCPStoreOptions& o);

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& backend, const std::string& bind_host);
// "gloo" or, where LibTorch has CUDA and a GPU is present, "nccl" for backend "auto".
std::string resolve_backend(const std::string& requested);

}  // namespace fsdp::compat
