#include "core/group.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>
#include <iostream>

#include "comm/communicator_impl.h"
#include "core/backward_pass.h"
#include "core/buffers.h"
#include "core/context.h"
#include "core/guard.h"

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

const char* to_string(TrainingState s) {
  switch (s) {
    case TrainingState::kIdle:
      return "IDLE";
    case TrainingState::kForward:
      return "FORWARD";
    case TrainingState::kPreBackward:
      return "PRE_BACKWARD";
    case TrainingState::kPostBackward:
      return "POST_BACKWARD";
  }
  return "?";
}

namespace {

// AccumulateGrad post hook: the parameter's gradient for this backward is final.
struct GradReadyHook : torch::autograd::FunctionPostHook {
  GradReadyHook(std::weak_ptr<Group> g, size_t i) : group(std::move(g)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto g = group.lock()) g->context().backward().on_grad_ready(*g, index);
    return outputs;
  }
  std::weak_ptr<Group> group;
  size_t index;
};

// AccumulateGrad pre hook: a moved-gradient marker left by the previous reduction goes before
// autograd accumulates into the full parameter again (also for a second backward over a retained
// graph, with no forward in between).
struct ClearMarkerHook : torch::autograd::FunctionPreHook {
  ClearMarkerHook(std::weak_ptr<Group> g, size_t i) : group(std::move(g)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (auto g = group.lock()) g->params()[index].clear_moved_grad();
    return grads;
  }
  std::weak_ptr<Group> group;
  size_t index;
};

}  // namespace

Group::Group(torch::nn::Module* module, std::string type_name, std::vector<ParamState> params,
             std::shared_ptr<Communicator> comm, ShardOptions options)
    : module_(module),
      members_{module},
      type_name_(std::move(type_name)),
      name_(type_name_),
      params_(std::move(params)),
      comm_(std::move(comm)),
      options_(options) {
  // The shards share one dtype (check_placement); the full parameters are already in their
  // compute dtypes: param_dtype, or their own where param_dtype_override_fn kept it. The gather and
  // the full block use the widest of these, each full parameter its own bytes in the block.
  if (!params_.empty()) {
    device_ = params_[0].param().device();
    gather_dtype_ = params_[0].param().scalar_type();
    reduce_dtype_ = params_[0].shard().scalar_type();
  }
  for (auto& p : params_) gather_dtype_ = at::promote_types(gather_dtype_, p.param().scalar_type());
  for (auto& p : params_) {
    offsets_.push_back(flat_numel_);
    flat_numel_ += p.padded_numel();
    gathers_into_places_ =
        gathers_into_places_ && p.dim() == 0 && p.param().scalar_type() == gather_dtype_;
  }
  size_t bytes = 0;
  for (auto& p : params_) {
    bytes = (bytes + 63) / 64 * 64;
    full_offsets_.push_back(bytes);
    bytes += static_cast<size_t>(p.full_bytes());
  }
  const auto elem = static_cast<size_t>(c10::elementSize(gather_dtype_));
  full_block_numel_ = static_cast<int64_t>((bytes + elem - 1) / elem);
  bool same_dtype = !params_.empty();
  for (auto& p : params_) same_dtype = same_dtype && p.shard().scalar_type() == gather_dtype_;
  if (same_dtype) {
    // Offloaded shards (CPUOffloadPolicy, parameters off the CPU) stay in host memory.
    const at::Device shard_device = params_[0].shard().device();
    const bool pin = shard_device != device_ && options_.offload_policy->pin_memory;
    flat_shard_ =
        at::zeros({flat_numel_},
                  at::TensorOptions().dtype(gather_dtype_).device(shard_device).pinned_memory(pin));
    for (size_t i = 0; i < params_.size(); ++i)
      params_[i].place_shard_in(flat_shard_.narrow(0, offsets_[i], params_[i].padded_numel()));
  }
  // Unset: the parameters' own dtype, whatever param_dtype computes in (torch 2.15's FSDP2).
  if (options_.mixed_precision.reduce_dtype) reduce_dtype_ = *options_.mixed_precision.reduce_dtype;
}

