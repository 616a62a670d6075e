// The front ends of a sharded module: FSDPModule (the handle fully_shard returns), UnshardHandle,
// and ForwardScope (what Sharded<T> opens around a call). Each enters the binding's root.
#include <fsdp/fully_shard.h>
#include <torch/nn/module.h>

#include <set>
#include <unordered_map>
#include <utility>

#include "core/binding.h"
#include "core/explicit_collective.h"
#include "core/group.h"
#include "core/root.h"

namespace fsdp {
namespace detail {

FSDPModule HandleAccess::make(std::shared_ptr<Binding> b) { return FSDPModule(std::move(b)); }

// ---------------------------------------------------------------------------------------------
// ForwardScope
// ---------------------------------------------------------------------------------------------
ForwardScope::ForwardScope(std::shared_ptr<Binding> binding) : binding_(std::move(binding)) {
  binding_->root->pre_forward(*binding_->group);
}

ForwardScope::~ForwardScope() {
  if (!finished_) binding_->root->abort_forward(*binding_->group);
}

void ForwardScope::finish_tensors(const std::vector<at::Tensor>& outs) {
  binding_->root->post_forward(*binding_->group, outs, binding_);
  finished_ = true;
}

at::Tensor ForwardScope::input(const at::Tensor& x) {
  return binding_->root->input(*binding_->group, x, binding_);
}

at::Tensor ForwardScope::output(const at::Tensor& y) { return binding_->group->cast_output(y); }

bool ForwardScope::checkpointed() const {
  return binding_->group->options().runtime.activation_checkpointing;
}

std::vector<at::Tensor> ForwardScope::checkpoint_parameters() const {
  std::vector<at::Tensor> out;
  const Group& g = *binding_->group;
  for (const auto& p : g.params())
    if (p.trainable()) out.push_back(p.param());
  // ignored_params are the module's parameters too: the recompute's backward must reach them.
  for (const auto& t : g.ignored())
    if (t.requires_grad()) out.push_back(t);
  return out;
}

void ForwardScope::check_checkpointable(bool traversable, bool copyable) const {
  const Group& g = *binding_->group;
  FSDP_CHECK(traversable && copyable, "activation checkpointing on '", g.name(), "' (",
             g.type_name(), "): its forward takes or returns a type ",
             traversable ? "that cannot be copied" : "fsdp-cpp cannot look into for tensors",
             ", so the call cannot be replayed in backward. Checkpointed forwards take and return "
             "copyable at::Tensor, std::vector, std::tuple, std::pair, std::optional of these, "
             "and values holding no tensor; or switch activation_checkpointing off for it");
}

void reject_torch_save(const std::shared_ptr<Binding>& b) {
  const Group& group = *b->group;
  throw Error(cat(
      "torch::save was called on sharded module '", group.name(), "' (", group.type_name(),
      "): its full parameters hold no bytes outside its forward and backward (resharded), so the "
      "archive would hold empty tensors. Fix: to save for inference, write "
      "fsdp::full_state_dict(root) (every rank calls it) to a safetensors file on rank 0 (README, "
      "'Save for inference'); to resume training, use fsdp::checkpoint::save"));
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// FSDPModule
// ---------------------------------------------------------------------------------------------
namespace {
detail::Binding& checked(const std::shared_ptr<detail::Binding>& b) {
  FSDP_CHECK(b != nullptr, "this FSDPModule handle is empty: use the one fully_shard returned");
  return *b;
}

// The groups this handle's recursive settings reach.
std::vector<detail::Group*> at_or_below(const std::shared_ptr<detail::Binding>& b) {
  auto& bound = checked(b);
  return bound.root->at_or_below(*bound.group);
}
}  // namespace

std::vector<ShardInfo> FSDPModule::shards() const {
  const auto& g = *checked(binding_).group;
  std::unordered_map<const c10::TensorImpl*, const detail::ParamState*> by_impl;
  std::set<const c10::TensorImpl*> ignored;
  for (detail::Group* x : at_or_below(binding_)) {
    for (const auto& p : x->params()) by_impl[p.param().unsafeGetTensorImpl()] = &p;
    for (const auto& t : x->ignored()) ignored.insert(t.unsafeGetTensorImpl());
  }
  std::vector<ShardInfo> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : g.module()->named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    if (!seen.insert(impl).second) continue;
    ShardInfo s;
    s.name = item.key();
    if (ignored.count(impl)) {
      s.global_shape = item.value().sizes().vec();
      s.shard = item.value();
      s.rows_per_rank = item.value().dim() == 0 ? 1 : item.value().size(0);
      s.requires_grad = item.value().requires_grad();
      s.ignored = true;
    } else if (auto it = by_impl.find(impl); it != by_impl.end()) {
      const auto& p = *it->second;
      s.global_shape = p.param().sizes().vec();
      s.shard = p.shard();
      s.dim = p.dim();
      s.row_offset = p.row_offset();
      s.rows_per_rank = p.chunk();
      s.requires_grad = p.trainable();
    } else {
      continue;
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<at::Tensor> FSDPModule::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& s : shards()) out.push_back(s.shard);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPModule::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& s : shards()) out.emplace_back(s.name, s.shard);
  return out;
}

UnshardHandle FSDPModule::unshard(bool async_op) {
  auto& b = checked(binding_);
  b.root->unshard(*b.group, /*wait=*/!async_op);
  return async_op ? UnshardHandle(binding_) : UnshardHandle();
}

void UnshardHandle::wait() {
  if (!binding_) return;
  auto b = std::exchange(binding_, nullptr);
  b->root->wait_for_unshard(*b->group);
}

void FSDPModule::reshard() {
  auto& b = checked(binding_);
  b.root->reshard(*b.group);
}

void FSDPModule::finalize_backward() {
  auto& b = checked(binding_);
  FSDP_CHECK(b.group->is_root(), "finalize_backward on '", b.group->name(),
             "': it reduces every group of the model; call it on the root's handle");
  b.root->finalize_backward();
}

void FSDPModule::set_requires_gradient_sync(bool sync) {
  for (auto* g : at_or_below(binding_)) g->set_requires_gradient_sync(sync);
}

void FSDPModule::set_reshard_after_backward(bool reshard) {
  for (auto* g : at_or_below(binding_)) g->set_reshard_after_backward(reshard);
}

void FSDPModule::set_requires_all_reduce(bool all_reduce) {
  for (auto* g : at_or_below(binding_)) g->set_requires_all_reduce(all_reduce);
}

void FSDPModule::set_reduce_scatter_unused_params(bool unused, bool recurse) {
  if (!recurse) return checked(binding_).group->set_reduce_scatter_unused_params(unused);
  for (auto* g : at_or_below(binding_)) g->set_reduce_scatter_unused_params(unused);
}

void FSDPModule::set_calls_may_differ(bool may_differ) {
  checked(binding_).group->set_calls_may_differ(may_differ);
}

void FSDPModule::set_reshard_after_forward(bool reshard) {
  checked(binding_).group->set_reshard_after_forward(reshard);
}

void FSDPModule::set_gradient_divide_factor(double factor) {
  checked(binding_).group->set_gradient_divide_factor(factor);
}

void FSDPModule::set_unshard_in_backward(bool unshard) {
  checked(binding_).group->set_unshard_in_backward(unshard);
}

void FSDPModule::set_all_reduce_hook(std::function<void(at::Tensor&)> hook) {
  checked(binding_).group->set_all_reduce_hook(std::move(hook));
}

void FSDPModule::set_custom_all_gather(std::shared_ptr<AllGather> comm) {
  checked(binding_).group->set_custom_all_gather(std::move(comm));
}

void FSDPModule::set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm) {
  checked(binding_).group->set_custom_reduce_scatter(std::move(comm));
}

void FSDPModule::set_keep_unsharded_storage(bool keep) {
  checked(binding_).group->set_keep_unsharded_storage(keep);
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  std::vector<detail::Group*> targets;
  for (auto& m : modules) targets.push_back(checked(m.binding_).group.get());
  checked(binding_).group->set_forward_prefetch(std::move(targets));
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  std::vector<detail::Group*> targets;
  for (auto& m : modules) targets.push_back(checked(m.binding_).group.get());
  checked(binding_).group->set_backward_prefetch(std::move(targets));
}

FSDPModule::MemoryStats FSDPModule::memory_stats() const {
  const auto& ctx = checked(binding_).root->comm_context();
  MemoryStats s;
  s.unsharded_bytes = ctx.memory.bytes;
  s.peak_unsharded_bytes = ctx.memory.peak_bytes;
  s.unsharded_groups = ctx.memory.groups;
  s.peak_unsharded_groups = ctx.memory.peak_groups;
  s.buffer_bytes_in_use = ctx.pool.in_use_bytes();
  s.buffer_bytes_idle = ctx.pool.idle_bytes();
  s.peak_buffer_bytes_in_use = ctx.pool.peak_in_use_bytes();
  s.post_forward_bytes = ctx.memory.chunk_bytes;
  s.peak_post_forward_bytes = ctx.memory.peak_chunk_bytes;
  return s;
}

void FSDPModule::reset_memory_peaks() { checked(binding_).root->reset_peaks(); }

const std::string& FSDPModule::name() const { return checked(binding_).group->name(); }

Communicator& FSDPModule::communicator() const { return checked(binding_).group->comm(); }

const std::shared_ptr<Communicator>& FSDPModule::replicate_communicator() const {
  return checked(binding_).root->comm_context().replicate;
}

void FSDPModule::set_replicate_communicator(std::shared_ptr<Communicator> replicate) {
  checked(binding_).root->rebind_replicate(std::move(replicate));
}

}  // namespace fsdp

namespace fsdp::detail {

void agree_explicit_collective(const FSDPModule& module, protocol::Explicit what) {
  const auto& b = HandleAccess::binding(module);
  if (b) b->root->explicit_collective(what);
}

}  // namespace fsdp::detail
