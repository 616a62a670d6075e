// Group: a forward call (pre-forward gather, inputs, outputs, post-forward reshard).
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include "core/buffers.h"
#include "core/context.h"
#include "core/group.h"
#include "core/guard.h"

namespace fsdp::detail {
namespace {

// A forward called from inside a backward (a hook, a recomputation): no rounds there
// ([Note: calls that differ between ranks]); its gathers are issued directly.
bool in_backward() { return torch::autograd::get_current_graph_task_nodes_in_graph() != nullptr; }

// The input-side node of one forward call: identity in backward, run once everything between
// this call's outputs and this input has run. Marks the call's backward done (for resharding),
// never triggers reduction. The input it stands for is handed to the module as a new tensor that
// is not a view and shares the input's storage and version counter, so in-place modification of
// the input inside forward behaves exactly as without sharding.
struct InputBackward : torch::autograd::Node {
  explicit InputBackward(std::weak_ptr<Group> g) : group(std::move(g)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (auto g = group.lock()) g->context().backward().on_input_backward(*g);
    return std::move(grads);
  }
  std::string name() const override { return "fsdp::InputBackward"; }
  std::weak_ptr<Group> group;
};

// For inputs that are themselves views: the same signal through a custom Function (its output
// is a view of the input, so LibTorch rejects in-place modification of it inside forward rather
// than losing the view's history).
struct GroupRef : torch::CustomClassHolder {
  explicit GroupRef(std::weak_ptr<Group> g) : group(std::move(g)) {}
  std::weak_ptr<Group> group;
};
struct InputViewBackward : torch::autograd::Function<InputViewBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, c10::intrusive_ptr<GroupRef> g,
                            const at::Tensor& x) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(g));
    ctx->set_materialize_grads(false);
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* ref = static_cast<GroupRef*>(ctx->saved_data["group"].toCapsule().get());
    if (auto g = ref->group.lock()) g->context().backward().on_input_backward(*g);
    return {at::Tensor(), grads[0]};
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------
void Group::begin_iteration() {
  input_nodes_.clear();
  output_nodes_.clear();
  forwarded_with_grad_ = false;
}

void Group::pre_forward() {
  call_inputs_.clear();
  const bool top_level = !context_->in_forward();
  if (top_level) context_->advance_epoch();
  check_materialized();  // before any state changes: the module stays usable after the error
  FSDP_CHECK(!is_list() || !is_root(), "sharded module list ", type_name_,
             " was called with no sharded parent: a module list is one group inside a model "
             "and cannot be its root. Fix: fully_shard the model that holds its modules (its "
             "root) after the list, before the first forward");
  state_before_forward_ = training_state_;
  transition(TrainingState::kForward,
             {TrainingState::kIdle, TrainingState::kPreBackward, TrainingState::kPostBackward});
  try {
    context_->on_pre_forward(this);
    // The round that opens a top-level call comes before any other collective of the call, so
    // that ranks whose top-level calls differ stop there, naming both calls. Gathered values
    // older than the shards (an optimizer step since the gather, e.g. after an evaluation forward
    // that kept the root gathered) are dropped and gathered again, decided in the same round.
    if (top_level && !in_backward()) context_->calls().begin_top_level(*this);
    if (is_root() && options_.broadcast_buffers && state_before_forward_ == TrainingState::kIdle)
      broadcast_buffers_to_all();
    gather_for_call();
    wait_for_unshard();
  } catch (...) {
    abort_forward();  // a failed gather (a custom all-gather that threw): usable again after
    throw;
  }
  if (at::GradMode::is_enabled()) forwarded_with_grad_ = true;
  forward_start_us_ = trace::enabled() ? trace::now_us() : -1;
}

