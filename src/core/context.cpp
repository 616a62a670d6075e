#include "core/context.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>

#include "core/backward_pass.h"
#include "core/group.h"
#include "util/env.h"

namespace fsdp::detail {

Context::Context(std::shared_ptr<Communicator> comm, std::shared_ptr<Communicator> replicate,
                 bool audit)
    : comm_(std::move(comm)), replicate_(std::move(replicate)) {
  gather_lane_ = comm_->lane("fsdp.all_gather");
  reduce_lane_ = comm_->lane("fsdp.reduce_scatter");
  if (replicate_) replicate_lane_ = replicate_->lane("fsdp.replicate");
  debug_ = env_flag("FSDP_DEBUG");
  audit_.enabled = audit || env_flag("FSDP_AUDIT");
  agree_lane_ = comm_->lane("fsdp.agree");
  if (replicate_) replicate_agree_lane_ = replicate_->lane("fsdp.agree");
}

Context::~Context() = default;

int Context::index_of(const Group* g) const {
  auto it = std::find(groups_.begin(), groups_.end(), g);
  return it == groups_.end() ? -1 : static_cast<int>(it - groups_.begin());
}

void Context::add(Group* g) { groups_.push_back(g); }

void Context::remove(Group* g) {
  EntryLock lock(backward_.mutex());
  auto drop = [g](std::vector<Group*>& v) { v.erase(std::remove(v.begin(), v.end(), g), v.end()); };
  drop(groups_);
  drop(forward_order_);
  drop(last_forward_order_);
  drop(completion_order_);
}

void Context::log(const Group* g, const std::string& event) const {
  if (!debug_) return;
  std::cerr << "fsdp[rank " << comm_->rank() << "] group '" << (g ? g->name() : "-") << "' "
            << event << " | gathered " << unsharded_groups_ << " groups, " << unsharded_bytes_
            << " bytes; buffers " << pool_.in_use_bytes() << " in use, " << pool_.idle_bytes()
            << " idle\n";
}

void Context::on_reap_wait_expired(const Group& g, int waited_ms) {
  ++reap_wait_expiries_;
  log(&g, detail::cat("reduce-scatter still in flight after a bounded wait of ", waited_ms, " ms (",
                      reap_wait_expiries_, " of ", kMaxReapWaitExpiries, ")"));
  if (reap_wait_expiries_ == kMaxReapWaitExpiries)
    TORCH_WARN("fsdp[rank ", comm_->rank(), "]: reduce-scatters were still in flight after ",
               kMaxReapWaitExpiries, " bounded waits of ", waited_ms,
               " ms; backward no longer waits for them before packing the next group's "
               "gradients, so more send buffers may be held at once (memory, not results). A "
               "rank far slower than the others, or a slow reduce lane, does this.");
}

void Context::on_gather_issued(const Group* g) {
  unsharded_bytes_ += g->full_bytes();
  if (g != root()) ++unsharded_groups_;
  peak_unsharded_bytes_ = std::max(peak_unsharded_bytes_, unsharded_bytes_);
  peak_unsharded_groups_ = std::max(peak_unsharded_groups_, unsharded_groups_);
  agreement_.on_gather(index_of(g), g->flat_numel());
}

void Context::on_resharded(const Group* g) {
  unsharded_bytes_ -= g->full_bytes();
  if (g != root()) --unsharded_groups_;
}

void Context::end_epoch() {
  for (Group* g : groups_) g->fingerprint_if_gathered();
}

void Context::check_agreement() {
  agreement_.check(*agree_lane_, replicate_agree_lane_.get(), groups_);
}

std::vector<uint64_t> Context::check_agreement_and_settle() {
  auto any_rank =
      agreement_.check(*agree_lane_, replicate_agree_lane_.get(), groups_, contribution_bits());
  settle_shard_grads(any_rank);
  return any_rank;
}

std::vector<uint64_t> Context::contribution_bits() const {
  size_t n = 0;
  for (const Group* g : groups_) n += g->params().size();
  std::vector<uint64_t> bits((n + 63) / 64, 0);
  size_t i = 0;
  for (const Group* g : groups_)
    for (const auto& p : g->params()) {
      if (p.contributed()) bits[i / 64] |= uint64_t{1} << (i % 64);
      ++i;
    }
  return bits;
}

void Context::settle_shard_grads(const std::vector<uint64_t>& any_rank) {
  size_t i = 0;
  for (Group* g : groups_) {
    std::vector<bool> any;
    for (size_t k = 0; k < g->params().size(); ++k, ++i)
      any.push_back((any_rank.at(i / 64) >> (i % 64)) & 1);
    g->settle_shard_grads(any);
  }
}

void Context::check_all_reduce_settings() {
  if (replicate_agree_lane_)
    agreement_.check_all_reduce_settings(*agree_lane_, *replicate_agree_lane_, groups_);
}

void Context::reset_peaks() {
  peak_chunk_bytes_ = chunk_bytes_;
  peak_unsharded_bytes_ = unsharded_bytes_;
  peak_unsharded_groups_ = unsharded_groups_;
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------
bool Context::in_forward() const {
  for (const Group* g : groups_)
    if (g->training_state() == TrainingState::kForward) return true;
  return false;
}

void Context::on_pre_forward(Group* g) {
  EntryLock lock(backward_.mutex());
  const bool in_backward = torch::autograd::get_current_graph_task_nodes_in_graph() != nullptr;
  // A backward that threw: the engine skips final callbacks then, so its pass was never
  // finalised. Its key (the task's address) may be reused by the next task: drop it now.
  if (backward_.drop_unfinished()) {
    log(g, "dropped the bookkeeping of a backward that did not complete");
    backward_done_ = true;
  }
  if (backward_done_ && !in_backward) {
    // First forward after a backward: a new iteration.
    backward_done_ = false;
    if (!forward_order_.empty()) last_forward_order_ = forward_order_;
    forward_order_.clear();
    completion_order_.clear();
    for (Group* x : groups_) x->begin_iteration();
  }
  if (std::find(forward_order_.begin(), forward_order_.end(), g) == forward_order_.end())
    forward_order_.push_back(g);
  log(g, "pre_forward");
}

void Context::on_post_forward(Group* g) {
  EntryLock lock(backward_.mutex());
  completion_order_.erase(std::remove(completion_order_.begin(), completion_order_.end(), g),
                          completion_order_.end());
  completion_order_.push_back(g);
}

std::vector<Group*> Context::forward_prefetch_targets(Group& g) {
  EntryLock lock(backward_.mutex());
  std::vector<Group*> targets;
  if (g.forward_prefetch_set()) {
    targets = g.forward_prefetch();
  } else {
    auto it = std::find(last_forward_order_.begin(), last_forward_order_.end(), &g);
    if (it != last_forward_order_.end() && it + 1 != last_forward_order_.end())
      targets.push_back(*(it + 1));
  }
  targets.erase(std::remove_if(targets.begin(), targets.end(),
                               [&](Group* t) {
                                 return t == &g || t->shard_state() != ShardState::kSharded ||
                                        t->options().max_unsharded_groups < 2;
                               }),
                targets.end());
  return targets;
}

void Context::cancel_forward_prefetches() {
  EntryLock lock(backward_.mutex());
  for (Group* g : groups_)
    if (g->shard_state() == ShardState::kGathering && g->training_state() == TrainingState::kIdle)
      g->reshard();
}

void Context::on_backward_end() {
  backward_done_ = true;
  ++epoch_;
}

// ---------------------------------------------------------------------------------------------
// BufferPool
// ---------------------------------------------------------------------------------------------
at::Tensor BufferPool::acquire(int64_t numel, at::ScalarType dtype, at::Device device) {
  auto best = idle_.end();
  for (auto it = idle_.begin(); it != idle_.end(); ++it)
    if (it->scalar_type() == dtype && it->device() == device && it->numel() >= numel &&
        it->numel() <= numel + numel / 8 && (best == idle_.end() || it->numel() < best->numel()))
      best = it;
  at::Tensor whole;
  if (best == idle_.end()) {
    whole = at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
  } else {
    whole = std::move(*best);
    idle_.erase(best);
    idle_bytes_ -= static_cast<int64_t>(whole.nbytes());
  }
  in_use_.insert(whole.storage().data());
  in_use_bytes_ += static_cast<int64_t>(whole.nbytes());
  peak_in_use_bytes_ = std::max(peak_in_use_bytes_, in_use_bytes_);
  return whole.narrow(0, 0, numel);
}

void BufferPool::release(at::Tensor t) {
  if (!t.defined()) return;
  const auto& storage = t.storage();
  const auto it = in_use_.find(storage.data());
  FSDP_CHECK(it != in_use_.end(),
             "internal error: a buffer was given back to the communication-buffer pool that it "
             "did not hand out, or given back twice (two owners would share it); please report "
             "this with FSDP_DEBUG=1's output");
  in_use_.erase(it);
  const int64_t bytes = static_cast<int64_t>(storage.nbytes());
  in_use_bytes_ -= bytes;
  if (in_use_bytes_ + idle_bytes_ + bytes > peak_in_use_bytes_) return;  // freed here
  auto whole = at::empty({0}, t.options());
  whole.set_(storage, 0, {bytes / static_cast<int64_t>(t.element_size())});
  idle_bytes_ += bytes;
  idle_.push_back(std::move(whole));
}

}  // namespace fsdp::detail
