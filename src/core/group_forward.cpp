// Group: its part of a forward call (state, inputs, outputs). The root drives the call
// (core/root_forward.cpp); these carry it out.
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>
#include <torch/csrc/autograd/variable.h>

#include "core/group.h"

namespace fsdp::detail {

void Group::begin_iteration() {
  input_nodes_.clear();
  output_nodes_.clear();
  forwarded_with_grad_ = false;
}

void Group::enter_forward() {
  call_inputs_.clear();
  state_before_forward_ = training_state_;
  transition(TrainingState::kForward,
             {TrainingState::kIdle, TrainingState::kPreBackward, TrainingState::kPostBackward});
  forward_start_us_ = trace::enabled() ? trace::now_us() : -1;
}

void Group::leave_forward() {
  if (forward_start_us_ >= 0)
    trace::complete("forward " + name_, "compute", forward_start_us_,
                    trace::now_us() - forward_start_us_);
  forward_start_us_ = -1;
  transition(state_before_forward_, {TrainingState::kForward});
}

void Group::abort_forward() noexcept {
  call_inputs_.clear();
  forward_start_us_ = -1;
  if (training_state_ == TrainingState::kForward) training_state_ = state_before_forward_;
}

at::Tensor Group::cast_input(const at::Tensor& input) const {
  const auto& mp = options_.mixed_precision;
  const bool cast = mp.cast_forward_inputs && mp.param_dtype && input.defined() &&
                    input.is_floating_point() && input.scalar_type() != *mp.param_dtype;
  return cast ? input.to(*mp.param_dtype) : input;
}

at::Tensor Group::cast_output(const at::Tensor& y) const {
  const auto& to = options_.mixed_precision.output_dtype;
  if (!to || !y.defined() || !y.is_floating_point() || y.scalar_type() == *to) return y;
  return y.to(*to);
}

at::Tensor Group::hand_to_forward(const at::Tensor& x, const compat::NodePtr& node) {
  // The same tensor passed twice is one tensor inside forward too: an in-place change through one
  // argument is seen through the other, with its history.
  for (const auto& w : call_inputs_)
    if (w.outer.unsafeGetTensorImpl() == x.unsafeGetTensorImpl()) return w.inner;
  node->set_next_edges({torch::autograd::impl::gradient_edge(x)});
  node->add_input_metadata(x);
  at::Tensor y = x.variable_data();
  torch::autograd::impl::set_version_counter(y, torch::autograd::impl::version_counter(x));
  torch::autograd::impl::set_gradient_edge(y, {node, 0});
  input_nodes_.push_back(node);
  call_inputs_.push_back(CallInput{x, y, node.get()});
  return y;
}

// [Note: inputs modified in place] An input handed to forward through the input-side node is a
// separate tensor that shares the caller's storage and version counter. When forward modifies it
// in place with grad mode on, autograd rebases the history of that tensor only: the caller's
// tensor holds the new values with its old history, and every later use of it would get the
// wrong gradient. Without sharding, the in-place op rebases the caller's tensor itself; so does
// this, once forward returns, by giving it the inner tensor's gradient edge (whose history leads
// back through the input-side node to the old one). A leaf that requires grad is refused, as
// LibTorch refuses in-place ops on such leaves without sharding.
void Group::rebase_modified_inputs() {
  for (size_t i = 0; i < call_inputs_.size(); ++i) {
    const CallInput& w = call_inputs_[i];
    if (w.inner.grad_fn().get() == w.node) continue;  // not modified in place under grad mode
    FSDP_CHECK(w.outer.grad_fn().get() != nullptr, "sharded module '", name_, "' (", type_name_,
               ") modified its tensor input #", i,
               " in place, but that input is a leaf that requires grad (LibTorch refuses in-place "
               "operations on such a leaf). Fix: pass a copy (x.clone()) or change the module to "
               "work out of place");
    torch::autograd::impl::set_gradient_edge(w.outer,
                                             torch::autograd::impl::gradient_edge(w.inner));
  }
  call_inputs_.clear();
}

}  // namespace fsdp::detail
