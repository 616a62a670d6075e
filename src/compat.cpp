#include "compat.h"

#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>
#include <fsdp/error.h>
#include <torch/version.h>

#include <future>
#include <memory>
#include <stdexcept>
#include <thread>

#ifdef USE_C10D_NCCL  // defined by LibTorch's CMake config when it was built with NCCL
#include <ATen/cuda/CUDAContext.h>
#include <ATen/native/cuda/Resize.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "compat/gloo.h"

namespace fsdp::compat {

namespace {
void resize_bytes(const at::Tensor& t, size_t bytes) {
  auto* impl = t.storage().unsafeGetStorageImpl();
#ifdef USE_C10D_NCCL
  if (t.is_cuda()) {
    at::native::resize_bytes_cuda(impl, bytes);
    return;
  }
#endif
  FSDP_CHECK(t.is_cpu(), "parameter storage on ", t.device(), " is not supported by this build");
  at::native::resize_bytes_cpu(impl, bytes);
}
}  // namespace

void free_storage(const at::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  // A 0-byte borrowed storage still holds its block's reference: release that too.
  if (impl->nbytes() == 0 && impl->data_ptr().get() == nullptr) return;
  // resize_bytes_cpu swaps in a fresh (empty) DataPtr: the old bytes are released immediately,
  // and every view sharing this StorageImpl (autograd's saved tensors) sees the swap.
  resize_bytes(t, 0);
}

void alloc_storage(const at::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  const size_t want = static_cast<size_t>(t.storage_offset() + t.numel()) * t.element_size();
  if (impl->nbytes() == want) return;
  resize_bytes(t, want);
}

void borrow_storage(const at::Tensor& t, const at::Tensor& block, size_t byte_offset) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  const size_t want = static_cast<size_t>(t.storage_offset() + t.numel()) * t.element_size();
  c10::StorageImpl* owner = block.storage().unsafeGetStorageImpl();
  FSDP_CHECK(byte_offset + want <= owner->nbytes() && t.device() == block.device(),
             "borrow_storage: ", want, " bytes at offset ", byte_offset, " exceed the block of ",
             owner->nbytes(), " bytes");
  c10::raw::intrusive_ptr::incref(owner);
  void* data = static_cast<char*>(owner->data_ptr().get()) + byte_offset;
  // The DataPtr's context is the block's storage: releasing the DataPtr (free_storage swaps in an
  // empty one) drops the reference.
  impl->set_data_ptr_noswap(c10::DataPtr(
      data, owner,
      [](void* ctx) { c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx)); },
      block.device()));
  impl->set_nbytes(want);
}

at::Tensor storageless_like(const at::Tensor& t) {
  at::Tensor m = at::empty({0}, at::TensorOptions().dtype(t.scalar_type()).device(t.device()));
  m.unsafeGetTensorImpl()->set_sizes_contiguous(t.sizes());
  return m;
}

at::Tensor flat_alias(const at::Tensor& base, int64_t offset, int64_t n) {
  FSDP_CHECK(base.is_contiguous() && offset >= 0 && n >= 0 && offset + n <= base.numel(),
             "internal: flat_alias of elements [", offset, ", ", offset + n, ") of a tensor of ",
             base.numel(), " elements", base.is_contiguous() ? "" : " that is not contiguous");
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                   base.dtype());
  impl->set_storage_offset(base.storage_offset() + offset);
  impl->set_sizes_contiguous({n});
  return at::Tensor(std::move(impl));
}

bool storage_allocated(const at::Tensor& t) {
  return t.storage().unsafeGetStorageImpl()->nbytes() > 0 || t.numel() == 0;
}

at::ScalarType wire_dtype(at::ScalarType t, const std::string& backend) {
  if (backend == "gloo" && t == at::kBFloat16) return at::kHalf;
  return t;
}

bool backend_reduces(at::ScalarType t, const std::string& backend) {
  if (backend == "gloo") return t != at::kBFloat16 && t != at::kHalf;
  return true;
}

