// ParamState: one sharded parameter (FSDP2's FSDPParam).
//
// The module keeps its full-shaped parameter Variable for its whole life; only its storage comes
// and goes (compat::free_storage / alloc_storage), so autograd's saved tensors, the accumulator and
// the version counter stay valid ([Note: parameter storage] in docs/design.md). The optimizer sees
// `shard`, a separate tensor holding this rank's rows.
//
// Layout in a group's flat buffers: every rank contributes `padded_numel` = chunk * row_numel
// elements per parameter, rows beyond the parameter's end are zero padding. A "row" is one index
// of the shard dim (0 unless ShardOptions::shard_placement_fn says otherwise): rank r's rows are
// the slice [r * chunk, ...) of that dim, held contiguously in their own shape (the shard's).
// Thread-safety: owned by its Group; used on the backward/forward thread only.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/options.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "compat/autograd.h"

namespace fsdp::detail {

class ParamState {
 public:
  // With `compute_dtype` (mixed precision's param_dtype) different from the parameter's dtype, the
  // shard keeps the parameter's dtype and the full parameter becomes a `compute_dtype` tensor, so
  // that forward, backward and the unsharded gradient run in it.
  // With `offload` and a parameter off the CPU, the shard lives in host memory (page-locked with
  // pin_memory) while the full parameter stays on its device.
  ParamState(std::string name, at::Tensor param, int64_t dim, int rank, int world,
             const std::optional<CPUOffloadPolicy>& offload,
             std::optional<at::ScalarType> compute_dtype = std::nullopt);

  // A parameter built under fsdp::deferred_init (core/deferred_init.h) has no values yet: its
  // shard is allocated but unset until materialize() copies in this rank's rows.
  bool materialized() const { return materialized_; }
  void materialize(const at::Tensor& full);

  const std::string& name() const { return name_; }
  void rename(std::string name) { name_ = std::move(name); }  // a module list absorbed
  const at::Tensor& param() const { return param_; }
  const at::Tensor& shard() const { return shard_; }
  bool trainable() const { return param_.requires_grad(); }

  int64_t dim() const { return dim_; }              // the shard dim
  int64_t rows() const { return rows_; }            // its size (1 for a 0-d parameter)
  int64_t row_numel() const { return row_numel_; }  // elements per row
  int64_t chunk() const { return chunk_; }          // rows per rank, ceil(rows / world)
  int64_t rows_of(int rank) const;                  // rows rank holds (0 for trailing ranks)
  int64_t padded_numel() const { return chunk_ * row_numel_; }
  int64_t row_offset_of(int rank) const;  // rank's first row
  int64_t row_offset() const { return row_offset_of(rank_); }
  int64_t full_bytes() const {
    return param_.numel() * static_cast<int64_t>(param_.element_size());
  }

  // Moves the shard into `slot` (padded_numel elements of the group's flat shard block, zero
  // beyond this rank's rows): the shard becomes a tensor over those bytes, still a leaf with its
  // own version counter. At construction only, before anything else holds the shard.
  void place_shard_in(const at::Tensor& slot);
  // The shard still lives at element `offset` of the flat shard block, in its dtype (nothing
  // replaced its storage since, as set_data would): the block holds this rank's rows as they are.
  bool shard_is_at(const at::Tensor& flat, int64_t offset) const;
  // Writes this rank's rows (then zeros) into `dst` (padded_numel elements).
  void copy_in_shard(const at::Tensor& dst);
  // The all-gather sends the shard's own bytes (shard_is_at).
  void note_sent_in_place() { gathered_fingerprint_ = kNoFingerprint; }
  // Remembers the shard's values (a hash), so that a later change is seen however it was written
  // ([Note: stale gathered parameters] in docs/design.md). REQUIRES: the shard still holds the
  // values last gathered (no user code ran since: the end of the epoch of the gather).
  void take_fingerprint() { gathered_fingerprint_ = shard_fingerprint(); }
  // The shard's values differ from those last gathered (an optimizer step, a write through
  // .data(), a copy_ under NoGradGuard, a load), or no fingerprint was taken.
  bool shard_changed_since_gather() const;
  // Gives the full parameter its storage at `byte_offset` in `block` (the group's pooled block
  // of full parameters; lifting the resharded-parameter guard) and fills it from the gathered
  // flat buffer `gathered` (world, S), taking columns [offset, offset + padded_numel) of each
  // rank's row.
  void copy_out(const at::Tensor& gathered, int64_t offset, const at::Tensor& block,
                size_t byte_offset);
  // Rank r's rows of `full` (a tensor of the parameter's shape): a view, strided unless dim 0.
  at::Tensor rows_in(const at::Tensor& full, int r) const;
  // The parameter's full shape over `block` at `byte_offset` (the group's pooled block of full
  // parameters), a view with the block's version counter, not the parameter's.
  at::Tensor full_in(const at::Tensor& block, size_t byte_offset) const;
  // The all-gather into places (no gather buffer; dim 0 only, where each rank's rows are
  // contiguous in the full parameter): this rank's rows in its slot at `offset` of the flat send
  // buffer, without the padding; and where rank r's rows go in the full parameter at
  // `byte_offset` of `block` (empty for a rank that holds no rows).
  at::Tensor rows_to_send(const at::Tensor& send, int64_t offset) const;
  at::Tensor place_of_rows(const at::Tensor& block, size_t byte_offset, int r) const;
  // Once the gather into places has completed: gives the full parameter its storage at
  // `byte_offset` in `block`, which holds its values already (lifts the resharded guard).
  void bind_full(const at::Tensor& block, size_t byte_offset);

