#include "compat.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/PyInterpreter.h>
#include <fsdp/error.h>
#include <torch/version.h>

#ifdef USE_C10D_NCCL  // defined by LibTorch's CMake config when it was built with NCCL
#include <ATen/cuda/CUDAContext.h>
#include <ATen/native/cuda/Resize.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

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

bool storage_allocated(const at::Tensor& t) {
  return t.storage().unsafeGetStorageImpl()->nbytes() > 0 || t.numel() == 0;
}

namespace {
BoxedKernel python_key_kernel = nullptr;
void python_key_trampoline(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  python_key_kernel(op, stack);
}

c10::impl::PyInterpreter& guard_interpreter();

// The stand-in interpreter of guarded tensors (see set_python_key). LibTorch calls only name,
// decref (with no PyObject: nothing to do) and detach on a tensor whose sizes and strides are its
// own; the rest belong to Python tensor subclasses and are unreachable here.
struct GuardInterpreter final : c10::impl::PyInterpreterVTable {
  [[noreturn]] static void unreachable(const char* what) {
    TORCH_CHECK(false, "fsdp-cpp: LibTorch asked the guard's stand-in Python interpreter for ",
                what, ", which only Python tensor subclasses need");
  }
  std::string name() const override { return "fsdp-cpp guard (no Python)"; }
  void decref(PyObject*, bool) const override {}
  c10::intrusive_ptr<c10::TensorImpl> detach(const c10::TensorImpl* self) const override {
    c10::impl::ExcludeDispatchKeyGuard no_python(c10::DispatchKey::Python);
    auto r = self->shallow_copy_and_detach(self->version_counter(),
                                           self->allow_tensor_metadata_change());
    r->init_pyobj(&guard_interpreter(), nullptr,
                  c10::impl::PyInterpreterStatus::DEFINITELY_UNINITIALIZED);
    r->set_python_dispatch(self->is_python_dispatch());  // the copy stays guarded
    return r;
  }
  void dispatch(const c10::OperatorHandle& op, torch::jit::Stack* stack) const override {
    python_key_kernel(op, stack);
  }
  void python_dispatcher(const c10::OperatorHandle&, c10::DispatchKeySet,
                         torch::jit::Stack*) const override {
    unreachable("the Python dispatcher");
  }
  bool is_contiguous(const c10::TensorImpl*, at::MemoryFormat) const override {
    unreachable("is_contiguous");
  }
  bool is_strides_like(const c10::TensorImpl*, at::MemoryFormat) const override {
    unreachable("is_strides_like");
  }
  bool is_non_overlapping_and_dense(const c10::TensorImpl*) const override {
    unreachable("is_non_overlapping_and_dense");
  }
  c10::Device device(const c10::TensorImpl*) const override { unreachable("device"); }
  int64_t dim(const c10::TensorImpl*) const override { unreachable("dim"); }
  c10::IntArrayRef strides(const c10::TensorImpl*) const override { unreachable("strides"); }
  c10::IntArrayRef sizes(const c10::TensorImpl*) const override { unreachable("sizes"); }
  c10::SymIntArrayRef sym_sizes(const c10::TensorImpl*) const override { unreachable("sym_sizes"); }
  c10::Layout layout(const c10::TensorImpl*) const override { unreachable("layout"); }
  c10::SymInt sym_numel(const c10::TensorImpl*) const override { unreachable("sym_numel"); }
  c10::SymIntArrayRef sym_strides(const c10::TensorImpl*) const override {
    unreachable("sym_strides");
  }
  c10::SymInt sym_storage_offset(const c10::TensorImpl*) const override {
    unreachable("sym_storage_offset");
  }
  void trace_gpu_event_creation(uintptr_t) const override {}
  void trace_gpu_event_deletion(uintptr_t) const override {}
  void trace_gpu_event_record(uintptr_t, uintptr_t) const override {}
  void trace_gpu_event_wait(uintptr_t, uintptr_t) const override {}
  void trace_gpu_memory_allocation(uintptr_t) const override {}
  void trace_gpu_memory_deallocation(uintptr_t) const override {}
  void trace_gpu_stream_creation(uintptr_t) const override {}
  void trace_gpu_device_synchronization() const override {}
  void trace_gpu_stream_synchronization(uintptr_t) const override {}
  void trace_gpu_event_synchronization(uintptr_t) const override {}
};

c10::impl::PyInterpreter& guard_interpreter() {
  static auto* vtable = new GuardInterpreter();  // never destroyed: tensors may outlive statics
  static auto* interp = new c10::impl::PyInterpreter(vtable);
  return *interp;
}
}  // namespace

void set_python_key(const at::Tensor& t, bool on) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (on && impl->pyobj_interpreter() == nullptr)
    impl->init_pyobj(&guard_interpreter(), nullptr,
                     c10::impl::PyInterpreterStatus::MAYBE_UNINITIALIZED);
  impl->set_python_dispatch(on);
}

void register_for_all_operators_at_python_key(BoxedKernel kernel) {
  python_key_kernel = kernel;
  // Held for the life of the process: the registrations must outlive every guarded tensor.
  static auto* handles = new std::vector<c10::RegistrationHandleRAII>();
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames())
    handles->push_back(dispatcher.registerImpl(
        name, c10::DispatchKey::Python,
        c10::KernelFunction::makeFromBoxedFunction<&python_key_trampoline>(), c10::nullopt, nullptr,
        "fsdp-cpp resharded-parameter guard"));
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

c10::intrusive_ptr<c10d::Work> exchange_blocks(c10d::ProcessGroup& pg, const at::Tensor& received,
                                               const at::Tensor& input) {
  at::Tensor out = received, in = input;
  std::vector<int64_t> equal_splits;  // empty: equal blocks
  return pg.alltoall_base(out, in, equal_splits, equal_splits);
}

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& backend, const std::string& bind_host) {
#ifdef USE_C10D_NCCL
  if (backend == "nccl") {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  }
#endif
  FSDP_CHECK(backend == "gloo", "backend '", backend,
             "' is not available in this LibTorch build (CPU only); use backend \"gloo\"");
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  if (bind_host.empty()) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_host));
  }
  // Two worker threads: an all-gather and a reduce-scatter can be in flight together.
  opts->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
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
