// Group: where the parameters live (shards, the all-gather, the full block) and resharding.
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>

#include "comm/communicator_impl.h"
#include "core/buffers.h"
#include "core/context.h"
#include "core/group.h"
#include "core/guard.h"

namespace fsdp::detail {

// ---------------------------------------------------------------------------------------------
// Storage
// ---------------------------------------------------------------------------------------------
void Group::materialize_param(size_t i, const at::Tensor& full) {
  FSDP_CHECK(shard_state_ == ShardState::kSharded, "materialize: sharded module '", name_,
             "' is gathered; materialize before the first forward");
  params_[i].materialize(full);
}

bool Group::materialized() const {
  for (const auto& p : params_)
    if (!p.materialized()) return false;
  return true;
}

void Group::check_materialized() const {
  FSDP_CHECK(materialized(), "sharded module '", name_, "' (", type_name_,
             ") was built under fsdp::deferred_init and has no values yet. Fix: call "
             "fsdp::materialize(model) after fully_shard and before the first forward (or "
             "unshard, state dict or checkpoint save)");
}

bool Group::gathers_locally() const {
  if (context_->gather_lane().size() != 1) return false;
  for (const auto& p : params_)
    if (p.shard().scalar_type() != p.param().scalar_type() ||  // param_dtype's cast
        p.shard().device() != p.param().device())              // CPUOffloadPolicy
      return false;
  return true;
}

bool Group::sends_in_place() const {
  // Offloaded shards (host) are copied to the device first.
  if (!flat_shard_.defined() || flat_shard_.device() != device_) return false;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!params_[i].shard_is_at(flat_shard_.narrow(0, offsets_[i], params_[i].padded_numel())))
      return false;
  return true;
}

void Group::release_gather(PendingGather& g) {
  context_->pool().release(std::move(g.recv));
  if (g.send_pooled) context_->pool().release(std::move(g.send));
  g = PendingGather();
}

bool Group::reduces_locally() const {
  // A hook needs the reduced block: one rank still goes through a (trivial) reduce-scatter.
  return context_->reduce_lane().size() == 1 && !context_->replicate_lane() && !hook_;
}

void Group::unshard() {
  if (shard_state_ != ShardState::kSharded) return;
  check_materialized();
  if (chunk_.defined() && !gather_from_chunk_) drop_chunk();
  if (gathers_locally()) {
    // Nothing to exchange: wait_for_unshard lends the shards' bytes. Still GATHERING until then,
    // so that a prefetch is cancelled like any other.
    shard_state_ = ShardState::kGathering;
    gathered_epoch_ = context_->epoch();
    fingerprinted_ = false;
    context_->on_gather_issued(this);
    context_->log(this, "unshard: one rank, no all-gather (SHARDED->GATHERING)");
    return;
  }
  auto& pool = context_->pool();
  const bool from_chunk = chunk_.defined();
  try {
    if (from_chunk) {
      // hpZ: within the post-forward lane, whose chunks are the (world, S) layout in lane order.
      gather_.send = take_chunk();
      gather_.send_pooled = true;
      gather_.recv = pool.acquire(comm_->size() * flat_numel_, gather_dtype_, device_);
      gather_.work = all_gather(*post_forward_lane_, gather_.recv, gather_.send);
    } else {
      pack_send(gather_, /*own_gather=*/true);
      issue_gather(context_->gather_lane(), pool, gather_, full_block_, /*own=*/true);
    }
  } catch (...) {
    // Nothing was issued: the buffers taken for it go back to the pool; still SHARDED.
    if (full_block_.defined()) give_back_full_block();
    release_gather(gather_);
    throw;
  }
  shard_state_ = ShardState::kGathering;
  gathered_epoch_ = context_->epoch();
  fingerprinted_ = false;
  context_->on_gather_issued(this);  // the gather buffer is as large as the gathered parameters
  context_->log(this, from_chunk ? "unshard: all-gather of the chunks issued within the "
                                   "post-forward lane (SHARDED->GATHERING)"
                                 : "unshard: all-gather issued (SHARDED->GATHERING)");
}

