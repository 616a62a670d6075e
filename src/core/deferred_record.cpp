// deferred_init's recorder: while a build runs, every operator on the building thread reaches the
// Python dispatch key (the thread includes it), where the guard hands it to this recorder
// (guard::ScopedInterceptor). [Note: deferred initialisation] in docs/design.md.
//
// - A factory (no tensor argument) runs on the meta device to learn its result's shape and dtype,
//   and returns a CPU tensor of that shape with no bytes (a new value).
// - An operator with arguments built under deferred_init runs on meta stand-ins of them. A result
//   that is an argument (in-place, out=) returns that argument; one sharing an argument's meta
//   storage (a view) returns a view of the argument's value; any other is a new value. Views and
//   pure metadata operators are not recorded: a view's geometry is all replay needs.
// - An operator on ordinary tensors only runs as usual.
// - An operator that needs values on the host (item, equal) throws.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fsdp/deferred_init.h>
#include <fsdp/error.h>

#include <optional>
#include <set>
#include <string>

#include "compat.h"
#include "compat/interception.h"
#include "core/deferred_init.h"
#include "core/deferred_recording.h"
#include "core/guard.h"

namespace fsdp::detail::deferred {
namespace {

using Stack = std::vector<c10::IValue>;

// Operators whose result is a host value computed from the tensor's values.
const std::set<std::string>& host_reads() {
  static const std::set<std::string> s{
      "aten::_local_scalar_dense", "aten::item",     "aten::equal",
      "aten::is_nonzero",          "aten::allclose", "aten::_is_all_true",
      "aten::_is_any_true"};
  return s;
}
// In-place operators that change only a tensor's sizes or strides, never bytes.
const std::set<std::string>& metadata_only() {
  static const std::set<std::string> s{"aten::t_",         "aten::transpose_",  "aten::squeeze_",
                                       "aten::unsqueeze_", "aten::as_strided_", "aten::swapdims_",
                                       "aten::swapaxes_",  "aten::detach_"};
  return s;
}
// Operators that write every element of their first argument without reading it.
const std::set<std::string>& overwriting() {
  static const std::set<std::string> s{"aten::normal_",      "aten::uniform_",  "aten::fill_",
                                       "aten::zero_",        "aten::copy_",     "aten::random_",
                                       "aten::exponential_", "aten::cauchy_",   "aten::log_normal_",
                                       "aten::geometric_",   "aten::bernoulli_"};
  return s;
}
// Operators without a meta kernel in LibTorch 1.13 that return new tensors whose shapes depend
// only on their arguments' shapes (torch::nn::init::orthogonal_ uses diag): their results' shapes
// come from a run on zero-filled CPU stand-ins.
const std::set<std::string>& shape_only_without_meta() {
  static const std::set<std::string> s{"aten::diag"};
  return s;
}
const std::set<std::string>& unsupported() {
  static const std::set<std::string> s{"aten::resize_", "aten::resize_as_", "aten::set_"};
  return s;
}

c10::TypePtr unwrap_optional(c10::TypePtr t) {
  if (auto o = t->cast<c10::OptionalType>()) return o->getElementType();
  return t;
}
// Whether an operator returns tensors (a factory, when it takes none).
bool returns_tensors(const c10::FunctionSchema& s) {
  for (const auto& r : s.returns()) {
    auto t = unwrap_optional(r.type());
    if (auto l = t->cast<c10::ListType>()) t = unwrap_optional(l->getElementType());
    if (t->kind() == c10::TypeKind::TensorType) return true;
  }
  return false;
}
bool is_device_arg(const c10::Argument& a) {
  return unwrap_optional(a.type())->kind() == c10::TypeKind::DeviceObjType;
}

// Calls f(tensor, element) for each defined tensor in an argument (element -1: not a list).
template <class F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) f(v.toTensor(), -1);
  } else if (v.isTensorList()) {
    auto l = v.toTensorList();
    for (size_t i = 0; i < l.size(); ++i) {
      at::Tensor t = l.get(i);
      if (t.defined()) f(t, static_cast<int64_t>(i));
    }
  } else if (v.isList()) {
    auto l = v.toList();
    for (size_t i = 0; i < l.size(); ++i) {
      c10::IValue e = l.get(i);
      if (e.isTensor() && e.toTensor().defined()) f(e.toTensor(), static_cast<int64_t>(i));
    }
  }
}

