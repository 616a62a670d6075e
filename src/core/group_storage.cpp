// Group: where the parameters live (shards, the all-gather, the full block) and resharding.
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>

#include "core/copies.h"
#include "core/group.h"

namespace fsdp::detail {

bool Group::gathers_locally() const {
  if (ctx_->gather.size() != 1 || layout_.transformed) return false;
  for (const auto& p : params_)
    if (p.shard().scalar_type() != p.param().scalar_type() ||  // param_dtype's cast
        p.shard().device() != p.param().device())              // CPUOffloadPolicy
      return false;
  return true;
}

bool Group::sends_in_place() const {
  // Offloaded shards (host) are copied to the device first.
  if (!flat_shard_.defined() || flat_shard_.device() != layout_.device) return false;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!params_[i].shard_is_at(flat_shard_, layout_.places[i].flat_offset)) return false;
  return true;
}

void Group::release_gather(PendingGather& g) {
  ctx_->pool.release(std::move(g.recv));
  if (g.send_pooled) ctx_->pool.release(std::move(g.send));
  g = PendingGather();
}

bool Group::reduces_locally() const {
  // A hook needs the reduced block: one rank still goes through a (trivial) reduce-scatter.
  return ctx_->reduce.size() == 1 && !ctx_->replicate_reduce && !hook_;
}

void Group::gathered(uint64_t epoch, const char* how) {
  shard_state_ = ShardState::kGathering;
  gathered_epoch_ = epoch;
  fingerprinted_ = false;
  ctx_->memory.gathered(full_bytes(), !is_root_);
  log(cat("unshard: ", how, " (SHARDED->GATHERING)"));
}

void Group::unshard(uint64_t epoch) {
  if (shard_state_ != ShardState::kSharded) return;
  check_materialized();
  if (chunk_.defined() && !gather_from_chunk_) drop_chunk();
  // One rank: nothing to exchange; wait_for_unshard lends the shards' bytes. Still GATHERING
  // until then, so that a prefetch is cancelled like any other.
  if (gathers_locally()) return gathered(epoch, "one rank, no all-gather");
  const bool from_chunk = chunk_.defined();
  try {
    if (from_chunk) {
      // hpZ: within the post-forward lane, whose chunks are the (world, S) layout in lane order.
      gather_.send = take_chunk();
      gather_.send_pooled = true;
      gather_.recv = ctx_->pool.acquire(layout_.world * layout_.flat_numel, layout_.gather_dtype,
                                        layout_.device);
      gather_.work = ctx_->post_forward(post_forward_lane_)
                         .all_gather(Collective{index_, layout_.flat_numel}, gather_.recv,
                                     gather_.send, custom_gather_.get());
    } else {
      pack_send(gather_, /*own_gather=*/true);
      issue_gather(ctx_->gather, gather_, full_block_, /*own=*/true);
    }
  } catch (...) {
    // Nothing was issued: the buffers taken for it go back to the pool; still SHARDED.
    if (full_block_.defined()) give_back_full_block();
    release_gather(gather_);
    throw;
  }
  gathered(epoch, from_chunk ? "all-gather of the chunks issued within the post-forward lane"
                             : "all-gather issued");
}

// The pieces land in the full block where the lane can put them there (point to point on CPU,
// every parameter sharded on dim 0, no transform): no gather buffer and no copy-out. Otherwise
// into a flat (world, S) buffer (or the wire's bytes) that wait_for_unshard copies out.
void Group::issue_gather(Lane& lane, PendingGather& g, at::Tensor& block, bool own) {
  const Collective c{index_, layout_.flat_numel};
  if (!custom_gather_ && layout_.into_places_possible) {
    auto pieces = pieces_to_send(layout_, params_, g.send);
    if (lane.gathers_into_places(pieces)) {
      block =
          own ? take_full_block()
              : ctx_->pool.acquire(layout_.full_block_numel, layout_.gather_dtype, layout_.device);
      g.work = lane.all_gather_into(c, places_in(layout_, params_, block), std::move(pieces));
      return;
    }
  }
  g.recv =
      ctx_->pool.acquire(lane.size() * layout_.wire_numel(), layout_.wire_dtype(), layout_.device);
  g.wire = layout_.transformed;
  g.work = lane.all_gather(c, g.recv, g.send, custom_gather_.get());
}

