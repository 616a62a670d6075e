// Group: its part of a backward (state, resharding) and the reduction of its gradients.
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>

#include "core/copies.h"
#include "core/group.h"

namespace fsdp::detail {

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------
void Group::begin_backward_use() {
  transition(TrainingState::kPreBackward,
             {TrainingState::kIdle, TrainingState::kPreBackward, TrainingState::kPostBackward});
  if (backward_start_us_ < 0 && trace::enabled()) backward_start_us_ = trace::now_us();
}

void Group::post_backward() {
  transition(TrainingState::kPostBackward,
             {TrainingState::kIdle, TrainingState::kPreBackward, TrainingState::kPostBackward});
  end_backward_span();
  // [Note: resharding during backward] Its own hooks, gradients and input-side nodes bound every
  // node that reads a group's parameters only when the nodes between its outputs and inputs are
  // its own. An element has no output hook or input-side node of its own. A group whose module
  // contains other sharded modules has nodes that read its parameters (a frozen weight applied
  // to a child's output, say) and lead to the children's gradients, not to its own inputs or
  // gradients: they may run after every event of its own. So may the nodes of a group whose
  // modules hold trainable parameters it does not manage, ignored by it or by another group (a
  // frozen weight applied to a value made from them leads only to their gradients, which no event
  // of the group's tracks). For all three, only the final callback is known to come after all
  // such nodes.
  if (reshard_after_backward_ && !on_use_ && !contains_groups_ && !holds_trainable_unmanaged())
    reshard();
}

bool Group::holds_trainable_unmanaged() const {
  return std::any_of(unmanaged_.begin(), unmanaged_.end(),
                     [](const at::Tensor& t) { return t.requires_grad(); });
}

void Group::finalize_backward() {
  end_backward_span();
  if (handed_send_.defined()) drop_handed_over();  // the backward failed before this reduction
  // Gradients the pass did not see arrive (not expected from the engine's plan) are kept too.
  for (size_t i = 0; i < params_.size(); ++i) keep_unsynced_grad(i);
  for (auto& p : params_) p.end_backward();
  if (training_state_ != TrainingState::kForward)
    transition(TrainingState::kIdle,
               {TrainingState::kIdle, TrainingState::kPreBackward, TrainingState::kPostBackward});
  gather_from_chunk_ = false;
  drop_chunk();  // [Note: resharding to a smaller world after forward]: not kept past a backward
  if (reshard_after_backward_) reshard();
}

void Group::end_backward_span() {
  if (backward_start_us_ < 0) return;
  trace::complete("backward " + name_, "compute", backward_start_us_,
                  trace::now_us() - backward_start_us_);
  backward_start_us_ = -1;
}

// ---------------------------------------------------------------------------------------------
// Reduction
// ---------------------------------------------------------------------------------------------
at::Tensor Group::acquire_send() {
  const int64_t world = ctx_->reduce.size();
  return ctx_->pool.acquire(world * layout_.flat_numel, reduce_dtype_, layout_.device)
      .view({world, layout_.flat_numel});
}

void Group::hand_over_grad(size_t i) {
  if (reduce_scatter_unused_params_) params_[i].mark_contributed();
  if (reduces_locally()) {
    params_[i].move_grad_to_shard(reduce_dtype_, divide_factor_);
    wrote_shard_grads_ = true;
    return;
  }
  if (!handed_send_.defined()) {
    handed_send_ = acquire_send();
    handed_.assign(params_.size(), false);
  }
  auto span = copy_span("pack ");
  pack_grad(layout_, params_, i, handed_send_);
  handed_[i] = true;
}

PendingReduce Group::issue_reduce_scatter() {
  PendingReduce p;
  if (reduce_scatter_unused_params_)
    for (auto& param : params_) param.mark_contributed();
  if (reduces_locally()) {
    for (auto& param : params_) param.move_grad_to_shard(reduce_dtype_, divide_factor_);
    wrote_shard_grads_ = true;
    return p;
  }
  // The gradients handed over are packed already; the rest (zeros when missing) now.
  const bool handed = handed_send_.defined();
  p.send = handed ? std::move(handed_send_) : acquire_send();
  handed_send_ = at::Tensor();
  {
    auto span = copy_span("pack ");
    for (size_t i = 0; i < params_.size(); ++i)
      if (!handed || !handed_[i]) pack_grad(layout_, params_, i, p.send);
  }
  handed_.clear();
  // In place: the reduced rows land in this rank's own row of the send buffer.
  Lane& lane = ctx_->reduce;
  p.output = p.send.view({-1}).narrow(0, lane.rank() * layout_.flat_numel, layout_.flat_numel);
  p.all_reduce = all_reduces();
  p.divide_by = divide_factor_;
  const ReduceOp op = p.divide_by ? ReduceOp::kSum : ReduceOp::kAvg;
  const Collective c{index_, layout_.flat_numel, ctx_->replicate_reduce && !p.all_reduce};
  p.work = lane.reduce_scatter(c, p.output, p.send.view({-1}), op, custom_reduce_.get());
  return p;
}

void Group::drop_handed_over() {
  ctx_->pool.release(std::move(handed_send_));
  handed_send_ = at::Tensor();
  handed_.clear();
}

bool Group::poll_reduce(PendingReduce& p) {
  if (!p.output.defined()) return true;  // reduced locally
  if (!p.replicating) {
    if (!p.work.is_completed()) return false;
    if (!p.all_reduce) return true;
    start_replicate(p);
  }
  return p.replicate_work.is_completed();
}

void Group::start_replicate(PendingReduce& p) {
  p.work.wait();
  p.work = Work();
  if (partial_reduce_.defined()) {  // the blocks set aside since the last all-reduce
    p.output.add_(partial_reduce_);
    partial_reduce_ = at::Tensor();
  }
  p.replicate_work =
      ctx_->replicate_reduce->all_reduce(p.output, p.divide_by ? ReduceOp::kSum : ReduceOp::kAvg);
  p.replicating = true;
}

void Group::keep_partial(PendingReduce& p) {
  if (partial_reduce_.defined())
    partial_reduce_.add_(p.output);
  else
    partial_reduce_ = p.output.clone();
  ctx_->pool.release(p.send.view({-1}));
  p.output = p.send = at::Tensor();
}

void Group::finish_reduce(PendingReduce& p) {
  if (!p.output.defined()) return;  // reduced locally (one rank): nothing was exchanged
  if (!p.replicating && p.all_reduce) {
    start_replicate(p);
  } else if (!p.replicating) {
    p.work.wait();
    p.work = Work();
  }
  if (p.replicating) p.replicate_work.wait();
  p.replicate_work = Work();
  if (ctx_->replicate_reduce && !p.all_reduce) return keep_partial(p);
  if (p.divide_by) p.output.div_(*p.divide_by);
  if (hook_) hook_(p.output);
  {
    auto span = copy_span("copy-out ");
    add_reduced(layout_, params_, p.output);
  }
  wrote_shard_grads_ = true;
  ctx_->pool.release(p.send.view({-1}));
  p.output = p.send = at::Tensor();
}

bool Group::holds_gradients() const {
  if (reduce_scatter_unused_params_ && has_trainable()) return true;
  if (partial_reduce_.defined()) return true;
  return std::any_of(params_.begin(), params_.end(), [](const ParamState& p) {
    return p.holds_unsharded_grad() || p.holds_accumulated_grad();
  });
}

void Group::settle_shard_grads(const std::vector<bool>& any_rank) {
  if (!wrote_shard_grads_) return;
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].trainable()) params_[i].settle_shard_grad(any_rank.at(i));
  wrote_shard_grads_ = false;
}

}  // namespace fsdp::detail
