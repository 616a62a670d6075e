// Group: construction, identity, settings and its state machines.
#include "core/group.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <set>

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

Group::Group(torch::nn::Module* module, std::string type_name, std::vector<ParamState> params,
             std::shared_ptr<Communicator> comm, ShardOptions options,
             std::vector<std::shared_ptr<GatherTransform>> transforms)
    : module_(module),
      members_{module},
      type_name_(std::move(type_name)),
      name_(type_name_),
      params_(std::move(params)),
      comm_(std::move(comm)),
      options_(std::move(options)),
      layout_(GroupLayout::of(params_, comm_->size(), comm_->rank(), std::move(transforms))) {
  reduce_dtype_ = layout_.shard_dtype;
  bool same_dtype = !params_.empty() && !layout_.transformed;
  for (auto& p : params_)
    same_dtype = same_dtype && p.shard().scalar_type() == layout_.gather_dtype;
  if (same_dtype) {
    // Offloaded shards (CPUOffloadPolicy, parameters off the CPU) stay in host memory.
    const at::Device shard_device = params_[0].shard().device();
    const bool pin = shard_device != layout_.device && options_.offload_policy->pin_memory;
    flat_shard_ = at::zeros(
        {layout_.flat_numel},
        at::TensorOptions().dtype(layout_.gather_dtype).device(shard_device).pinned_memory(pin));
    for (size_t i = 0; i < params_.size(); ++i)
      params_[i].place_shard_in(
          flat_shard_.narrow(0, layout_.places[i].flat_offset, params_[i].padded_numel()));
  }
  // Unset: the parameters' own dtype, whatever param_dtype computes in (torch 2.15's FSDP2).
  if (options_.mixed_precision.reduce_dtype) reduce_dtype_ = *options_.mixed_precision.reduce_dtype;
  calls_may_differ_ = options_.runtime.calls_may_differ;
}

Group::~Group() {
  // The hooks' bindings are gone with the model: remove what this group's parameters carry.
  for (auto& p : params_) {
    if (p.accumulator() && p.hook_key()) p.accumulator()->del_post_hook(p.hook_key());
    guard::forget(p.param());
    if (p.moved_grad_marker().defined()) guard::forget_marker(p.moved_grad_marker());
  }
}

void Group::place(CommContext* ctx, int index, bool is_root, bool contains_groups) {
  ctx_ = ctx;
  index_ = index;
  is_root_ = is_root;
  contains_groups_ = contains_groups_ || contains_groups;
  std::set<const c10::TensorImpl*> mine;
  for (const auto& p : params_) mine.insert(p.param().unsafeGetTensorImpl());
  unmanaged_.clear();
  for (const auto* m : members_)
    for (const auto& t : m->parameters(/*recurse=*/true))
      if (mine.insert(t.unsafeGetTensorImpl()).second) unmanaged_.push_back(t);
}

void Group::log(const std::string& event) const {
  if (ctx_) ctx_->log(name_, event);
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
  return std::any_of(members_.begin(), members_.end(),
                     [&](const torch::nn::Module* m) { return modules.count(m) > 0; });
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

bool Group::has_trainable() const {
  return std::any_of(params_.begin(), params_.end(),
                     [](const ParamState& p) { return p.trainable(); });
}

int64_t Group::full_bytes() const {
  int64_t b = 0;
  for (const auto& p : params_) b += p.full_bytes();
  return b;
}

// ---------------------------------------------------------------------------------------------
// Deferred initialisation
// ---------------------------------------------------------------------------------------------
void Group::materialize_param(size_t i, const at::Tensor& full) {
  FSDP_CHECK(shard_state_ == ShardState::kSharded, "materialize: sharded module '", name_,
             "' is gathered; materialize before the first forward");
  params_[i].materialize(full);
}

bool Group::materialized() const {
  return std::all_of(params_.begin(), params_.end(),
                     [](const ParamState& p) { return p.materialized(); });
}

void Group::check_materialized() const {
  FSDP_CHECK(materialized(), "sharded module '", name_, "' (", type_name_,
             ") was built under fsdp::deferred_init and has no values yet. Fix: call "
             "fsdp::materialize(model) after fully_shard and before the first forward (or "
             "unshard, state dict or checkpoint save)");
}

// ---------------------------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------------------------
bool Group::resolved_reshard_after_forward() const {
  if (on_use_) return false;  // its forward's end is not observable (gathers_on_use)
  if (!options_.reshard_after_forward) return !is_root_;
  return options_.reshard_after_forward->world() != 1;  // true, or a smaller world (hpZ)
}

void Group::set_reshard_after_forward(bool v) {
  FSDP_CHECK(!on_use_ || !v, "set_reshard_after_forward(true) on '", name_, "' (", type_name_,
             "): an element sharded by fully_shard_elements stays gathered from the start of the "
             "root's forward to the end of backward, because nothing marks the end of its "
             "forward. To reshard after forward, declare the block fsdp::Sharded<...> and call it "
             "through the holder");
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
  FSDP_CHECK(v || !options_.runtime.activation_checkpointing, "set_unshard_in_backward(false) on '",
             name_, "' (", type_name_,
             "): the module checkpoints its activations, so its backward runs its forward again "
             "and needs its parameters gathered. Fix: leave unshard_in_backward on, or turn "
             "RuntimeOptions::activation_checkpointing off for this module");
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

void Group::forget(const Group* g) {
  for (auto* v : {&forward_prefetch_, &backward_prefetch_})
    v->erase(std::remove(v->begin(), v->end(), g), v->end());
}

bool Group::all_reduces() const { return ctx_ && ctx_->replicate_reduce && requires_all_reduce_; }

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

std::optional<trace::Span> Group::copy_span(const char* what) const {
  if (!trace::enabled()) return std::nullopt;
  return std::optional<trace::Span>(std::in_place, what + name_, "copy");
}

}  // namespace fsdp::detail