// The send side: the flat shard itself where every shard still lives in it, else a pooled copy
// (cast to param_dtype under mixed precision; the transforms' wire when there are any).
void Group::pack_send(PendingGather& g, bool own_gather) {
  if (sends_in_place()) {
    g.send = flat_shard_;
    if (own_gather)
      for (auto& p : params_) p.note_sent_in_place();
    return;
  }
  g.send = ctx_->pool.acquire(layout_.wire_numel(), layout_.wire_dtype(), layout_.device);
  g.send_pooled = true;
  auto span = copy_span("copy-in ");
  if (layout_.transformed)
    copy_in_wire(layout_, params_, g.send);
  else
    copy_in(layout_, params_, g.send);
}

void Group::serve_gather() {
  if (shard_state_ == ShardState::kSharded) {
    unshard(gathered_epoch_);
    reshard();
    return;
  }
  if (ctx_->gather.size() == 1) return;  // no other rank to send to
  FSDP_CHECK(!gather_from_chunk_, "internal: '", name_,
             "' is held gathered here while the ranks agreed to gather it from post-forward "
             "chunks; please report this with FSDP_DEBUG=1's output");
  check_materialized();
  PendingGather g;
  at::Tensor block;
  pack_send(g, /*own_gather=*/false);
  try {
    issue_gather(ctx_->gather, g, block, /*own=*/false);
  } catch (...) {
    release_gather(g);
    throw;
  }
  log("all-gather for the other ranks (held here: result dropped)");
  g.work.wait();
  release_gather(g);
  if (block.defined()) ctx_->pool.release(std::move(block));
}

void Group::wait_for_unshard() {
  if (shard_state_ == ShardState::kSharded) unshard(gathered_epoch_);
  if (shard_state_ != ShardState::kGathering) return;
  if (gathers_locally()) {
    for (auto& p : params_) p.borrow_shard();
    shard_state_ = ShardState::kUnsharded;
    log("wait_for_unshard: the full parameters borrow the shards (GATHERING->UNSHARDED)");
    return;
  }
  gather_.work.wait();
  if (gather_.recv.defined()) {
    full_block_ = take_full_block();
    auto span = copy_span("copy-out ");
    if (gather_.wire)
      copy_out_wire(layout_, params_, gather_.recv.view({layout_.world, layout_.wire_bytes}),
                    full_block_);
    else
      copy_out(layout_, params_, gather_.recv.view({layout_.world, layout_.flat_numel}),
               full_block_);
  } else {
    bind_full(layout_, params_, full_block_);
  }
  release_gather(gather_);
  shard_state_ = ShardState::kUnsharded;
  log("wait_for_unshard: GATHERING->UNSHARDED");
}

void Group::reshard() {
  // A chunk the ranks agreed to gather from in this backward stays until that gather: a rank may
  // finish with the group (reduce it, reshard it) before the plan reaches its gather.
  if (!gather_from_chunk_) drop_chunk();
  release_full();
}

void Group::reshard_after_forward(bool grad_mode) {
  check_full_unwritten();
  // hpZ: a backward will gather it again, within the post-forward lane, from what stays here.
  if (grad_mode) keep_chunk();
  release_full();
}

// [Note: writes to gathered parameters] Unsharded, an in-place write to a parameter inside
// forward (a weight constraint under NoGradGuard, torch::nn::Embedding's max_norm renormalising
// the rows it looks up) persists. Sharded, it lands in the gathered copy, which resharding drops:
// each rank keeps only its rows of the shard, and the ranks' writes need not even agree. Rather
// than train on silently, the write is refused by name when the group reshards (the full
// parameter's version counter moved since its gather; a write through .data() does not move it
// and is not seen). A group whose full parameters are the shards' own bytes (one rank, no cast)
// keeps such writes, as the unsharded model does.
void Group::check_full_unwritten() const {
  for (const auto& p : params_)
    FSDP_CHECK(!p.written_while_gathered(), "sharded module '", name_, "' (", type_name_,
               ") wrote its parameter '", p.name(),
               "' in place while it was gathered (an in-place operation in its forward, e.g. a "
               "weight constraint under NoGradGuard, or torch::nn::Embedding's max_norm); the "
               "write would be lost when the module reshards, since each rank keeps only its "
               "shard. Fix: apply such writes to the shards (FSDPModule::parameters(), under "
               "torch::NoGradGuard, after optimizer.step()), or leave the parameter out of "
               "sharding (ShardOptions::ignored_params; each rank then keeps its own copy)");
}

