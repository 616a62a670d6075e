#include "core/group.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>
#include <torch/csrc/autograd/custom_function.h>

#include "compat.h"

namespace fsdp::detail {

const char* to_string(ShardState s) {
  switch (s) {
    case ShardState::kSharded:
      return "SHARDED";
    case ShardState::kGathering:
      return "GATHERING";
    case ShardState::kUnsharded:
      return "UNSHARDED";
  }
  return "?";
}

namespace {

// AccumulateGrad post hook: the parameter's gradient for this backward is final.
struct GradReadyHook : torch::autograd::FunctionPostHook {
  GradReadyHook(std::weak_ptr<Group> g, size_t i) : group(std::move(g)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto g = group.lock()) g->on_grad_ready(index);
    return outputs;
  }
  std::weak_ptr<Group> group;
  size_t index;
};

// Carries the group through the autograd context of InputBackward.
struct GroupRef : torch::CustomClassHolder {
  explicit GroupRef(std::weak_ptr<Group> g) : group(std::move(g)) {}
  std::weak_ptr<Group> group;
};

// Identity on a forward call's input; its backward runs once everything between this call's
// output and its input has run. Used for resharding after backward, never to trigger reduction.
struct InputBackward : torch::autograd::Function<InputBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, c10::intrusive_ptr<GroupRef> g,
                            const at::Tensor& x) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(g));
    ctx->set_materialize_grads(false);
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* ref = static_cast<GroupRef*>(ctx->saved_data["group"].toCapsule().get());
    if (auto g = ref->group.lock()) g->on_input_backward();
    return {at::Tensor(), grads[0]};
  }
};

}  // namespace

Group::Group(torch::nn::Module* module, std::string type_name, std::vector<ParamState> params,
             std::shared_ptr<Communicator> comm, ShardOptions options)
    : module_(module),
      type_name_(std::move(type_name)),
      name_(type_name_),
      params_(std::move(params)),
      comm_(std::move(comm)),
      options_(options) {
  for (auto& p : params_) {
    offsets_.push_back(flat_numel_);
    flat_numel_ += p.padded_numel();
    p.free_full();
  }
}

Group::~Group() {
  for (auto& p : params_)
    if (p.accumulator() && p.hook_key()) p.accumulator()->del_post_hook(p.hook_key());
  if (context_) context_->remove(this);
}

bool Group::is_root() const { return context_ && context_->root() == this; }

bool Group::has_trainable() const {
  for (const auto& p : params_)
    if (p.trainable()) return true;
  return false;
}

int64_t Group::full_bytes() const {
  int64_t b = 0;
  for (const auto& p : params_) b += p.full_bytes();
  return b;
}

bool Group::resolved_reshard_after_forward() const {
  return options_.reshard_after_forward.value_or(!is_root());
}

// Installs the AccumulateGrad hooks; called once the group is owned by a shared_ptr.
void install_grad_hooks(const std::shared_ptr<Group>& g) {
  for (size_t i = 0; i < g->params().size(); ++i) {
    auto& p = g->params()[i];
    if (!p.accumulator()) continue;
    p.set_hook_key(p.accumulator()->add_post_hook(std::make_unique<GradReadyHook>(g, i)));
  }
}

// ---------------------------------------------------------------------------------------------
// Storage
// ---------------------------------------------------------------------------------------------
void Group::unshard() {
  if (state_ != ShardState::kSharded) return;
  auto& lane = context_->gather_lane();
  auto& pool = context_->pool();
  const auto dtype = params_.empty() ? at::kFloat : params_[0].shard().scalar_type();
  gather_in_ = pool.acquire(flat_numel_, dtype);
  for (size_t i = 0; i < params_.size(); ++i)
    params_[i].copy_in_shard(gather_in_.narrow(0, offsets_[i], params_[i].padded_numel()));
  gather_out_ = pool.acquire(lane.size() * flat_numel_, dtype);
  gather_work_ = lane.all_gather(gather_out_, gather_in_);
  state_ = ShardState::kGathering;
  context_->on_unsharded(this);  // the gather buffer is as large as the gathered parameters
  context_->log(this, "unshard: all-gather issued (SHARDED->GATHERING)");
}