// The pieces land in the full block where the lane can put them there (point to point on CPU,
// every parameter sharded on dim 0): no gather buffer and no copy-out. Otherwise (a collective
// backend) into a flat (world, S) buffer that wait_for_unshard copies out.
void Group::issue_gather(Communicator& lane, BufferPool& pool, PendingGather& g, at::Tensor& block,
                         bool own) {
  std::vector<at::Tensor> pieces;
  pieces.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i)
    pieces.push_back(params_[i].rows_to_send(g.send, offsets_[i]));
  if (!custom_gather_ && gathers_into_places_ && detail::gathers_into_places(lane, pieces)) {
    block = own ? take_full_block() : pool.acquire(full_block_numel_, gather_dtype_, device_);
    std::vector<std::vector<at::Tensor>> places(lane.size());
    for (int r = 0; r < lane.size(); ++r)
      for (size_t i = 0; i < params_.size(); ++i)
        places[r].push_back(params_[i].place_of_rows(block, full_offsets_[i], r));
    g.work = all_gather_into(lane, std::move(places), std::move(pieces));
    return;
  }
  g.recv = pool.acquire(lane.size() * flat_numel_, gather_dtype_, device_);
  g.work = all_gather(lane, g.recv, g.send);
}

Work Group::all_gather(Communicator& lane, const at::Tensor& recv, const at::Tensor& send) {
  return custom_gather_ ? (*custom_gather_)(recv, send, lane) : lane.all_gather(recv, send);
}

// The send side: the flat shard itself where every shard still lives in it, else a pooled copy
// (cast to param_dtype under mixed precision).
void Group::pack_send(PendingGather& g, bool own_gather) {
  if (sends_in_place()) {
    g.send = flat_shard_;
    if (own_gather)
      for (auto& p : params_) p.note_sent_in_place();
    return;
  }
  g.send = context_->pool().acquire(flat_numel_, gather_dtype_, device_);
  g.send_pooled = true;
  auto span = copy_span("copy-in ");
  for (size_t i = 0; i < params_.size(); ++i)
    params_[i].copy_in_shard(g.send.narrow(0, offsets_[i], params_[i].padded_numel()));
}

// [Note: calls that differ between ranks] Another rank needs this group gathered; this rank does
// not keep the result. A resharded group is gathered and dropped; one held here (gathered or in
// flight) is left as it is, and this rank still sends its part through a gather of its own.
void Group::serve_gather() {
  if (shard_state_ == ShardState::kSharded) {
    unshard();
    reshard();
    return;
  }
  if (context_->gather_lane().size() == 1) return;  // no other rank to send to
  FSDP_CHECK(!gather_from_chunk_, "internal: '", name_,
             "' is held gathered here while the ranks agreed to gather it from post-forward "
             "chunks; please report this with FSDP_DEBUG=1's output");
  check_materialized();
  auto& pool = context_->pool();
  PendingGather g;
  at::Tensor block;
  pack_send(g, /*own_gather=*/false);
  try {
    issue_gather(context_->gather_lane(), pool, g, block, /*own=*/false);
  } catch (...) {
    release_gather(g);
    throw;
  }
  context_->agreement().on_gather(context_->index_of(this), flat_numel_);
  context_->log(this, "all-gather for the other ranks (held here: result dropped)");
  g.work.wait();
  release_gather(g);
  if (block.defined()) pool.release(std::move(block));
}

void Group::wait_for_unshard() {
  if (shard_state_ == ShardState::kSharded) unshard();
  if (shard_state_ != ShardState::kGathering) return;
  if (gathers_locally()) {
    for (auto& p : params_) p.borrow_shard();
    shard_state_ = ShardState::kUnsharded;
    context_->log(this,
                  "wait_for_unshard: the full parameters borrow the shards (GATHERING->UNSHARDED)");
    return;
  }
  gather_.work.wait();
  if (gather_.recv.defined()) {
    auto rows = gather_.recv.view({context_->gather_lane().size(), flat_numel_});
    full_block_ = take_full_block();
    auto span = copy_span("copy-out ");
    for (size_t i = 0; i < params_.size(); ++i)
      params_[i].copy_out(rows, offsets_[i], full_block_, full_offsets_[i]);
  } else {
    for (size_t i = 0; i < params_.size(); ++i) params_[i].bind_full(full_block_, full_offsets_[i]);
  }
  release_gather(gather_);
  shard_state_ = ShardState::kUnsharded;
  context_->log(this, "wait_for_unshard: GATHERING->UNSHARDED");
}

