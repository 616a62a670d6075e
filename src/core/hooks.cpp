#include "core/hooks.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "core/binding.h"
#include "core/group.h"
#include "core/guard.h"
#include "core/root.h"

namespace fsdp::detail {
namespace {

// The binding's root and group while the model lives.
template <class F>
void enter(const std::weak_ptr<Binding>& weak, F&& f) {
  if (auto b = weak.lock()) f(*b->root, *b->group);
}

// AccumulateGrad post hook: the parameter's gradient for this backward is final.
struct GradReadyHook : torch::autograd::FunctionPostHook {
  GradReadyHook(std::weak_ptr<Binding> b, size_t i) : binding(std::move(b)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    enter(binding, [&](Root& r, Group& g) { r.on_grad_ready(g, index); });
    return outputs;
  }
  std::weak_ptr<Binding> binding;
  size_t index;
};

// AccumulateGrad pre hook: autograd is about to accumulate into the full parameter.
struct AccumulateHook : torch::autograd::FunctionPreHook {
  AccumulateHook(std::weak_ptr<Binding> b, size_t i) : binding(std::move(b)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    enter(binding, [&](Root& r, Group& g) { r.on_accumulate(g, index); });
    return grads;
  }
  std::weak_ptr<Binding> binding;
  size_t index;
};

// The input-side node of one forward call: identity in backward, run once everything between the
// call's outputs and this input has run. Marks the call's backward done (for resharding), never
// triggers reduction.
struct InputBackward : torch::autograd::Node {
  explicit InputBackward(std::weak_ptr<Binding> b) : binding(std::move(b)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    enter(binding, [](Root& r, Group& g) { r.on_input_backward(g); });
    return std::move(grads);
  }
  std::string name() const override { return "fsdp::InputBackward"; }
  std::weak_ptr<Binding> binding;
};

// For inputs that are themselves views: the same signal through a custom Function (its output is a
// view of the input, so LibTorch rejects in-place modification of it inside forward rather than
// losing the view's history).
struct BindingRef : torch::CustomClassHolder {
  explicit BindingRef(std::weak_ptr<Binding> b) : binding(std::move(b)) {}
  std::weak_ptr<Binding> binding;
};
struct InputViewBackward : torch::autograd::Function<InputViewBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, c10::intrusive_ptr<BindingRef> b,
                            const at::Tensor& x) {
    ctx->saved_data["binding"] = c10::IValue::make_capsule(std::move(b));
    ctx->set_materialize_grads(false);
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* ref = static_cast<BindingRef*>(ctx->saved_data["binding"].toCapsule().get());
    enter(ref->binding, [](Root& r, Group& g) { r.on_input_backward(g); });
    return {at::Tensor(), grads[0]};
  }
};

}  // namespace

void attach_param_hooks(const std::shared_ptr<Binding>& b) {
  std::weak_ptr<Binding> weak = b;
  auto& params = b->group->params();
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    guard::watch(p.param(), weak, i);
    p.free_full();  // resharded (and guarded) until its first gather
    if (!p.accumulator()) continue;
    p.set_moved_grad_marker(guard::moved_grad_marker(p.param(), weak, i));
    p.accumulator()->add_pre_hook(std::make_unique<AccumulateHook>(weak, i));
    p.set_hook_key(p.accumulator()->add_post_hook(std::make_unique<GradReadyHook>(weak, i)));
  }
}

void attach_output_hook(const at::Tensor& out, const std::weak_ptr<Binding>& b) {
  // The TensorBase form: the hook also fires with an undefined gradient (an output that gets none
  // while its node runs for another output).
  const torch::autograd::Node* node = out.grad_fn().get();  // owns the hook: outlives it
  static_cast<const at::TensorBase&>(out).register_hook(
      [b, node](const at::TensorBase&) -> at::TensorBase {
        enter(b, [&](Root& r, Group& g) { r.on_output_hook(g, node); });
        return at::TensorBase();
      });
}

at::Tensor hand_input(const at::Tensor& x, const std::weak_ptr<Binding>& b) {
  auto bound = b.lock();
  if (x.is_view()) {
    auto out = InputViewBackward::apply(c10::make_intrusive<BindingRef>(b), x);
    bound->group->record_input_node(out.grad_fn());
    return out;
  }
  return bound->group->hand_to_forward(x, compat::make_node<InputBackward>(b));
}

}  // namespace fsdp::detail