void Group::post_forward(const std::vector<at::Tensor>& outs) {
  rebase_modified_inputs();
  if (forward_start_us_ >= 0)
    trace::complete("forward " + name_, "compute", forward_start_us_,
                    trace::now_us() - forward_start_us_);
  std::weak_ptr<Group> self = weak_from_this();
  for (const auto& out : outs) {
    if (!out.defined() || !out.requires_grad() || !out.grad_fn()) continue;
    // The TensorBase form: the hook also fires with an undefined gradient (an output that gets
    // none while its node runs for another output).
    const torch::autograd::Node* node = out.grad_fn().get();  // owns the hook: outlives it
    static_cast<const at::TensorBase&>(out).register_hook(
        [self, node](const at::TensorBase&) -> at::TensorBase {
          if (auto g = self.lock()) g->context().backward().on_output_hook(*g, node);
          return at::TensorBase();
        });
    output_nodes_.push_back(out.grad_fn());
  }
  context_->on_post_forward(this);
  transition(state_before_forward_, {TrainingState::kForward});
  // A module list waits for the end of the top-level forward (below): its other modules may
  // come next.
  if (resolved_reshard_after_forward() && state_before_forward_ == TrainingState::kIdle &&
      !is_list())
    reshard_after_forward();
  // Elements gathered on use in a forward without grad mode have no backward to wait for.
  if (is_root() && !at::GradMode::is_enabled())
    for (Group* g : context_->groups())
      if (g->gathers_on_use() && g->training_state() == TrainingState::kIdle) g->reshard();
  const bool top_level_ends =
      state_before_forward_ == TrainingState::kIdle && !context_->in_forward();
  if (top_level_ends)
    for (Group* g : context_->groups())
      if (g->is_list() && g->training_state() == TrainingState::kIdle &&
          g->shard_state() != ShardState::kSharded && g->resolved_reshard_after_forward())
        g->reshard_after_forward();
  // The ranks' calls may have differed: serve the others' gathers until every rank is done.
  if (top_level_ends && !in_backward()) context_->calls().end_top_level(*this);
  // Every forward of the root ends by checking that the ranks gathered the same groups, before a
  // backward could reduce into the wrong ones (core/agreement.h).
  if (is_root() && state_before_forward_ == TrainingState::kIdle) context_->check_agreement();
  // A top-level call ends its epoch: user code (an optimizer step) may follow.
  if (top_level_ends) context_->end_epoch();
}

// [Note: calls that differ between ranks] Forward all-gathers, this group's and its prefetches,
// are issued in a round agreed with the other ranks; in a backward (no rounds there), directly.
void Group::gather_for_call() {
  if (in_backward()) return unshard();
  context_->calls().gather_for_call(*this);
}

void Group::reshard_after_forward() {
  // hpZ: a backward will gather it again, within the post-forward lane, from what stays here.
  if (at::GradMode::is_enabled()) keep_chunk();
  release_full();
}

bool Group::gather_on_use() {
  if (!on_use_ || !context_->in_forward()) return false;
  // Inside the root's forward: gathered at first use, agreed with the other ranks like a call.
  context_->on_pre_forward(this);
  gather_for_call();
  wait_for_unshard();
  if (at::GradMode::is_enabled()) forwarded_with_grad_ = true;
  context_->on_post_forward(this);
  return true;
}

void Group::abort_forward() noexcept {
  call_inputs_.clear();
  try {
    if (training_state_ == TrainingState::kForward)
      transition(state_before_forward_, {TrainingState::kForward});
    reshard();
    context_->cancel_forward_prefetches();
    context_->calls().abandon();
  } catch (const std::exception& e) {
    // The forward's own error is on its way out: this one is only reported.
    TORCH_WARN("fsdp: while unwinding the failed forward of '", name_, "': ", e.what());
  }
}

at::Tensor Group::wrap_input(const at::Tensor& input) {
  const auto& mp = options_.mixed_precision;
  const bool cast = mp.cast_forward_inputs && mp.param_dtype && input.defined() &&
                    input.is_floating_point() && input.scalar_type() != *mp.param_dtype;
  const at::Tensor x = cast ? input.to(*mp.param_dtype) : input;
  if (!x.defined() || !x.requires_grad() || !at::GradMode::is_enabled()) return x;
  // The same tensor passed twice is one tensor inside forward too: an in-place change through
  // one argument is seen through the other, with its history.
  for (const auto& w : call_inputs_)
    if (w.outer.unsafeGetTensorImpl() == x.unsafeGetTensorImpl()) return w.inner;
  if (x.is_view()) {
    auto out = InputViewBackward::apply(c10::make_intrusive<GroupRef>(weak_from_this()), x);
    input_nodes_.push_back(out.grad_fn());
    return out;
  }
  auto node = compat::make_node<InputBackward>(weak_from_this());
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

void Group::broadcast_buffers_to_all() {
  // DDP's broadcast_buffers: rank 0's buffers (e.g. BatchNorm running statistics) on every rank,
  // before each forward of the root. Under HSDP, within the replica, then across replicas.
  broadcast_buffers(*module_, *comm_);
  if (context_->replicate()) broadcast_buffers(*module_, *context_->replicate());
}

at::Tensor Group::cast_output(const at::Tensor& y) const {
  const auto& to = options_.mixed_precision.output_dtype;
  if (!to || !y.defined() || !y.is_floating_point() || y.scalar_type() == *to) return y;
  return y.to(*to);
}

}  // namespace fsdp::detail
