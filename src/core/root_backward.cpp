// Root: the backward's entries. The first output hook of a GraphTask builds its pass
// (core/backward.h) after the pass's opening round; later events go to the pass; the engine's final
// callback finalises it, checks Agreed (settling the shards' gradients) and runs the audit.
#include <fsdp/error.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <map>

#include "core/registry.h"
#include "core/root.h"

namespace fsdp::detail {
namespace {

const void* running_task() { return torch::autograd::get_current_graph_task_nodes_in_graph(); }

// Two roots in one backward each plan their collectives alone, on the same lanes: their
// interleaving would follow this rank's hook order, which differs between ranks whose data take
// different paths, so agreement could not be guaranteed. Typically fully_shard was applied to the
// blocks but not to the model that holds them (whose own parameters then train unsynchronised).
void claim(const void* key, const Root& mine, const Group& g) {
  const Root* other = Registry::instance().claim_backward(key, &mine);
  if (!other) return;
  const Group* theirs = other->root_group();
  throw Error(
      cat("one backward runs through two separately sharded models: '", g.type_name(), "' and '",
          theirs ? theirs->type_name() : std::string("?"),
          "' each have their own root, because no fully_shard call covers both. This happens when "
          "fully_shard is applied to a model's blocks but not to the model itself (whose own "
          "parameters would then train without gradient synchronisation). Fix: after sharding the "
          "blocks, call fully_shard on the module that holds them all (the model's root)"));
}

}  // namespace

Root::~Root() {
  EntryLock lock(mu_);
  for (const auto& [key, pass] : passes_) Registry::instance().release_backward(key);
}

Backward* Root::current() {
  auto it = passes_.find(running_task());
  return it == passes_.end() ? nullptr : it->second.get();
}

bool Root::drop_unfinished() {
  if (passes_.empty() || running_task() != nullptr) return false;
  for (const auto& [key, pass] : passes_) Registry::instance().release_backward(key);
  passes_.clear();
  return true;
}

void Root::on_output_hook(Group& g, const torch::autograd::Node* node) {
  EntryLock lock(mu_);
  Backward* pass = current();
  (pass ? *pass : begin_backward(g, node)).pre_backward(g);
}

void Root::on_accumulate(Group& g, size_t param) {
  EntryLock lock(mu_);
  g.params()[param].clear_moved_grad();
}

void Root::on_grad_ready(Group& g, size_t param) {
  EntryLock lock(mu_);
  if (Backward* pass = current())
    pass->on_grad_ready(g, param);
  else
    ctx_.log(g.name(), cat("gradient of '", g.params()[param].name(),
                           "' outside any sharded backward (kept unsharded)"));
}

void Root::on_input_backward(Group& g) {
  EntryLock lock(mu_);
  if (Backward* pass = current()) pass->on_input_backward(g);
}

// The pass's opening round comes before any other collective of the backward, so that ranks whose
// backward calls or gradient sync differ stop there by name; the final callback is queued only
// once the pass has begun.
Backward& Root::begin_backward(Group& g, const torch::autograd::Node* node) {
  const void* key = running_task();
  ctx_.log(g.name(), "first output hook of this backward");
  claim(key, *this, g);
  auto pass = std::make_unique<Backward>(order_, completion_order_, node, epoch_, ctx_, audit_,
                                         reap_budget_);
  auto decided = agree_backward(*pass);
  if (pass->plain() && rounds_.has_replicas()) {
    std::vector<bool> all_reduces;
    for (Group* x : order_) all_reduces.push_back(x->all_reduces());
    agreed_.check_all_reduce_settings(*ctx_.agree, *ctx_.replicate_agree, all_reduces,
                                      [this] { return names(); });
  }
  pass->start(std::move(decided));
  torch::autograd::Engine::get_default_engine().queue_callback([this, key] { finalize_task(key); });
  return *passes_.emplace(key, std::move(pass)).first->second;
}

// This rank's part of the pass's opening round (protocol::Kind::kBackward): the groups it reduces
// by the sync settings (which must match), those it may have something to reduce for, its gather
// plan, its reverse first-forward order and hpZ chunks. Every rank takes the same decision;
// under HSDP the replicas' reduce orders and holdings are merged too.
protocol::BackwardDecision Root::agree_backward(const Backward& pass) {
  const auto syncing = pass.syncing();
  protocol::Message m =
      message(protocol::Kind::kBackward, std::count(syncing.begin(), syncing.end(), true));
  m.need = protocol::bits_of(syncing);
  m.digest = protocol::digest_of(m.need);
  m.held = protocol::bits_of(pass.holdings());
  for (size_t k = 0; k < order_.size(); ++k)
    if (order_[k]->holds_chunk()) protocol::set_bit(m.chunks, k);
  m.plan = pass.plan();
  for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it)
    m.reverse.push_back((*it)->index());
  const auto all = exchange(m);
  const Group* root = root_group();
  auto d = protocol::decide_backward(all, order_.size(), root ? root->index() : -1);
  if (rounds_.has_replicas()) {
    std::vector<int64_t> row{d.calls_differ ? 1 : 0};
    const auto held = protocol::bits_of(d.held);
    for (uint64_t w : held) row.push_back(static_cast<int64_t>(w));
    row.insert(row.end(), d.reductions.begin(), d.reductions.end());
    std::vector<std::vector<int64_t>> orders;
    std::vector<protocol::Bits> helds;
    bool differ = false;
    for (const auto& r : rounds_.across_replicas(row)) {  // every order holds every group
      differ = differ || r[0] != 0;
      helds.emplace_back(r.begin() + 1, r.begin() + 1 + static_cast<std::ptrdiff_t>(held.size()));
      orders.emplace_back(r.begin() + 1 + static_cast<std::ptrdiff_t>(held.size()), r.end());
    }
    protocol::merge_replicas(d, orders, helds, differ);
  }
  return d;
}

void Root::finalize_task(const void* key) {
  EntryLock lock(mu_);
  auto it = passes_.find(key);
  if (it == passes_.end()) return;
  std::unique_ptr<Backward> pass = std::move(it->second);
  passes_.erase(it);
  Registry::instance().release_backward(key);
  backward_done_ = true;  // the next forward starts a new iteration and epoch
  ++epoch_;
  try {
    pass->finalize();
    const auto any_rank = check_agreement_and_settle();
    if (audit_.enabled) audit_.check(*pass, order_, any_rank, ctx_.reduce.rank());
  } catch (...) {
    end_epoch();
    throw;
  }
  end_epoch();
}

}  // namespace fsdp::detail