c10::intrusive_ptr<c10d::Work> all_gather_flat(c10d::ProcessGroup& pg, const at::Tensor& output,
                                               const at::Tensor& input) {
  // 1.13 Gloo has no _allgather_base: gather into per-rank views of the flat output.
  std::vector<std::vector<at::Tensor>> outs{output.chunk(pg.getSize(), 0)};
  std::vector<at::Tensor> ins{input};
  return pg.allgather(outs, ins);
}

namespace {
// Tensor::set_grad_dtype came after 2.11 (a template, so that its absence is not an error).
template <class T>
bool set_grad_dtype_of(const T& t, at::ScalarType dtype) {
#if TORCH_VERSION_MAJOR >= 2
  if constexpr (requires { t.set_grad_dtype(dtype); }) {
    t.set_grad_dtype(dtype);
    return true;
  }
#endif
  (void)t;
  (void)dtype;
  return false;
}
}  // namespace

bool set_grad_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return set_grad_dtype_of(t, dtype);
}

namespace {
// alltoall_base was renamed all_to_all_single after 2.11.
template <class PG>
c10::intrusive_ptr<c10d::Work> all_to_all(PG& pg, at::Tensor& out, at::Tensor& in) {
  std::vector<int64_t> equal_splits;  // empty: equal blocks
#if TORCH_VERSION_MAJOR >= 2
  if constexpr (requires { pg.all_to_all_single(out, in, equal_splits, equal_splits); })
    return pg.all_to_all_single(out, in, equal_splits, equal_splits);
  else
#endif
    return pg.alltoall_base(out, in, equal_splits, equal_splits);
}
}  // namespace

c10::intrusive_ptr<c10d::Work> exchange_blocks(c10d::ProcessGroup& pg, const at::Tensor& received,
                                               const at::Tensor& input) {
  at::Tensor out = received, in = input;
  return all_to_all(pg, out, in);
}

c10::intrusive_ptr<c10d::Store> make_tcp_store(const std::string& host,
                                               const c10d::TCPStoreOptions& o) {
#if TORCH_VERSION_MAJOR >= 2
  using StorePtr = c10::intrusive_ptr<c10d::Store>;
  auto result = std::make_shared<std::promise<StorePtr>>();
  auto future = result->get_future();
  std::thread([result, host, o] {
    try {
      result->set_value(c10::make_intrusive<c10d::TCPStore>(host, o));
    } catch (...) {
      result->set_exception(std::current_exception());
    }
  }).detach();
  // A little slack: a connection made just at the limit is still taken.
  if (future.wait_for(o.timeout + std::chrono::milliseconds(200)) != std::future_status::ready)
    throw std::runtime_error(detail::cat("no store answered at ", host, ":", o.port, " within ",
                                         o.timeout.count(), " ms"));
  return future.get();
#else
  return c10::make_intrusive<c10d::TCPStore>(host, o);
#endif
}

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& backend, const std::string& bind_host) {
#ifdef USE_C10D_NCCL
  if (backend == "nccl") {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    return wrap_backend(store, rank, size,
                        c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts),
                        "nccl");
  }
#endif
  FSDP_CHECK(backend == "gloo", "backend '", backend,
             "' is not available in this LibTorch build (CPU only); use backend \"gloo\"");
  return wrap_backend(store, rank, size, make_gloo(store, rank, size, timeout, bind_host), "gloo");
}

std::string resolve_backend(const std::string& requested) {
#ifdef USE_C10D_NCCL
  if (requested == "auto") return at::cuda::is_available() ? "nccl" : "gloo";
#else
  if (requested == "auto") return "gloo";
#endif
  FSDP_CHECK(requested == "gloo" || requested == "nccl", "unknown backend '", requested,
             "': expected \"gloo\", \"nccl\" or \"auto\"");
  return requested;
}

}  // namespace fsdp::compat