// `v` with its list element (or itself when element is -1) replaced by `t`.
c10::IValue with_tensor(const c10::IValue& v, int64_t element, const at::Tensor& t) {
  if (element < 0) return t;
  if (v.isTensorList()) {
    auto l = v.toTensorList().copy();
    l.set(element, t);
    return l;
  }
  auto l = v.toList().copy();
  l.set(element, t.defined() ? c10::IValue(t) : c10::IValue());
  return l;
}

bool is_default_generator(const c10::IValue& g) {
  return g.isNone() ||
         (g.isGenerator() && g.toGenerator().unsafeGetGeneratorImpl() ==
                                 at::detail::getDefaultCPUGenerator().unsafeGetGeneratorImpl());
}

// A CPU tensor with meta_out's geometry and no bytes: a new storage, or a view into `storage`.
at::Tensor make_pending(const at::Tensor& meta_out, const c10::Storage* storage) {
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(meta_out.scalar_type()));
  auto* impl = t.unsafeGetTensorImpl();
  if (storage) impl->set_storage_keep_dtype(*storage);
  impl->set_sizes_and_strides(meta_out.sizes(), meta_out.strides(), meta_out.storage_offset());
  if (meta_out.unsafeGetTensorImpl()->is_wrapped_number()) impl->set_wrapped_number(true);
  compat::interception::mark(t, true);
  return t;
}

at::Tensor meta_alias(const Value& v, const TensorRef& r) {
  at::Tensor m = at::empty({0}, at::TensorOptions().device(at::kMeta).dtype(r.geometry.dtype));
  m.set_(v.meta.storage(), r.geometry.offset, r.geometry.sizes, r.geometry.strides);
  if (r.wrapped) m.unsafeGetTensorImpl()->set_wrapped_number(true);
  return m;
}

at::Tensor meta_copy(const at::Tensor& t) {
  at::Tensor m = at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
  if (t.unsafeGetTensorImpl()->is_wrapped_number())
    m.unsafeGetTensorImpl()->set_wrapped_number(true);
  return m;
}

std::string first_line(const char* what) {
  std::string s = what;
  return s.substr(0, s.find('\n'));
}

}  // namespace

struct Call;

class Recorder {
 public:
  explicit Recorder(Recording& rec) : rec_(rec) {}
  void on_operator(const c10::OperatorHandle& op, Stack* stack);

 private:
  void factory(const c10::OperatorHandle& op, Stack* stack, const Stack& args);
  void on_values(const c10::OperatorHandle& op, Stack* stack, const Stack& args,
                 std::vector<TensorRef> refs);
  Stack stand_ins(Call& call);
  void run_on_meta(const Call& call, Stack& meta);
  Stack shapes_on_cpu(const Call& call);
  Stack results_of(const Call& call, const Stack& meta, Step& step);
  void record(Call& call, Step step);
  void check_devices_and_generators(const c10::FunctionSchema& s, Stack& meta_args);
  int64_t new_value(const at::Tensor& meta_out, at::Tensor* pending);
  std::string describe(const c10::OperatorHandle& op) const { return op.schema().name(); }

  Recording& rec_;
};

