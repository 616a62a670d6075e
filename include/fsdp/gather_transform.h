// GatherTransform: what a parameter puts on the wire when its group is all-gathered, and how every
// rank's wire becomes its full parameter again: FSDP2's per-parameter extension point
// (fsdp_pre_all_gather / fsdp_post_all_gather of its tensor subclasses). A quantized gather (int8
// with per-block scales, say) or a checksummed one is one class of these, given to fully_shard
// through ShardOptions::gather_transform_fn; the group's layout, buffers and collectives are
// fsdp-cpp's. The shard the optimizer steps keeps its dtype and values: only what travels changes.
//
// Each rank's part of the wire holds wire_bytes(padded_numel) bytes for the parameter, the same
// on every rank: the shard is padded to the same number of elements on every rank (its rows,
// then zeros), so that every rank's part has one size.
// Thread-safety: called on the thread that trains (forward, and backward's re-gathers), one group
// at a time; the same transform object may serve several parameters.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace fsdp {

class GatherTransform {
 public:
  virtual ~GatherTransform() = default;
  // Bytes this rank sends for a padded shard of `padded_numel` elements.
  virtual int64_t wire_bytes(int64_t padded_numel) const = 0;
  // `padded_shard`: this rank's rows of the parameter, flat, padded_numel elements in the shard's
  // dtype, zero beyond its rows. Writes them into `wire` (wire_bytes(padded_numel) bytes, kByte).
  virtual void pre_all_gather(const at::Tensor& padded_shard, const at::Tensor& wire) = 0;
  // `wires`: every rank's bytes, (world, wire_bytes(padded_numel)), kByte. Writes every rank's
  // padded rows into `padded_rows`, (world, padded_numel), in the full parameter's dtype (the
  // compute dtype under mixed precision).
  virtual void post_all_gather(const at::Tensor& wires, const at::Tensor& padded_rows) = 0;
};

// ShardOptions::gather_transform_fn: called once per parameter of the group at fully_shard with its
// name (relative to the module) and the parameter; null keeps the plain gather for it. The same
// kind of answer on every rank.
using GatherTransformFn =
    std::function<std::shared_ptr<GatherTransform>(const std::string& name, const at::Tensor& p)>;

}  // namespace fsdp
