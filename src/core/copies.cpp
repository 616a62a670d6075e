#include "core/copies.h"

#include <ATen/ATen.h>

namespace fsdp::detail {

void copy_in(const GroupLayout& layout, std::vector<ParamState>& params, const at::Tensor& send) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i].copy_in_shard(send.narrow(0, layout.places[i].flat_offset, params[i].padded_numel()));
}

void copy_in_wire(const GroupLayout& layout, std::vector<ParamState>& params,
                  const at::Tensor& wire) {
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamPlace& place = layout.places[i];
    at::Tensor bytes = wire.narrow(0, place.wire_offset, place.wire_bytes);
    if (place.transform) {
      at::Tensor padded =
          at::empty({params[i].padded_numel()}, params[i].shard().options().requires_grad(false));
      params[i].copy_in_shard(padded);
      place.transform->pre_all_gather(padded, bytes);
    } else {
      params[i].copy_in_shard(bytes.view(layout.gather_dtype));
    }
  }
}

void copy_out(const GroupLayout& layout, std::vector<ParamState>& params, const at::Tensor& rows,
              const at::Tensor& block) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i].copy_out(rows, layout.places[i].flat_offset, block, layout.places[i].full_offset);
}

void copy_out_wire(const GroupLayout& layout, std::vector<ParamState>& params,
                   const at::Tensor& wires, const at::Tensor& block) {
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamPlace& place = layout.places[i];
    at::Tensor mine = wires.narrow(1, place.wire_offset, place.wire_bytes);
    at::Tensor rows;
    if (place.transform) {
      rows = at::empty({layout.world, params[i].padded_numel()},
                       params[i].param().options().requires_grad(false));
      place.transform->post_all_gather(mine, rows);
    } else {
      rows = mine.contiguous().view(layout.gather_dtype);  // (world, padded) in gather_dtype
    }
    params[i].copy_out(rows, 0, block, place.full_offset);
  }
}

std::vector<at::Tensor> pieces_to_send(const GroupLayout& layout,
                                       const std::vector<ParamState>& params,
                                       const at::Tensor& send) {
  std::vector<at::Tensor> pieces;
  pieces.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i)
    pieces.push_back(params[i].rows_to_send(send, layout.places[i].flat_offset));
  return pieces;
}

std::vector<std::vector<at::Tensor>> places_in(const GroupLayout& layout,
                                               const std::vector<ParamState>& params,
                                               const at::Tensor& block) {
  std::vector<std::vector<at::Tensor>> places(layout.world);
  for (int r = 0; r < layout.world; ++r)
    for (size_t i = 0; i < params.size(); ++i)
      places[r].push_back(params[i].place_of_rows(block, layout.places[i].full_offset, r));
  return places;
}

void bind_full(const GroupLayout& layout, std::vector<ParamState>& params,
               const at::Tensor& block) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i].bind_full(block, layout.places[i].full_offset);
}

void copy_chunk(const GroupLayout& layout, const std::vector<ParamState>& params,
                const at::Tensor& block, int first, int count, const at::Tensor& chunk) {
  auto rows = chunk.view({count, layout.flat_numel});
  at::NoGradGuard no_grad;
  for (int j = 0; j < count; ++j)
    for (size_t i = 0; i < params.size(); ++i) {
      const ParamState& p = params[i];
      at::Tensor place = p.rows_in(p.full_in(block, layout.places[i].full_offset), first + j);
      auto slot = rows[j].narrow(0, layout.places[i].flat_offset, p.padded_numel());
      slot.narrow(0, 0, place.numel()).view(place.sizes()).copy_(place);
      slot.narrow(0, place.numel(), slot.numel() - place.numel()).zero_();
    }
}

void pack_grad(const GroupLayout& layout, std::vector<ParamState>& params, size_t i,
               const at::Tensor& send) {
  params[i].pack_grad(send, layout.places[i].flat_offset);
}

void add_reduced(const GroupLayout& layout, std::vector<ParamState>& params,
                 const at::Tensor& reduced) {
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].trainable()) params[i].add_shard_grad(reduced, layout.places[i].flat_offset);
}

}  // namespace fsdp::detail
