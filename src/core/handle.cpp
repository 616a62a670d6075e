// The front ends of a sharded module: FSDPModule (the handle fully_shard returns) and ForwardScope
// (what Sharded<T>::operator() opens around a call).
#include <fsdp/fully_shard.h>
#include <torch/nn/module.h>

#include <set>
#include <utility>

#include "core/context.h"
#include "core/finalize_backward.h"
#include "core/group.h"

namespace fsdp {
namespace detail {

namespace {
// The groups at or below `g`'s module, in the context's registration order.
std::vector<Group*> groups_at_or_below(Group* g) {
  std::set<const torch::nn::Module*> below{g->module()};
  for (const auto& m : g->module()->modules(/*include_self=*/false)) below.insert(m.get());
  for (const auto* m : g->members()) below.insert(m);
  std::vector<Group*> out;
  for (Group* x : g->context().groups())
    if (x == g || x->inside(below)) out.push_back(x);
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ForwardScope
// ---------------------------------------------------------------------------------------------
ForwardScope::ForwardScope(Group* group) : group_(group) { group_->pre_forward(); }

ForwardScope::~ForwardScope() {
  if (!finished_) group_->abort_forward();
}

void ForwardScope::finish_tensors(const std::vector<at::Tensor>& outs) {
  group_->post_forward(outs);
  finished_ = true;
}

at::Tensor ForwardScope::input(const at::Tensor& x) { return group_->wrap_input(x); }

at::Tensor ForwardScope::output(const at::Tensor& y) { return group_->cast_output(y); }

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// FSDPModule
// ---------------------------------------------------------------------------------------------
namespace {
detail::Group& checked(const std::shared_ptr<detail::Group>& g) {
  FSDP_CHECK(g != nullptr, "this FSDPModule handle is empty: use the one fully_shard returned");
  return *g;
}
}  // namespace

std::vector<ShardInfo> FSDPModule::shards() const {
  auto& g = checked(group_);
  std::unordered_map<const c10::TensorImpl*, const detail::ParamState*> by_impl;
  std::set<const c10::TensorImpl*> ignored;
  for (detail::Group* x : detail::groups_at_or_below(&g)) {
    for (const auto& p : x->params()) by_impl[p.param().unsafeGetTensorImpl()] = &p;
    for (const auto& t : x->ignored()) ignored.insert(t.unsafeGetTensorImpl());
  }
  std::vector<ShardInfo> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : g.module()->named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    if (ignored.count(impl) && seen.insert(impl).second) {
      ShardInfo s;
      s.name = item.key();
      s.global_shape = item.value().sizes().vec();
      s.shard = item.value();
      s.rows_per_rank = item.value().dim() == 0 ? 1 : item.value().size(0);
      s.requires_grad = item.value().requires_grad();
      s.ignored = true;
      out.push_back(std::move(s));
      continue;
    }
    auto it = by_impl.find(impl);
    if (it == by_impl.end() || !seen.insert(impl).second) continue;
    const auto& p = *it->second;
    ShardInfo s;
    s.name = item.key();
    s.global_shape = p.param().sizes().vec();
    s.shard = p.shard();
    s.dim = p.dim();
    s.row_offset = p.row_offset();
    s.rows_per_rank = p.chunk();
    s.requires_grad = p.trainable();
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
  auto& g = checked(group_);
  g.context().calls().explicit_unshard(g);
  if (async_op) return UnshardHandle(group_);
  g.wait_for_unshard();
  g.context().end_epoch();  // user code follows
  return UnshardHandle();
}

void UnshardHandle::wait() {
  if (!group_) return;
  auto g = std::exchange(group_, nullptr);
  // Resharded since, or already waited (by the module's forward): nothing in flight.
  if (g->shard_state() != detail::ShardState::kGathering) return;
  g->wait_for_unshard();
  g->context().end_epoch();  // user code follows
}

void FSDPModule::reshard() { checked(group_).reshard(); }

void FSDPModule::finalize_backward() {
  detail::Group& g = checked(group_);
  FSDP_CHECK(g.is_root(), "finalize_backward on '", g.name(),
             "': it reduces every group of the model; call it on the root's handle");
  detail::finalize_backward(g.context());
}

void FSDPModule::set_requires_gradient_sync(bool sync) {
  for (auto* g : detail::groups_at_or_below(&checked(group_))) g->set_requires_gradient_sync(sync);
}

void FSDPModule::set_reshard_after_backward(bool reshard) {
  for (auto* g : detail::groups_at_or_below(&checked(group_)))
    g->set_reshard_after_backward(reshard);
}

void FSDPModule::set_reshard_after_forward(bool reshard) {
  checked(group_).set_reshard_after_forward(reshard);
}

void FSDPModule::set_gradient_divide_factor(double factor) {
  checked(group_).set_gradient_divide_factor(factor);
}

void FSDPModule::set_custom_all_gather(std::shared_ptr<AllGather> comm) {
  checked(group_).set_custom_all_gather(std::move(comm));
}

void FSDPModule::set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm) {
  checked(group_).set_custom_reduce_scatter(std::move(comm));
}

void FSDPModule::set_all_reduce_hook(std::function<void(at::Tensor&)> hook) {
  checked(group_).set_all_reduce_hook(std::move(hook));
}

void FSDPModule::set_keep_unsharded_storage(bool keep) {
  checked(group_).set_keep_unsharded_storage(keep);
}

void FSDPModule::set_unshard_in_backward(bool unshard) {
  checked(group_).set_unshard_in_backward(unshard);
}

void FSDPModule::set_requires_all_reduce(bool all_reduce) {
  for (auto* g : detail::groups_at_or_below(&checked(group_)))
    g->set_requires_all_reduce(all_reduce);
}

void FSDPModule::set_reduce_scatter_unused_params(bool reduce_scatter_unused_params,
                                                  bool recurse) {
  if (!recurse) return checked(group_).set_reduce_scatter_unused_params(reduce_scatter_unused_params);
  for (auto* g : detail::groups_at_or_below(&checked(group_)))
    g->set_reduce_scatter_unused_params(reduce_scatter_unused_params);
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  std::vector<detail::Group*> targets;
  for (auto& m : modules) targets.push_back(&checked(m.group_));
  checked(group_).set_forward_prefetch(std::move(targets));
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  std::vector<detail::Group*> targets;
  for (auto& m : modules) targets.push_back(&checked(m.group_));
  checked(group_).set_backward_prefetch(std::move(targets));
}

FSDPModule::MemoryStats FSDPModule::memory_stats() const {
  auto& c = checked(group_).context();
  MemoryStats s;
  s.unsharded_bytes = c.unsharded_bytes();
  s.peak_unsharded_bytes = c.peak_unsharded_bytes();
  s.unsharded_groups = c.unsharded_groups();
  s.peak_unsharded_groups = c.peak_unsharded_groups();
  s.buffer_bytes_in_use = c.pool().in_use_bytes();
  s.buffer_bytes_idle = c.pool().idle_bytes();
  s.peak_buffer_bytes_in_use = c.pool().peak_in_use_bytes();
  s.post_forward_bytes = c.chunk_bytes();
  s.peak_post_forward_bytes = c.peak_chunk_bytes();
  return s;
}

void FSDPModule::reset_memory_peaks() { checked(group_).context().reset_peaks(); }

const std::string& FSDPModule::name() const { return checked(group_).name(); }

Communicator& FSDPModule::communicator() const { return checked(group_).comm(); }

const std::shared_ptr<Communicator>& FSDPModule::replicate_communicator() const {
  return checked(group_).context().replicate();
}

}  // namespace fsdp
