#include "core/layout.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

namespace fsdp::detail {

namespace {
size_t aligned(size_t bytes) { return (bytes + 63) / 64 * 64; }
}  // namespace

GroupLayout GroupLayout::of(const std::vector<ParamState>& params, int world, int rank,
                            std::vector<std::shared_ptr<GatherTransform>> transforms) {
  GroupLayout l;
  l.world = world;
  l.rank = rank;
  transforms.resize(params.size());
  if (!params.empty()) {
    l.device = params[0].param().device();
    l.gather_dtype = params[0].param().scalar_type();
    l.shard_dtype = params[0].shard().scalar_type();
  }
  // The full parameters are in their compute dtypes already: param_dtype, or their own where
  // param_dtype_override_fn kept it. The gather and the full block use the widest of these.
  for (const auto& p : params)
    l.gather_dtype = at::promote_types(l.gather_dtype, p.param().scalar_type());
  for (const auto& t : transforms) l.transformed = l.transformed || t != nullptr;
  size_t full = 0;
  int64_t wire = 0;
  const auto gather_elem = static_cast<int64_t>(c10::elementSize(l.gather_dtype));
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamState& p = params[i];
    ParamPlace place;
    place.flat_offset = l.flat_numel;
    l.flat_numel += p.padded_numel();
    full = aligned(full);
    place.full_offset = full;
    full += static_cast<size_t>(p.full_bytes());
    place.transform = transforms[i];
    place.wire_bytes = place.transform ? place.transform->wire_bytes(p.padded_numel())
                                       : p.padded_numel() * gather_elem;
    FSDP_CHECK(place.wire_bytes >= 0, "GatherTransform for '", p.name(),
               "': wire_bytes gave a negative size");
    wire = static_cast<int64_t>(aligned(static_cast<size_t>(wire)));
    place.wire_offset = wire;
    wire += place.wire_bytes;
    l.into_places_possible =
        l.into_places_possible && p.dim() == 0 && p.param().scalar_type() == l.gather_dtype;
    l.places.push_back(std::move(place));
  }
  l.into_places_possible = l.into_places_possible && !l.transformed;
  l.full_block_numel = static_cast<int64_t>((full + gather_elem - 1) / gather_elem);
  l.wire_bytes = wire;
  return l;
}

}  // namespace fsdp::detail
