#include "core/comm_context.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>
#include <iostream>

#include "util/env.h"

namespace fsdp::detail {

CommContext::CommContext(std::shared_ptr<Communicator> comm_in,
                         std::shared_ptr<Communicator> replicate_in)
    : comm(std::move(comm_in)),
      replicate(std::move(replicate_in)),
      gather(comm->lane("fsdp.all_gather")),
      reduce(comm->lane("fsdp.reduce_scatter")) {
  if (replicate) replicate_reduce = std::make_unique<Lane>(replicate->lane("fsdp.replicate"));
  agree = comm->lane("fsdp.agree");
  if (replicate) replicate_agree = replicate->lane("fsdp.agree");
  debug = env_flag("FSDP_DEBUG");
}

void CommContext::rebind_replicate(std::shared_ptr<Communicator> r) {
  FSDP_CHECK(replicate && r,
             "set_replicate_communicator: only a model sharded over a mesh with replicas (HSDP) "
             "can take another replicate communicator, and the new one must not be null");
  auto reduce_lane = std::make_unique<Lane>(r->lane("fsdp.replicate"));
  auto agree_lane = r->lane("fsdp.agree");
  replicate = std::move(r);
  replicate_reduce = std::move(reduce_lane);
  replicate_agree = std::move(agree_lane);
}

void CommContext::log(const std::string& who, const std::string& event) const {
  if (!debug) return;
  std::cerr << "fsdp[rank " << comm->rank() << "] group '" << who << "' " << event << " | gathered "
            << memory.groups << " groups, " << memory.bytes << " bytes; buffers "
            << pool.in_use_bytes() << " in use, " << pool.idle_bytes() << " idle\n";
}

Lane& CommContext::post_forward(const std::shared_ptr<Communicator>& c) {
  auto& lane = post_forward_[c.get()];
  if (!lane) {
    lane = std::make_unique<Lane>(c);
    for (auto* o : gather.observers()) lane->add_observer(o);
  }
  return *lane;
}

void GatheredMemory::gathered(int64_t b, bool counts_as_group) {
  bytes += b;
  if (counts_as_group) ++groups;
  peak_bytes = std::max(peak_bytes, bytes);
  peak_groups = std::max(peak_groups, groups);
}

void GatheredMemory::resharded(int64_t b, bool counts_as_group) {
  bytes -= b;
  if (counts_as_group) --groups;
}

void GatheredMemory::chunk(int64_t delta) {
  chunk_bytes += delta;
  peak_chunk_bytes = std::max(peak_chunk_bytes, chunk_bytes);
}

void GatheredMemory::reset_peaks() {
  peak_chunk_bytes = chunk_bytes;
  peak_bytes = bytes;
  peak_groups = groups;
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
