#include "core/backward_passes.h"

#include <fsdp/error.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include "core/backward_pass.h"
#include "core/context.h"
#include "core/group.h"

namespace fsdp::detail {
namespace {

// Which root owns the pass of each running GraphTask, across roots: one backward must not run
// through two (see BackwardPasses::claim). It is the only backward fact that spans roots, so it
// lives outside them; entries live exactly as long as the passes. Never destroyed: a root held
// by a static may release its entries after static destruction began.
class TaskOwners {
 public:
  static TaskOwners& get() {
    static auto* owners = new TaskOwners();
    return *owners;
  }
  // The root already owning `key`, or null after recording `ctx` as its owner.
  const Context* claim(const void* key, const Context* ctx) {
    MutexLock lock(mu_);
    auto [it, fresh] = owners_.emplace(key, ctx);
    return fresh || it->second == ctx ? nullptr : it->second;
  }
  void release(const void* key) {
    MutexLock lock(mu_);
    owners_.erase(key);
  }

 private:
  Mutex mu_;
  std::map<const void*, const Context*> owners_ FSDP_GUARDED_BY(mu_);
};

const void* running_task() { return torch::autograd::get_current_graph_task_nodes_in_graph(); }

}  // namespace

BackwardPasses::BackwardPasses(Context& ctx) : ctx_(ctx) {}

BackwardPasses::~BackwardPasses() {
  EntryLock lock(mu_);
  for (const auto& [key, pass] : passes_) TaskOwners::get().release(key);
}

void BackwardPasses::on_output_hook(Group& g, const torch::autograd::Node* node) {
  EntryLock lock(mu_);
  if (auto* pass = current()) return pass->pre_backward(g);
  const void* key = running_task();
  ctx_.log(&g, "first output hook of this backward");
  claim(key, g);
  auto pass = std::make_unique<BackwardPass>(ctx_, key, node);
  torch::autograd::Engine::get_default_engine().queue_callback([this, key] { finalize(key); });
  passes_.emplace(key, std::move(pass)).first->second->pre_backward(g);
}

void BackwardPasses::on_grad_ready(Group& g, size_t i) {
  EntryLock lock(mu_);
  if (auto* pass = current()) {
    pass->on_grad_ready(g, i);
  } else {
    ctx_.log(&g, detail::cat("gradient of '", g.params()[i].name(),
                             "' outside any sharded backward (kept unsharded)"));
  }
}

void BackwardPasses::on_input_backward(Group& g) {
  EntryLock lock(mu_);
  if (auto* pass = current()) pass->on_input_backward(g);
}

bool BackwardPasses::drop_unfinished() {
  if (passes_.empty() || running_task() != nullptr) return false;
  for (const auto& [key, pass] : passes_) TaskOwners::get().release(key);
  passes_.clear();
  return true;
}

BackwardPass* BackwardPasses::current() {
  auto it = passes_.find(running_task());
  return it == passes_.end() ? nullptr : it->second.get();
}

void BackwardPasses::finalize(const void* key) {
  EntryLock lock(mu_);
  auto it = passes_.find(key);
  if (it == passes_.end()) return;
  std::unique_ptr<BackwardPass> pass = std::move(it->second);
  passes_.erase(it);
  TaskOwners::get().release(key);
  ctx_.on_backward_end();
  try {
    pass->finalize();
  } catch (...) {
    ctx_.end_epoch();
    throw;
  }
  ctx_.end_epoch();
}

// Two roots in one backward each plan their collectives alone, on the same lanes: their
// interleaving would follow this rank's hook order, which differs between ranks whose data take
// different paths, so agreement could not be guaranteed. Typically fully_shard was applied to the
// blocks but not to the model that holds them (whose own parameters then train unsynchronised).
void BackwardPasses::claim(const void* key, const Group& g) {
  const Context* other_ctx = TaskOwners::get().claim(key, &ctx_);
  if (!other_ctx) return;
  const Group* other = other_ctx->root();
  throw Error(detail::cat(
      "one backward runs through two separately sharded models: '", g.type_name(), "' and '",
      other ? other->type_name() : std::string("?"),
      "' each have their own root, because no fully_shard call covers both. This happens when "
      "fully_shard is applied to a model's blocks but not to the model itself (whose own "
      "parameters would then train without gradient synchronisation). Fix: after sharding the "
      "blocks, call fully_shard on the module that holds them all (the model's root)"));
}

}  // namespace fsdp::detail
