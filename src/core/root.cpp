// Root: its groups, the messages of its rounds, and the Agreed check with the settling of the
// shards' gradients. The forward is in root_forward.cpp, the backward in root_backward.cpp, the
// explicit calls in root_explicit.cpp.
#include "core/root.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <set>

#include "util/env.h"

namespace fsdp::detail {

Root::Root(std::shared_ptr<Communicator> comm, std::shared_ptr<Communicator> replicate, bool audit)
    : ctx_(std::move(comm), std::move(replicate)) {
  audit_.enabled = audit || env_flag("FSDP_AUDIT");
  ctx_.gather.add_observer(&agreed_);
  ctx_.reduce.add_observer(&agreed_);
  ctx_.gather.add_observer(&verified_);
  ctx_.reduce.add_observer(&verified_);
  agreed_.add_rider(&verified_);
}

void Root::absorb(Root& other) {
  FSDP_CHECK(other.ctx_.replicate == ctx_.replicate && other.ctx_.comm == ctx_.comm,
             "fully_shard: sharded submodule '",
             other.root_group() ? other.root_group()->type_name() : std::string("?"),
             "' was sharded over a different communicator or mesh than its parent; shard every "
             "module of a model with the same communicator (or the same DeviceMesh)");
  audit_.enabled = audit_.enabled || other.audit_.enabled;
  for (auto& g : other.groups_) {
    groups_.push_back(std::move(g));
    order_.push_back(groups_.back().get());
  }
  other.groups_.clear();
  other.order_.clear();
  for (size_t k = 0; k < order_.size(); ++k)
    order_[k]->place(&ctx_, static_cast<int>(k), /*is_root=*/false, false);
}

void Root::add(std::shared_ptr<Group> g) {
  const bool contains = !order_.empty();
  groups_.push_back(std::move(g));
  order_.push_back(groups_.back().get());
  for (size_t k = 0; k < order_.size(); ++k) {
    const bool last = k + 1 == order_.size();
    order_[k]->place(&ctx_, static_cast<int>(k), last, last && contains);
  }
  // The root's settings (the last call's), before any collective of the model.
  const RuntimeOptions& o = order_.back()->options().runtime;
  const auto env = verify_collectives_env();
  verified_.configure({o.verify_collectives && env != VerifyCollectivesEnv::kOff,
                       env == VerifyCollectivesEnv::kFull ? 1 : o.verify_period});
}

std::vector<Group*> Root::at_or_below(const Group& g) const {
  std::set<const torch::nn::Module*> below{g.module()};
  for (const auto& m : g.module()->modules(/*include_self=*/false)) below.insert(m.get());
  for (const auto* m : g.members()) below.insert(m);
  std::vector<Group*> out;
  for (Group* x : order_)
    if (x == &g || x->inside(below)) out.push_back(x);
  return out;
}

std::vector<std::string> Root::names() const {
  std::vector<std::string> out;
  for (const Group* g : order_) out.push_back(g->name());
  return out;
}

void Root::reset_peaks() { ctx_.memory.reset_peaks(); }

// ---------------------------------------------------------------------------------------------
// Rounds
// ---------------------------------------------------------------------------------------------
protocol::Message Root::message(protocol::Kind kind, int64_t who) const {
  const size_t w = protocol::words_for(order_.size());
  protocol::Message m;
  m.kind = kind;
  m.who = who;
  m.rank = rounds_.mesh_rank();
  for (auto* b : {&m.need, &m.prefetch, &m.changed, &m.held, &m.chunks}) b->assign(w, 0);
  return m;
}

std::vector<protocol::Message> Root::exchange(const protocol::Message& m) {
  return rounds_.exchange(m, order_.size(), [this] { return names(); });
}

// ---------------------------------------------------------------------------------------------
// Agreed, and the shards' gradients settled ([Note: parameters that got no gradient])
// ---------------------------------------------------------------------------------------------
void Root::check_agreement() {
  verified_.begin_check(/*backward=*/false);
  agreed_.check(*ctx_.agree, ctx_.replicate_agree.get(), [this] { return names(); });
}

std::vector<uint64_t> Root::check_agreement_and_settle() {
  verified_.begin_check(/*backward=*/true);
  auto any_rank = agreed_.check(
      *ctx_.agree, ctx_.replicate_agree.get(), [this] { return names(); }, contribution_bits());
  settle_shard_grads(any_rank);
  return any_rank;
}

std::vector<uint64_t> Root::contribution_bits() const {
  size_t n = 0;
  for (const Group* g : order_) n += g->params().size();
  std::vector<uint64_t> bits((n + 63) / 64, 0);
  size_t i = 0;
  for (const Group* g : order_)
    for (const auto& p : g->params()) {
      if (p.contributed()) bits[i / 64] |= uint64_t{1} << (i % 64);
      ++i;
    }
  return bits;
}

void Root::settle_shard_grads(const std::vector<uint64_t>& any_rank) {
  size_t i = 0;
  for (Group* g : order_) {
    std::vector<bool> any;
    for (size_t k = 0; k < g->params().size(); ++k, ++i)
      any.push_back((any_rank.at(i / 64) >> (i % 64)) & 1);
    g->settle_shard_grads(any);
  }
}

}  // namespace fsdp::detail
