// The copies between a group's flat buffers and its parameters, as free functions over its layout
// (core/layout.h): the all-gather's copy-in and copy-out, the gather into places, hpZ's chunk, the
// reduce-scatter's gradient packing and the reduced block's copy into the shards' gradients. The
// group decides which run when; these only move bytes.
// Thread-safety: as the group (the training thread).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "core/layout.h"
#include "core/param.h"

namespace fsdp::detail {

// ---- all-gather ----
// This rank's padded shards into `send` (layout.flat_numel elements of gather_dtype), cast where a
// shard's dtype differs (mixed precision's param_dtype).
void copy_in(const GroupLayout& layout, std::vector<ParamState>& params, const at::Tensor& send);
// With transforms: this rank's wire (layout.wire_bytes, kByte), each parameter's padded shard
// through its GatherTransform (or its bytes in gather_dtype).
void copy_in_wire(const GroupLayout& layout, std::vector<ParamState>& params,
                  const at::Tensor& wire);
// Every rank's rows, (world, S), into each full parameter, which gets its storage in `block`.
void copy_out(const GroupLayout& layout, std::vector<ParamState>& params, const at::Tensor& rows,
              const at::Tensor& block);
// Every rank's wire, (world, wire_bytes), decoded into each full parameter (in `block`).
void copy_out_wire(const GroupLayout& layout, std::vector<ParamState>& params,
                   const at::Tensor& wires, const at::Tensor& block);
// The gather into places (layout.into_places_possible): the pieces this rank sends out of `send`,
// where every rank's pieces land in `block`, and the parameters bound to `block` once they have.
std::vector<at::Tensor> pieces_to_send(const GroupLayout& layout,
                                       const std::vector<ParamState>& params,
                                       const at::Tensor& send);
std::vector<std::vector<at::Tensor>> places_in(const GroupLayout& layout,
                                               const std::vector<ParamState>& params,
                                               const at::Tensor& block);
void bind_full(const GroupLayout& layout, std::vector<ParamState>& params, const at::Tensor& block);
// hpZ: the rows of ranks [first, first + count) of the full parameters in `block`, laid out as
// rows of the gathered (world, S) buffer, into `chunk` (count * S elements).
void copy_chunk(const GroupLayout& layout, const std::vector<ParamState>& params,
                const at::Tensor& block, int first, int count, const at::Tensor& chunk);

// ---- reduce-scatter ----
// Parameter i's gradient (zeros when it has none, and for padding) into its columns of `send`,
// (world, S); the gradient is dropped from the parameter.
void pack_grad(const GroupLayout& layout, std::vector<ParamState>& params, size_t i,
               const at::Tensor& send);
// This rank's reduced block (S elements) added into every trainable shard's gradient.
void add_reduced(const GroupLayout& layout, std::vector<ParamState>& params,
                 const at::Tensor& reduced);

}  // namespace fsdp::detail