void Group::reshard() {
  // A chunk the ranks agreed to gather from in this backward stays until that gather: a rank may
  // finish with the group (reduce it, reshard it) before the plan reaches its gather.
  if (!gather_from_chunk_) drop_chunk();
  release_full();
}

void Group::release_full() {
  if (shard_state_ == ShardState::kGathering) {
    // Cancel: the collective has every rank's part in flight, so it is waited, then dropped.
    PendingGather g = std::move(gather_);
    gather_ = PendingGather();
    shard_state_ = ShardState::kSharded;
    context_->on_resharded(this);
    g.work.wait();
    release_gather(g);
    if (full_block_.defined()) give_back_full_block();  // gathered into places: not bound yet
    context_->log(this, "reshard: gather discarded (GATHERING->SHARDED)");
    return;
  }
  if (shard_state_ != ShardState::kUnsharded) return;
  for (auto& p : params_) p.free_full();
  // No parameter points into the block any more (free_full dropped their references). Borrowed
  // shards (gathers_locally) have no block.
  if (full_block_.defined()) give_back_full_block();
  shard_state_ = ShardState::kSharded;
  context_->on_resharded(this);
  context_->log(this, "reshard: UNSHARDED->SHARDED");
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
  at::Tensor chunk = context_->pool().acquire(per * flat_numel_, gather_dtype_, device_);
  auto rows = chunk.view({per, flat_numel_});
  auto span = copy_span("copy-chunk ");
  at::NoGradGuard no_grad;
  for (int j = 0; j < per; ++j)
    for (size_t i = 0; i < params_.size(); ++i) {
      const ParamState& p = params_[i];
      at::Tensor place = p.rows_in(p.full_in(full_block_, full_offsets_[i]), first + j);
      auto slot = rows[j].narrow(0, offsets_[i], p.padded_numel());
      slot.narrow(0, 0, place.numel()).view(place.sizes()).copy_(place);
      slot.narrow(0, place.numel(), slot.numel() - place.numel()).zero_();
    }
  chunk_ = std::move(chunk);
  context_->on_chunk(chunk_.nbytes());
  context_->log(
      this, detail::cat("post-forward chunk kept: the rows of ranks ", first, "..", first + per - 1,
                        " (1/", post_forward_lane_->size(), " of the group)"));
}

at::Tensor Group::take_full_block() {
  if (kept_block_.defined()) return std::exchange(kept_block_, at::Tensor());
  return context_->pool().acquire(full_block_numel_, gather_dtype_, device_);
}

void Group::give_back_full_block() {
  if (keep_storage_)
    kept_block_ = std::exchange(full_block_, at::Tensor());
  else
    context_->pool().release(std::exchange(full_block_, at::Tensor()));
}

void Group::set_keep_unsharded_storage(bool keep) {
  keep_storage_ = keep;
  if (!keep && kept_block_.defined())
    context_->pool().release(std::exchange(kept_block_, at::Tensor()));
}

at::Tensor Group::take_chunk() {
  context_->on_chunk(-static_cast<int64_t>(chunk_.nbytes()));
  return std::exchange(chunk_, at::Tensor());
}

void Group::drop_chunk() {
  if (!chunk_.defined()) return;
  context_->pool().release(take_chunk());
}

void Group::fingerprint_if_gathered() {
  if ((shard_state_ == ShardState::kSharded && !chunk_.defined()) || fingerprinted_) return;
  for (auto& p : params_) p.take_fingerprint();
  fingerprinted_ = true;
}

bool Group::held_from_earlier_epoch() const {
  return (shard_state_ != ShardState::kSharded || chunk_.defined()) &&
         gathered_epoch_ != context_->epoch();
}

void Group::mark_current() { gathered_epoch_ = context_->epoch(); }

bool Group::changed_since_gather() const {
  for (const auto& p : params_)
    if (p.shard_changed_since_gather()) return true;
  return false;
}

}  // namespace fsdp::detail
