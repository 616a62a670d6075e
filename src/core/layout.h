// GroupLayout: where a group's parameters lie in its flat buffers and its full block, and what
// travels on the wire, fixed when the group is built ([Note: parameter storage] in
// docs/design.md). The copies between those buffers and the parameters are free functions over
// it (core/copies.h).
//
// Flat buffers: rank r contributes S = flat_numel elements, each parameter its rows padded to
// chunk * row_numel at its flat offset; (world, S) is every rank's. The full block holds every
// full parameter at a 64-byte aligned byte offset, in the gather's dtype. The wire: what one rank
// sends in an all-gather, wire_bytes per rank, each parameter at its wire offset: its padded rows
// in the gather's dtype, or what its GatherTransform makes of them.
// Thread-safety: immutable.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/gather_transform.h>

#include <memory>
#include <vector>

#include "core/param.h"

namespace fsdp::detail {

struct ParamPlace {
  int64_t flat_offset = 0;  // into the flat shard, a send buffer, a row of (world, S)
  size_t full_offset = 0;   // byte offset of the full parameter in the full block
  int64_t wire_offset = 0;  // byte offset of its part of the wire
  int64_t wire_bytes = 0;   // bytes of it per rank on the wire
  std::shared_ptr<GatherTransform> transform;  // null: its padded rows as they are
};

struct GroupLayout {
  int world = 1, rank = 0;
  int64_t flat_numel = 0;                    // S
  int64_t full_block_numel = 0;              // elements of gather_dtype
  int64_t wire_bytes = 0;                    // per rank
  at::ScalarType gather_dtype = at::kFloat;  // the widest full parameter's: the full block's
  at::ScalarType shard_dtype = at::kFloat;   // every shard's
  at::Device device = at::kCPU;              // the full parameters'
  // Every parameter is sharded on dim 0 and gathered in its own dtype: each rank's rows are
  // contiguous bytes of the full parameter, where the all-gather can put them.
  bool into_places_possible = true;
  bool transformed = false;  // some parameter has a GatherTransform: the wire is bytes
  std::vector<ParamPlace> places;

  // `transforms`: per parameter, null or its transform.
  static GroupLayout of(const std::vector<ParamState>& params, int world, int rank,
                        std::vector<std::shared_ptr<GatherTransform>> transforms);
  at::ScalarType wire_dtype() const { return transformed ? at::kByte : gather_dtype; }
  int64_t wire_numel() const { return transformed ? wire_bytes : flat_numel; }
};

}  // namespace fsdp::detail