Group::~Group() {
  for (auto& p : params_) {
    if (p.accumulator() && p.hook_key()) p.accumulator()->del_post_hook(p.hook_key());
    guard::forget(p.param());
    if (p.moved_grad_marker().defined()) guard::forget_marker(p.moved_grad_marker());
  }
  if (context_) context_->remove(this);
}

void Group::attach_hooks() {
  std::weak_ptr<Group> self = weak_from_this();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    guard::watch(p.param(), self, i);
    p.free_full();
    if (!p.accumulator()) continue;
    p.set_moved_grad_marker(guard::moved_grad_marker(p.param(), self, i));
    p.accumulator()->add_pre_hook(std::make_unique<ClearMarkerHook>(self, i));
    p.set_hook_key(p.accumulator()->add_post_hook(std::make_unique<GradReadyHook>(self, i)));
  }
}

void Group::set_path(const std::string& path) {
  name_ = path.empty() ? "root" : path;
  prefix_ = path.empty() ? "" : path + ".";
}

void Group::set_members(std::shared_ptr<torch::nn::Module> container,
                        std::vector<torch::nn::Module*> members) {
  container_ = std::move(container);
  members_ = std::move(members);
  // Named "k.rest" by the container: member k, and the name within it.
  for (const auto& p : params_) {
    const size_t dot = p.name().find('.');
    member_names_.emplace_back(std::stoul(p.name().substr(0, dot)), p.name().substr(dot + 1));
  }
}

bool Group::inside(const std::set<const torch::nn::Module*>& modules) const {
  for (const auto* m : members_)
    if (modules.count(m)) return true;
  return false;
}

void Group::set_member_paths(const std::vector<std::string>& paths) {
  name_.clear();
  for (const auto& p : paths) name_ += (name_.empty() ? "" : "+") + p;
  prefix_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [k, name] = member_names_[i];
    params_[i].rename(paths.at(k).empty() ? name : paths.at(k) + "." + name);
  }
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
  if (on_use_) return false;  // its forward's end is not observable (gathers_on_use)
  if (!options_.reshard_after_forward) return !is_root();
  return options_.reshard_after_forward->world() != 1;  // true, or a smaller world (hpZ)
}

void Group::set_reshard_after_forward(bool v) {
  FSDP_CHECK(!on_use_ || !v, "set_reshard_after_forward(true) on '", name_, "' (", type_name_,
             "): an element sharded by fully_shard_elements stays gathered from its first use in "
             "forward to the end of backward, because nothing marks the end of its forward. To "
             "reshard after forward, declare the block fsdp::Sharded<...> and call it through "
             "the holder");
  options_.reshard_after_forward = v;
}

void Group::set_gradient_divide_factor(double factor) {
  FSDP_CHECK(std::isfinite(factor) && factor > 0, "set_gradient_divide_factor(", factor, ") on '",
             name_, "' (", type_name_,
             "): the factor divides the sum of the ranks' gradients, so it must be positive and "
             "finite (the default, the mean, divides by the number of data-parallel ranks)");
  divide_factor_ = factor;
}

void Group::set_unshard_in_backward(bool v) {
  FSDP_CHECK(v || !options_.activation_checkpointing, "set_unshard_in_backward(false) on '", name_,
             "' (", type_name_,
             "): the module checkpoints its activations, so its backward runs its forward again "
             "and needs its parameters gathered. Fix: leave unshard_in_backward on, or turn "
             "ShardOptions::activation_checkpointing off for this module");
  unshard_in_backward_ = v;
}

void Group::set_forward_prefetch(std::vector<Group*> g) {
  forward_prefetch_ = std::move(g);
  forward_prefetch_set_ = true;
}

void Group::set_backward_prefetch(std::vector<Group*> g) {
  backward_prefetch_ = std::move(g);
  backward_prefetch_set_ = true;
}

void Group::transition(TrainingState to, std::initializer_list<TrainingState> allowed) {
  for (TrainingState a : allowed)
    if (a == training_state_) {
      training_state_ = to;
      return;
    }
  throw Error(detail::cat("sharded module '", name_, "' (", type_name_, ") cannot go from ",
                          to_string(training_state_), " to ", to_string(to),
                          ". A sharded module's forward must not call itself, and backward must "
                          "not run inside its forward"));
}

}  // namespace fsdp::detail