void Group::wait_for_unshard() {
  if (state_ == ShardState::kSharded) unshard();
  if (state_ != ShardState::kGathering) return;
  gather_work_.wait();
  gather_work_ = Work();
  auto rows = gather_out_.view({context_->gather_lane().size(), flat_numel_});
  for (size_t i = 0; i < params_.size(); ++i) params_[i].copy_out(rows, offsets_[i]);
  context_->pool().release(std::move(gather_out_));
  context_->pool().release(std::move(gather_in_));
  gather_out_ = gather_in_ = at::Tensor();
  state_ = ShardState::kUnsharded;
  context_->log(this, "wait_for_unshard: GATHERING->UNSHARDED");
}

void Group::reshard() {
  if (state_ == ShardState::kGathering) wait_for_unshard();
  if (state_ != ShardState::kUnsharded) return;
  for (auto& p : params_) p.free_full();
  state_ = ShardState::kSharded;
  context_->on_resharded(this);
  context_->log(this, "reshard: UNSHARDED->SHARDED");
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------
void Group::pre_forward() {
  context_->on_pre_forward(this);
  unshard();
  context_->prefetch_forward(this);
  wait_for_unshard();
  forward_start_us = trace::enabled() ? trace::now_us() : -1;
}

void Group::post_forward(const std::vector<at::Tensor>& outs) {
  if (forward_start_us >= 0)
    trace::complete("forward " + name_, "compute", forward_start_us,
                    trace::now_us() - forward_start_us);
  std::weak_ptr<Group> self = weak_from_this();
  for (const auto& out : outs) {
    if (!out.defined() || !out.requires_grad()) continue;
    out.register_hook([self](const at::Tensor&) {
      if (auto g = self.lock()) g->pre_backward();
    });
  }
  if (resolved_reshard_after_forward()) reshard();
}

at::Tensor Group::wrap_input(const at::Tensor& x) {
  if (!x.defined() || !x.requires_grad() || !at::GradMode::is_enabled()) return x;
  auto out = InputBackward::apply(c10::make_intrusive<GroupRef>(weak_from_this()), x);
  input_nodes.push_back(out.grad_fn());
  return out;
}

void Group::pre_backward() { context_->on_pre_backward(this); }
void Group::on_grad_ready(size_t i) { context_->on_grad_ready(this, i); }
void Group::on_input_backward() { context_->on_input_backward(this); }

// ---------------------------------------------------------------------------------------------
// Reduction
// ---------------------------------------------------------------------------------------------
PendingReduce Group::issue_reduce_scatter() {
  auto& lane = context_->reduce_lane();
  auto& pool = context_->pool();
  at::ScalarType dtype = at::kFloat;
  for (auto& p : params_)
    if (p.trainable()) dtype = p.shard().scalar_type();
  PendingReduce p;
  p.group = this;
  p.send = pool.acquire(lane.size() * flat_numel_, dtype).view({lane.size(), flat_numel_});
  for (size_t i = 0; i < params_.size(); ++i) params_[i].pack_grad(p.send, offsets_[i]);
  p.scratch = pool.acquire(lane.size() * flat_numel_, dtype);
  p.output = at::empty({flat_numel_}, p.send.options());
  p.work = lane.reduce_scatter(p.output, p.send, ReduceOp::kAvg, p.scratch);
  return p;
}

void Group::finish_reduce(PendingReduce& p) {
  p.work.wait();
  p.work = Work();
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].trainable()) params_[i].add_shard_grad(p.output, offsets_[i]);
  context_->pool().release(p.send.view({-1}));
  context_->pool().release(std::move(p.scratch));
  p.output = p.send = p.scratch = at::Tensor();
}

at::Tensor BufferPool::acquire(int64_t numel, at::ScalarType dtype) {
  auto& idle = idle_[{numel, static_cast<int>(dtype)}];
  if (idle.empty()) return at::empty({numel}, at::TensorOptions().dtype(dtype));
  at::Tensor t = std::move(idle.back());
  idle.pop_back();
  return t;
}

void BufferPool::release(at::Tensor t) {
  if (!t.defined()) return;
  auto& idle = idle_[{t.numel(), static_cast<int>(t.scalar_type())}];
  if (idle.size() < kPerSize) idle.push_back(std::move(t));
}

}  // namespace fsdp::detail