void Recorder::on_operator(const c10::OperatorHandle& op, Stack* stack) {
  compat::interception::Bypass no_python;
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const Stack args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  bool any_tensor = false;
  std::vector<TensorRef> refs;
  for (size_t i = 0; i < n; ++i)
    for_each_tensor(args[i], [&](const at::Tensor& t, int64_t element) {
      any_tensor = true;
      const int64_t v = compat::interception::is_marked(t) ? rec_.value_of(t) : -1;
      if (v < 0) {
        FSDP_CHECK(!compat::interception::is_marked(t), "deferred_init: ", describe(op),
                   " was called on a tensor that this deferred_init did not build (a sharded "
                   "module's parameter, or a tensor of another deferred_init call). Fix: build "
                   "the whole model inside one deferred_init and use only its own tensors there");
        return;  // an ordinary tensor
      }
      TensorRef r = rec_.ref_of(t, v);
      r.position = i;
      r.element = element;
      const auto* alias = schema.arguments()[i].alias_info();
      r.written = alias && alias->isWrite();
      refs.push_back(r);
    });
  if (refs.empty()) {
    if (!any_tensor && returns_tensors(schema)) return factory(op, stack, args);
    op.callBoxed(stack);
    return;
  }
  FSDP_CHECK(!host_reads().count(schema.name()), "deferred_init: ", describe(op),
             " reads the values of a tensor built under fsdp::deferred_init on the host "
             "(item(), equal, printing), but deferred_init records operators without running "
             "them, so there are no values yet. Fix: move the read after fsdp::materialize, or "
             "compute it from tensors built outside deferred_init");
  FSDP_CHECK(!unsupported().count(schema.name()), "deferred_init: ", describe(op),
             " on a tensor built under fsdp::deferred_init is not supported (it replaces the "
             "tensor's storage). Fix: create the tensor with its final shape");
  on_values(op, stack, args, std::move(refs));
}

void Recorder::check_devices_and_generators(const c10::FunctionSchema& s, Stack& meta_args) {
  for (size_t i = 0; i < s.arguments().size(); ++i) {
    const auto& a = s.arguments()[i];
    if (is_device_arg(a) && !meta_args[i].isNone()) {
      const auto d = meta_args[i].toDevice();
      FSDP_CHECK(d.is_cpu() || d.is_meta(), "deferred_init: ", s.name(), " asks for a tensor on ",
                 d,
                 "; deferred_init builds CPU tensors. Fix: build on the CPU and move the model "
                 "after materialize");
    }
    if (is_device_arg(a)) meta_args[i] = c10::Device(at::kMeta);
    if (unwrap_optional(a.type())->kind() == c10::TypeKind::GeneratorType)
      FSDP_CHECK(is_default_generator(meta_args[i]), "deferred_init: ", s.name(),
                 " draws from its own generator; deferred_init replays random operators on the "
                 "default CPU generator only. Fix: use the default generator "
                 "(torch::manual_seed) inside the build");
  }
}

int64_t Recorder::new_value(const at::Tensor& meta_out, at::Tensor* pending) {
  *pending = make_pending(meta_out, nullptr);
  auto* impl = pending->storage().unsafeGetStorageImpl();
  Value v{Geometry::of(meta_out), meta_out,
          c10::weak_intrusive_ptr<c10::StorageImpl>(
              c10::intrusive_ptr<c10::StorageImpl>::unsafe_reclaim_from_nonowning(impl)),
          static_cast<int64_t>(meta_out.storage().nbytes())};
  const auto id = static_cast<int64_t>(rec_.values.size());
  rec_.values.push_back(std::move(v));
  rec_.by_storage[impl] = id;
  add_pending(*pending);
  return id;
}

void Recorder::factory(const c10::OperatorHandle& op, Stack* stack, const Stack& args) {
  const auto& schema = op.schema();
  bool has_device = false;
  for (const auto& a : schema.arguments()) has_device = has_device || is_device_arg(a);
  FSDP_CHECK(has_device, "deferred_init: ", describe(op),
             " creates a tensor without a device argument, so deferred_init cannot build it "
             "without bytes. Fix: create that tensor outside deferred_init");
  Stack meta = args;
  check_devices_and_generators(schema, meta);
  try {
    op.callBoxed(&meta);
  } catch (const c10::Error&) {
    // No meta kernel (randperm in 1.13): a factory's result shape depends only on its arguments,
    // so run it on the CPU once, with the generator put back, and keep only the shape.
    meta = args;
    const at::Tensor state = generator_state();
    op.callBoxed(&meta);
    set_generator_state(state);
    for (auto& r : meta)
      if (r.isTensor() && r.toTensor().defined()) r = meta_copy(r.toTensor());
  }
  Step step(op);
  step.args = args;
  Stack results;
  for (const auto& r : meta) {
    std::vector<int64_t> fresh;
    if (r.isTensor()) {
      at::Tensor p;
      fresh.push_back(new_value(r.toTensor(), &p));
      results.emplace_back(p);
    } else {
      FSDP_CHECK(!r.isTensorList(), "deferred_init: ", describe(op),
                 " returns a list of tensors, which deferred_init does not build");
      results.push_back(r);
    }
    step.fresh.push_back(std::move(fresh));
  }
  rec_.steps.push_back(std::move(step));
  torch::jit::drop(*stack, args.size());
  for (auto& r : results) stack->push_back(std::move(r));
}

