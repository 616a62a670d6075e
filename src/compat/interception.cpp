// Operator interception (compat/interception.h) on LibTorch 1.13 and 2.x.
//
// Both versions: a marked tensor carries the Python dispatch key (TensorImpl::set_python_dispatch)
// and every operator gets a boxed kernel at that key that calls the handler. The kernels are
// registered per operator, for every operator the dispatcher knows; a registration listener
// collects operators defined later, which get theirs at the next install() or mark() (the
// listener runs under the dispatcher's lock, where registering would deadlock).
//
// LibTorch asks a Python-keyed tensor's interpreter to detach it (.data(), variable_data(), the
// copies autograd saves), so a C++ stand-in interpreter answers: its detach is a shallow copy that
// stays marked. The versions differ in how that interpreter is found:
// - 1.13: per tensor (TensorImpl::init_pyobj tags each marked tensor with it); the Python-key
//   fallback also dispatches through it, so an operator without a kernel still reaches the handler.
// - 2.x: one interpreter per process, from c10::impl::PyInterpreterHooksRegistry; the stand-in is
//   registered there at the lowest priority. The fallback needs a real PyObject and asserts
//   otherwise, which is why the per-operator kernels are required.
#include "compat/interception.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/PyInterpreter.h>
#include <fsdp/error.h>
#include <torch/version.h>

#include <mutex>
#include <optional>

#if TORCH_VERSION_MAJOR >= 2
#include <c10/core/impl/PyInterpreterHooks.h>
#endif

namespace fsdp::compat::interception {

namespace {

Handler g_handler = nullptr;

void trampoline(const c10::OperatorHandle& op, torch::jit::Stack* stack) { g_handler(op, stack); }

// The stand-in interpreter of marked tensors. LibTorch calls only name, the reference counting
// (there is no PyObject: nothing to count) and detach on a tensor whose sizes and strides are its
// own; the rest serve Python tensor subclasses and are unreachable here.
struct StandIn final : c10::impl::PyInterpreterVTable {
  [[noreturn]] static void unreachable(const char* what) {
    TORCH_CHECK(false, "fsdp-cpp: LibTorch asked the operator interception's stand-in Python ",
                "interpreter for ", what, ", which only Python tensor subclasses need");
  }
  std::string name() const override { return "fsdp-cpp operator interception (no Python)"; }
  c10::intrusive_ptr<c10::TensorImpl> detach(const c10::TensorImpl* self) const override;
  void dispatch(const c10::OperatorHandle& op, torch::jit::Stack* stack) const override {
    g_handler(op, stack);
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
#if TORCH_VERSION_MAJOR >= 2
  void incref(PyObject*) const override {}
  void decref(PyObject*) const override {}
  bool try_incref(const c10::impl::PyObjectSlot&) const override { return false; }
  size_t refcnt(PyObject*) const override { return 0; }
  void reportErrorCallback(PyObject*, c10::DispatchKey) const override {
    unreachable("reportErrorCallback");
  }
  void python_op_registration_trampoline(const c10::OperatorHandle&, c10::DispatchKey,
                                         c10::DispatchKeySet, torch::jit::Stack*, bool,
                                         bool) const override {
    unreachable("a Python operator registration");
  }
  void throw_abstract_impl_not_imported_error(std::string opname, const char*,
                                              const char*) const override {
    unreachable("an abstract implementation of an operator defined in Python");
  }
  c10::SymBool sym_is_contiguous(const c10::TensorImpl*, at::MemoryFormat) const override {
    unreachable("sym_is_contiguous");
  }
  int64_t numel(const c10::TensorImpl*) const override { unreachable("numel"); }
  void reset_backward_hooks(const c10::TensorImpl*) const override {}
  // GPU tracing is switched on from Python only.
  void trace_gpu_event_creation(c10::DeviceType, uintptr_t) const override {}
  void trace_gpu_event_deletion(c10::DeviceType, uintptr_t) const override {}
  void trace_gpu_event_record(c10::DeviceType, uintptr_t, uintptr_t) const override {}
  void trace_gpu_event_wait(c10::DeviceType, uintptr_t, uintptr_t) const override {}
  void trace_gpu_memory_allocation(c10::DeviceType, uintptr_t) const override {}
  void trace_gpu_memory_deallocation(c10::DeviceType, uintptr_t) const override {}
  void trace_gpu_stream_creation(c10::DeviceType, uintptr_t) const override {}
  void trace_gpu_device_synchronization(c10::DeviceType) const override {}
  void trace_gpu_stream_synchronization(c10::DeviceType, uintptr_t) const override {}
  void trace_gpu_event_synchronization(c10::DeviceType, uintptr_t) const override {}
#else
  void decref(PyObject*, bool) const override {}
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
#endif
};

c10::impl::PyInterpreter& stand_in() {
  static auto* vtable = new StandIn();  // never destroyed: tensors may outlive statics
  static auto* interp = new c10::impl::PyInterpreter(vtable);
  return *interp;
}

#if TORCH_VERSION_MAJOR >= 2
// The process has one interpreter; the marked tensor needs nothing of its own.
void attach_interpreter(c10::TensorImpl*) {}

void check_interpreter_is_ours() {
  c10::impl::PyInterpreter* found = nullptr;
  try {
    found = c10::impl::getGlobalPyInterpreter();
  } catch (const c10::Error&) {
  }
  FSDP_CHECK(found == &stand_in(), "fsdp-cpp operator interception: LibTorch ", TORCH_VERSION,
             " reports ", found ? "another" : "no",
             " Python interpreter instead of fsdp-cpp's stand-in (is libtorch_python loaded in "
             "this process?). The resharded-parameter guard, elements gathered on use and "
             "deferred_init need it. Fix: do not load PyTorch's Python bindings into a process "
             "that uses fsdp-cpp's fully_shard or deferred_init");
}
#else
void attach_interpreter(c10::TensorImpl* impl) {
  if (impl->pyobj_interpreter() == nullptr)
    impl->init_pyobj(&stand_in(), nullptr, c10::impl::PyInterpreterStatus::MAYBE_UNINITIALIZED);
}

void check_interpreter_is_ours() {}  // per tensor: attach_interpreter sets it
#endif

c10::intrusive_ptr<c10::TensorImpl> StandIn::detach(const c10::TensorImpl* self) const {
  c10::impl::ExcludeDispatchKeyGuard no_python(c10::DispatchKey::Python);
  auto r =
      self->shallow_copy_and_detach(self->version_counter(), self->allow_tensor_metadata_change());
  if (self->is_python_dispatch()) {  // the copy stays marked
    attach_interpreter(r.get());
    r->set_python_dispatch(true);
  }
  return r;
}

// Operators defined since the last registration pass, collected by the listener.
struct Pending {
  std::mutex mu;
  std::vector<c10::OperatorName> names;
  // The listener's registration (install()), held for the life of the process. Kept here, where
  // it stays reachable: a static pointer of its own that nothing reads was optimised away, and
  // LeakSanitizer reported the handle as leaked at every exit.
  std::optional<c10::RegistrationHandleRAII> listening;
};
Pending& pending() {
  static auto* p = new Pending();  // never destroyed: the listener may outlive statics
  return *p;
}

struct Listener final : c10::OpRegistrationListener {
  void onOperatorRegistered(const c10::OperatorHandle& op) override {
    std::lock_guard<std::mutex> lock(pending().mu);
    pending().names.push_back(op.operator_name());
  }
  void onOperatorDeregistered(const c10::OperatorHandle&) override {}
};

// Registers the kernel for the operators collected so far. Held for the life of the process: the
// registrations must outlive every marked tensor.
void register_pending() {
  std::vector<c10::OperatorName> names;
  {
    std::lock_guard<std::mutex> lock(pending().mu);
    names.swap(pending().names);
  }
  static auto* handles = new std::vector<c10::RegistrationHandleRAII>();
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : names)
    handles->push_back(dispatcher.registerImpl(
        name, c10::DispatchKey::Python, c10::KernelFunction::makeFromBoxedFunction<&trampoline>(),
        c10::nullopt, nullptr, "fsdp-cpp operator interception"));
}

}  // namespace

void install(Handler handler) {
  static std::once_flag once;
  std::call_once(once, [handler] {
    g_handler = handler;
    // Calls the listener once for every operator defined so far, then for each later one (it
    // locks pending().mu: not held here).
    auto listening =
        c10::Dispatcher::singleton().addRegistrationListener(std::make_unique<Listener>());
    pending().listening.emplace(std::move(listening));
    check_interpreter_is_ours();
  });
  FSDP_CHECK(g_handler == handler,
             "fsdp-cpp operator interception: a second handler was installed; the guard owns it");
  register_pending();
}

void mark(const at::Tensor& t, bool on) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (on) {
    FSDP_CHECK(g_handler, "fsdp-cpp operator interception: mark() before install()");
    register_pending();
    attach_interpreter(impl);
  }
  impl->set_python_dispatch(on);
}