  // One rank, no cast (Group::gathers_locally): the full parameter borrows the shard's own bytes
  // instead of a gathered copy; an optimizer step on the shard is seen by it at once.
  void borrow_shard();
  void free_full();  // frees the full storage and guards the parameter (core/guard.h)
  // [Note: writes to gathered parameters] An in-place operation changed the full parameter since
  // bind_full (its version counter moved): the write is in a gathered copy that resharding drops.
  bool written_while_gathered() const;

  // Packs the unsharded gradient (zeros when undefined or frozen, and for padding) into `send`
  // (world, S) at `offset`, and drops it from the parameter (it has been handed to the reduction).
  // A defined gradient counts as this rank's contribution (contributed()).
  void pack_grad(const at::Tensor& send, int64_t offset);
  // [Note: parameters that got no gradient] This rank handed a gradient of this parameter to a
  // reduction since its shard's gradient was last written (sticky across the reductions HSDP sets
  // aside); `force` (set_reduce_scatter_unused_params) counts every reduction as one.
  bool contributed() const { return contributed_; }
  void mark_contributed() { contributed_ = trainable(); }
  // The reduction wrote this shard's gradient; `any_rank` says whether any rank of the mesh
  // contributed to it. None did: the gradient goes back to what it was (none stays none, a
  // gradient kept or zeroed in place stays as it was), as the unsharded model leaves a parameter
  // that got no gradient. Then a new window of contributions begins.
  void settle_shard_grad(bool any_rank);
  // The guarded marker left as the full parameter's gradient once it was handed to the reduction
  // (guard::moved_grad_marker); cleared by a pre hook of the accumulator before autograd
  // accumulates into the full parameter again.
  void set_moved_grad_marker(at::Tensor m) { moved_grad_ = std::move(m); }
  const at::Tensor& moved_grad_marker() const { return moved_grad_; }
  void clear_moved_grad();
  // A real gradient on the full parameter (not the marker): not yet handed to a reduction.
  bool holds_unsharded_grad() const { return param_.grad().defined() && !grad_is_marker(); }
  bool grad_is_marker() const;
  // Backwards without gradient sync accumulate in `reduce_dtype` where it is wider than the
  // compute dtype, as FSDP2 does ([Note: accumulating without gradient sync] in docs/design.md).
  // begin_unsynced_backward, as such a backward begins: where nothing is accumulated yet, autograd
  // casts each gradient reaching the parameter to reduce_dtype before summing them
  // (compat::set_grad_dtype, where this LibTorch has it); end_backward restores the default.
  // keep_unsynced_grad, once the gradient is final: moves it into a gradient of its own in
  // reduce_dtype that the next micro-batches add to, and leaves the marker.
  void begin_unsynced_backward(at::ScalarType reduce_dtype);
  void keep_unsynced_grad(at::ScalarType reduce_dtype);
  void end_backward();
  bool holds_accumulated_grad() const { return accumulated_grad_.defined(); }
  // Accumulates the reduced rows for this rank into shard().grad() (in the shard's dtype).
  void add_shard_grad(const at::Tensor& reduced_flat, int64_t offset);
  // One rank, no replicas (Group::reduces_locally): the reduction of the unsharded gradient is
  // the gradient itself, cast to `reduce_dtype`. Accumulates it into shard().grad() (taking the
  // tensor itself when there is none yet and no cast is needed) and drops it from the parameter;
  // divided by `divide_by` when set (FSDPModule::set_gradient_divide_factor).
  void move_grad_to_shard(at::ScalarType reduce_dtype, const std::optional<double>& divide_by);

  // The AccumulateGrad node of the full parameter (null when frozen). Held strongly: autograd
  // keeps only a weak reference.
  const compat::NodePtr& accumulator() const { return acc_; }
  void set_hook_key(uintptr_t k) { hook_key_ = k; }
  uintptr_t hook_key() const { return hook_key_; }

 private:
  // add_shard_grad where the reduction and the shard are plain host tensors of one dtype
  // ([Note: plain host copies]); false: nothing done, ATen's path applies.
  bool add_shard_grad_on_host(const at::Tensor& reduced_flat, int64_t offset);
  std::string name_;
  at::Tensor param_;
  at::Tensor shard_;
  int rank_, world_;
  int64_t dim_, rows_, row_numel_, chunk_;
  compat::NodePtr acc_;
  uintptr_t hook_key_ = 0;
  at::Tensor moved_grad_;
  at::Tensor accumulated_grad_;      // keep_unsynced_grad's sum, full-shaped, in reduce_dtype
  bool contributed_ = false;         // see contributed()
  bool shard_grad_created_ = false;  // the last reduction created shard().grad() from none
  bool grad_dtype_widened_ = false;  // begin_unsynced_backward set it
  bool accumulates_wider(at::ScalarType reduce_dtype) const {
    return static_cast<int64_t>(c10::elementSize(reduce_dtype)) > param_.element_size();
  }
  // The unsharded gradient to reduce: the accumulated one plus this backward's (either may be
  // missing; undefined when both are), both dropped from this parameter (the marker left).
  at::Tensor take_unsharded_grad();
  // A 64-bit hash of the shard's bytes (XXH3) as last gathered; kNoFingerprint until taken, or
  // where none can be (a shard not in host memory): then the gathered values count as stale.
  static constexpr uint64_t kNoFingerprint = 0;
  uint64_t shard_fingerprint() const;
  uint64_t gathered_fingerprint_ = kNoFingerprint;
  int64_t bound_version_ = 0;   // the full parameter's version counter at bind_full
  bool bound_to_copy_ = false;  // bound to a gathered copy (not the shard's own bytes)
  bool materialized_ = true;
};

}  // namespace fsdp::detail