// One call of an operator with values among its arguments.
struct Call {
  const c10::OperatorHandle& op;
  const Stack& args;
  std::vector<TensorRef> refs;
  std::vector<at::Tensor> meta_ref;    // per ref: its meta stand-in
  std::vector<at::Tensor> meta_other;  // stand-ins of ordinary tensor arguments
  const std::string& name() const { return op.schema().name(); }
  at::Tensor argument(const TensorRef& r) const {
    const c10::IValue& a = args[r.position];
    if (r.element < 0) return a.toTensor();
    return a.isTensorList() ? a.toTensorList().get(r.element)
                            : a.toList().get(r.element).toTensor();
  }
};

void Recorder::on_values(const c10::OperatorHandle& op, Stack* stack, const Stack& args,
                         std::vector<TensorRef> refs) {
  Call call{op, args, std::move(refs), {}, {}};
  Stack meta = stand_ins(call);
  run_on_meta(call, meta);
  Step step(op);
  Stack results = results_of(call, meta, step);
  record(call, std::move(step));
  torch::jit::drop(*stack, args.size());
  for (auto& r : results) stack->push_back(std::move(r));
}

// The arguments with meta stand-ins: meta aliases of the values (new per call, so that metadata
// changes stay local) and meta copies of ordinary tensors.
Stack Recorder::stand_ins(Call& call) {
  const auto& schema = call.op.schema();
  Stack meta = call.args;
  call.meta_ref.resize(call.refs.size());
  size_t k = 0;
  for (size_t i = 0; i < call.args.size(); ++i) {
    const auto* alias = schema.arguments()[i].alias_info();
    for_each_tensor(call.args[i], [&](const at::Tensor& t, int64_t element) {
      const auto& refs = call.refs;
      if (k < refs.size() && refs[k].position == i && refs[k].element == element) {
        call.meta_ref[k] = meta_alias(rec_.values[refs[k].value], refs[k]);
        meta[i] = with_tensor(meta[i], element, call.meta_ref[k]);
        ++k;
        return;
      }
      FSDP_CHECK(!(alias && alias->isWrite()), "deferred_init: ", call.name(),
                 " would write values computed from tensors built under deferred_init into a "
                 "tensor built outside it, which deferred_init cannot defer. Fix: create that "
                 "tensor inside the build too");
      call.meta_other.push_back(meta_copy(t));
      meta[i] = with_tensor(meta[i], element, call.meta_other.back());
    });
  }
  check_devices_and_generators(schema, meta);
  return meta;
}

void Recorder::run_on_meta(const Call& call, Stack& meta) {
  const auto& rets = call.op.schema().returns();
  const auto& first = call.refs[0];
  const bool in_place = first.position == 0 && first.element < 0 && first.written &&
                        rets.size() == 1 && rets[0].alias_info() && rets[0].alias_info()->isWrite();
  try {
    call.op.callBoxed(&meta);
  } catch (const c10::Error& e) {
    if (shape_only_without_meta().count(call.name())) {
      meta = shapes_on_cpu(call);
      return;
    }
    // An in-place operator's result is its argument: its shape needs no meta kernel.
    if (!in_place)
      throw Error(detail::cat("deferred_init: ", call.name(),
                              " has no meta kernel in this LibTorch (", first_line(e.what()),
                              "), so the shape of its result cannot be known without values. "
                              "Fix: apply it after fsdp::materialize"));
    meta = {c10::IValue(call.meta_ref[0])};
  }
}