bool is_marked(const at::Tensor& t) { return t.unsafeGetTensorImpl()->is_python_dispatch(); }

InterceptAll::InterceptAll() : include_(c10::DispatchKey::Python) {}

Bypass::Bypass() : exclude_(c10::DispatchKey::Python) {}

std::string describe() {
  return detail::cat("LibTorch ", TORCH_VERSION,
                     ": Python dispatch key with a boxed kernel per operator and a C++ stand-in "
#if TORCH_VERSION_MAJOR >= 2
                     "interpreter registered as the process's PyInterpreterHooks"
#else
                     "interpreter attached to each marked tensor"
#endif
  );
}

}  // namespace fsdp::compat::interception

#if TORCH_VERSION_MAJOR >= 2
namespace fsdp::compat::interception {
namespace {
// How LibTorch 2.x finds the process's interpreter. Registered below libtorch_python's priority:
// if that library is loaded it wins, and install() reports it (check_interpreter_is_ours).
// The registry passes PyInterpreterHooksArgs to the constructor up to 2.11 and nothing after.
struct StandInHooks final : c10::impl::PyInterpreterHooksInterface {
  StandInHooks() = default;
  explicit StandInHooks(c10::impl::PyInterpreterHooksArgs /*unused*/) {}
  c10::impl::PyInterpreter* getPyInterpreter() const override { return &stand_in(); }
};
}  // namespace
}  // namespace fsdp::compat::interception

namespace c10::impl {
// The registry's registerer type is unqualified in the macro: it must expand in c10::impl.
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(PyInterpreterHooksRegistry, "PyInterpreterHooks",
                                       c10::REGISTRY_FALLBACK,
                                       fsdp::compat::interception::StandInHooks)
}  // namespace c10::impl
#endif