void Group::release_full() {
  if (shard_state_ == ShardState::kGathering) {
    // Cancel: the collective has every rank's part in flight, so it is waited, then dropped.
    PendingGather g = std::move(gather_);
    gather_ = PendingGather();
    shard_state_ = ShardState::kSharded;
    ctx_->memory.resharded(full_bytes(), !is_root_);
    g.work.wait();
    release_gather(g);
    if (full_block_.defined()) give_back_full_block();  // gathered into places: not bound yet
    log("reshard: gather discarded (GATHERING->SHARDED)");
    return;
  }
  if (shard_state_ != ShardState::kUnsharded) return;
  check_full_unwritten();
  for (auto& p : params_) p.free_full();
  // No parameter points into the block any more (free_full dropped their references). Borrowed
  // shards (gathers_locally) have no block.
  if (full_block_.defined()) give_back_full_block();
  shard_state_ = ShardState::kSharded;
  ctx_->memory.resharded(full_bytes(), !is_root_);
  log("reshard: UNSHARDED->SHARDED");
}

// [Note: resharding to a smaller world after forward] The full block holds every rank's rows;
// this rank keeps those of its place p in the post-forward lane, in the (world, S) layout of the
// gathered rows, so that the lane's all-gather of the chunks is that layout again.
void Group::keep_chunk() {
  drop_chunk();
  if (!post_forward_lane_ || shard_state_ != ShardState::kUnsharded || !full_block_.defined())
    return;
  const int per = comm_->size() / post_forward_lane_->size();
  const int first = post_forward_lane_->rank() * per;
  at::Tensor chunk =
      ctx_->pool.acquire(per * layout_.flat_numel, layout_.gather_dtype, layout_.device);
  {
    auto span = copy_span("copy-chunk ");
    copy_chunk(layout_, params_, full_block_, first, per, chunk);
  }
  chunk_ = std::move(chunk);
  ctx_->memory.chunk(static_cast<int64_t>(chunk_.nbytes()));
  log(cat("post-forward chunk kept: the rows of ranks ", first, "..", first + per - 1, " (1/",
          post_forward_lane_->size(), " of the group)"));
}

at::Tensor Group::take_full_block() {
  if (kept_block_.defined()) return std::exchange(kept_block_, at::Tensor());
  return ctx_->pool.acquire(layout_.full_block_numel, layout_.gather_dtype, layout_.device);
}

void Group::give_back_full_block() {
  if (keep_storage_)
    kept_block_ = std::exchange(full_block_, at::Tensor());
  else
    ctx_->pool.release(std::exchange(full_block_, at::Tensor()));
}

void Group::set_keep_unsharded_storage(bool keep) {
  keep_storage_ = keep;
  if (!keep && kept_block_.defined()) ctx_->pool.release(std::exchange(kept_block_, at::Tensor()));
}

at::Tensor Group::take_chunk() {
  ctx_->memory.chunk(-static_cast<int64_t>(chunk_.nbytes()));
  return std::exchange(chunk_, at::Tensor());
}

void Group::drop_chunk() {
  if (chunk_.defined()) ctx_->pool.release(take_chunk());
}

void Group::fingerprint_if_gathered() {
  if ((shard_state_ == ShardState::kSharded && !chunk_.defined()) || fingerprinted_) return;
  for (auto& p : params_) p.take_fingerprint();
  fingerprinted_ = true;
}

bool Group::held_from_earlier_epoch(uint64_t epoch) const {
  return (shard_state_ != ShardState::kSharded || chunk_.defined()) && gathered_epoch_ != epoch;
}

void Group::mark_current(uint64_t epoch) { gathered_epoch_ = epoch; }

bool Group::changed_since_gather() const {
  return std::any_of(params_.begin(), params_.end(),
                     [](const ParamState& p) { return p.shard_changed_since_gather(); });
}

}  // namespace fsdp::detail