// The results of a shape_only_without_meta operator, as meta tensors.
Stack Recorder::shapes_on_cpu(const Call& call) {
  Stack cpu = call.args;
  for (size_t k = 0; k < call.refs.size(); ++k) {
    const auto& m = call.meta_ref[k];
    at::Tensor z = at::zeros(m.sizes(), at::TensorOptions().dtype(m.scalar_type()));
    if (call.refs[k].wrapped) z.unsafeGetTensorImpl()->set_wrapped_number(true);
    cpu[call.refs[k].position] = with_tensor(cpu[call.refs[k].position], call.refs[k].element, z);
  }
  call.op.callBoxed(&cpu);
  for (auto& r : cpu)
    if (r.isTensor() && r.toTensor().defined()) r = meta_copy(r.toTensor());
  return cpu;
}

// The CPU results for the meta results: an argument (in-place, out=), a view of an argument's
// value, or a new value (listed in step.fresh).
Stack Recorder::results_of(const Call& call, const Stack& meta, Step& step) {
  auto result = [&](const at::Tensor& m, std::vector<int64_t>& fresh) -> at::Tensor {
    if (!m.defined()) return m;
    for (size_t j = 0; j < call.refs.size(); ++j) {
      if (m.unsafeGetTensorImpl() == call.meta_ref[j].unsafeGetTensorImpl())
        return call.argument(call.refs[j]);
      if (m.is_alias_of(call.meta_ref[j])) {
        const c10::Storage s = call.argument(call.refs[j]).storage();
        return make_pending(m, &s);
      }
    }
    for (const auto& o : call.meta_other)
      FSDP_CHECK(!m.is_alias_of(o), "deferred_init: ", call.name(),
                 " returns a view of a tensor built outside deferred_init while it also takes "
                 "tensors built inside, which deferred_init does not support");
    at::Tensor p;
    fresh.push_back(new_value(m, &p));
    return p;
  };
  Stack results;
  for (const auto& r : meta) {
    std::vector<int64_t> fresh;
    if (r.isTensor()) {
      results.emplace_back(result(r.toTensor(), fresh));
    } else if (r.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& m : r.toTensorList().vec()) out.push_back(result(m, fresh));
      results.emplace_back(std::move(out));
    } else {
      results.push_back(r);
    }
    step.fresh.push_back(std::move(fresh));
  }
  return results;
}

// Keeps the step when it writes bytes or creates values; views and metadata changes need none.
void Recorder::record(Call& call, Step step) {
  bool writes = false, creates = false;
  for (const auto& r : call.refs) writes = writes || r.written;
  for (const auto& f : step.fresh) creates = creates || !f.empty();
  if (metadata_only().count(call.name())) {
    // No bytes change; the argument takes its stand-in's new sizes and strides.
    for (size_t j = 0; j < call.refs.size(); ++j)
      if (call.refs[j].written && call.refs[j].element < 0)
        call.argument(call.refs[j])
            .unsafeGetTensorImpl()
            ->set_sizes_and_strides(call.meta_ref[j].sizes(), call.meta_ref[j].strides(),
                                    call.meta_ref[j].storage_offset());
    return;
  }
  if (!writes && !creates) return;
  step.args = call.args;
  for (const auto& r : call.refs)
    step.args[r.position] = with_tensor(step.args[r.position], r.element, at::Tensor());
  // Ordinary tensors are copied: the user may change them before materialize.
  at::NoGradGuard no_grad;
  for (auto& a : step.args)
    for_each_tensor(a, [&](const at::Tensor& t, int64_t element) {
      at::Tensor c = t.detach().clone();
      if (t.unsafeGetTensorImpl()->is_wrapped_number())
        c.unsafeGetTensorImpl()->set_wrapped_number(true);
      a = with_tensor(a, element, c);
    });
  if (overwriting().count(call.name()))
    for (const auto& r : call.refs) {
      bool read_elsewhere = false;
      for (const auto& o : call.refs)
        read_elsewhere = read_elsewhere || (o.value == r.value && !o.written);
      if (r.written && r.whole && r.element < 0 && !read_elsewhere)
        step.overwritten.push_back(r.value);
    }
  step.refs = std::move(call.refs);
  rec_.steps.push_back(std::move(step));
}

guard::Interceptor make_recorder(Recording& rec) {
  auto r = std::make_shared<Recorder>(rec);
  return [r](const c10::OperatorHandle& op, Stack* stack) { r->on_operator(op, stack); };
}

at::Tensor generator_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace fsdp::detail::deferred
