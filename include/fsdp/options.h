// Options of fully_shard. Thread-safety: plain values.
#pragma once

#include <c10/core/ScalarType.h>
#include <fsdp/gather_transform.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace at {
class Tensor;
}

namespace fsdp {

// FSDP2's MixedPrecisionPolicy. The shards (what the optimizer steps) and the optimizer state keep
// their dtype (fp32); only the gathered parameters, the gradients on the wire and, if asked, the
// forward's inputs and outputs change. See docs/design.md, [Note: mixed precision].
struct MixedPrecisionPolicy {
  // Dtype of the gathered (full) parameters, hence of forward and backward compute, and of the
  // all-gather: bf16 or fp16 moves half the bytes of fp32. None: the shards' dtype.
  std::optional<at::ScalarType> param_dtype;
  // Dtype the gradients are reduce-scattered in (summed in fp32 on the wire for bf16/fp16, then
  // rounded). None: the parameters' own dtype (the shards'), whatever param_dtype is, as in torch
  // 2.15's FSDP2 (before 2.15 FSDP2 reduced in param_dtype: set it to that dtype for the old
  // behaviour and half the reduce-scatter bytes). Where it is wider than a parameter's compute
  // dtype (bf16 compute, fp32 shards), backwards without gradient sync
  // (FSDPModule::set_requires_gradient_sync(false)) accumulate that parameter's gradients in it,
  // as FSDP2 does ([Note: accumulating without gradient sync] in docs/design.md).
  std::optional<at::ScalarType> reduce_dtype;
  // Floating-point tensors of the module's forward result are cast to this dtype. None: no cast.
  std::optional<at::ScalarType> output_dtype;
  // Floating-point tensor arguments of the module's forward are cast to param_dtype.
  bool cast_forward_inputs = true;
  // FSDP2's param_dtype_override_fn: called once per floating-point parameter of the group at
  // fully_shard, with its name (relative to the module; for several modules as one group, after
  // the module's position in the list: "0.weight", "1.weight") and the parameter. The parameter's
  // own dtype keeps it out of param_dtype (e.g. norms in fp32 while the rest computes in bf16: its
  // full parameter, compute and gradient stay fp32); std::nullopt or param_dtype gives param_dtype.
  // Any other dtype is an error. It must answer alike on every rank (checked). The group gathers in
  // the widest of its parameters' dtypes.
  std::function<std::optional<at::ScalarType>(const std::string& name, const at::Tensor& param)>
      param_dtype_override_fn;
};

// FSDP2's reshard_after_forward: true (free the gathered parameters after forward; backward
// gathers them again over the shard group), false (keep them gathered until backward), or a world
// size k dividing the shard group's (hpZ): after forward each rank keeps 1/k of the parameters,
// and backward gathers them within its k consecutive ranks of the shard group only (on one host
// of a multi-host job, that keeps the backward's gathers off the network). k = 1 is false, k = the
// shard group's size is true. Written as in Python: `o.reshard_after_forward = 2;`.
class ReshardAfterForward {
 public:
  ReshardAfterForward(bool reshard) : from_bool_(true), world_(reshard ? 0 : 1) {}  // NOLINT
  ReshardAfterForward(int world) : from_bool_(false), world_(world) {}              // NOLINT
  // The world kept after forward: 1 keeps everything (false), 0 the whole shard group (true),
  // else k. fully_shard rejects an int that is not positive or does not divide the shard
  // group's size.
  int world() const { return world_; }
  bool is_bool() const { return from_bool_; }
  bool operator==(const ReshardAfterForward& o) const {
    return from_bool_ == o.from_bool_ && world_ == o.world_;
  }

 private:
  bool from_bool_;
  int world_;
};

// FSDP2's CPUOffloadPolicy: this group's shards, and so their gradients and the optimizer's state,
// live in host memory while its parameters compute on their device (CUDA). Each all-gather copies
// this rank's shard to the device first; each reduction's result is copied back to the host,
// where the optimizer steps. pin_memory: the shards are page-locked, so the copy to the device
// runs asynchronously. For parameters already on the CPU it changes nothing: the shards are in
// host memory anyway.
struct CPUOffloadPolicy {
  bool pin_memory = true;
};

// FSDP2's Shard(dim), returned by ShardOptions::shard_placement_fn: the parameter is split on
// `dim` (negative counts from the end) by the torch.chunk rule, as dim 0 is by default.
struct Shard {
  int64_t dim = 0;
};

// fsdp-cpp's own settings of a fully_shard call, apart from FSDP2's arguments.
struct RuntimeOptions {
  // Drop this module's activations after forward and recompute them in backward (the recompute
  // runs with the parameters gathered again for backward). See docs/design.md.
  bool activation_checkpointing = false;
  // How many groups' gathered parameters may be alive at once through prefetching (issue order).
  int max_unsharded_groups = 2;
  // Broadcast rank 0's initial parameter values before sharding. Off: fully_shard checks that the
  // values already agree (a checksum per parameter, one all-gather) and names the first parameter
  // that differs.
  bool sync_module_states = false;
  // Broadcast rank 0's buffers (e.g. BatchNorm running statistics) to every rank at the start of
  // each forward of the root, as DDP does. Set on the root.
  bool broadcast_buffers = false;
  // Inside this module's forward the ranks may call different sharded modules, any number of
  // times, in any order (experts with no routed tokens, an encoder called for some batches only):
  // every gather inside it then goes through a round agreed with the other ranks, and gradients
  // stay exact ([Note: calls that differ between ranks] in docs/design.md). Set it on the module
  // whose forward makes those calls (the root, or a mixture-of-experts layer), the same on every
  // rank; FSDPModule::set_calls_may_differ changes it later. Off, every rank must call the same
  // sharded modules in the same order (FSDP2's requirement), and a forward costs no round beyond
  // the one that opens each top-level call; ranks whose calls differ then stop with an error
  // naming this setting.
  bool calls_may_differ = false;
  // Verified collectives (docs/verified_collectives.md): every all-gather and reduce-scatter of
  // the model carries a check of its contents (digests of what each rank sent and received,
  // compared in the exchange that already ends every forward of the root and every backward: no
  // collective of its own). A mismatch stops every rank in the same step with an fsdp::Error
  // naming the collective, the module, the ranks and the step. Set on the root, the same on every
  // rank (checked); FSDP_VERIFY_COLLECTIVES=0 turns it off for a process, =full sets
  // verify_period to 1.
  bool verify_collectives = true;
  // Each iteration checks a rotating 1/verify_period of every collective's payload, so that every
  // byte of each module's all-gathers and reduce-scatters is checked within verify_period
  // iterations (a fault that persists is caught within that many); 1 checks every byte of every
  // collective (the full check; its cost and that of the default are in the page above).
  int verify_period = 8;
};

// Debugging aids.
struct DebugOptions {
  // Check the post-backward invariants Final, Once and Complete at every backward on every rank;
  // also switched on by FSDP_AUDIT=1. Local checks, no communication. (Agreed, that every rank
  // issued the same collectives, is checked at every forward of the root and every backward
  // whether this is on or not.)
  bool audit = false;
};

// fully_shard's options: FSDP2's arguments (mesh aside, which is fully_shard's second argument),
// then fsdp-cpp's own settings.
struct ShardOptions {
  // Declared so that copying options does not touch the deprecated fields in the user's code
  // (defined below, where the deprecation warning is silenced).
  ShardOptions();
  ShardOptions(const ShardOptions&);
  ShardOptions(ShardOptions&&) noexcept;
  ShardOptions& operator=(const ShardOptions&);
  ShardOptions& operator=(ShardOptions&&) noexcept;
  ~ShardOptions();

  // See ReshardAfterForward. Default: true for sharded submodules, false for the root (whose
  // parameters are needed first in backward).
  std::optional<ReshardAfterForward> reshard_after_forward;
  // FSDP2's shard_placement_fn: called once per parameter of the group at fully_shard, with the
  // parameter's name (relative to the module; for several modules as one group, after the
  // module's position in the list: "0.weight", "1.weight") and the parameter; Shard{d} shards it on
  // dim d instead of 0 (e.g. expert weights whose dim 0, the experts, is smaller than the world),
  // and std::nullopt (or no function) keeps dim 0. Each rank holds the slice [offset, offset +
  // chunk) of dim d, chunk = ceil(size(d) / world), trailing ranks fewer or none (FSDP2 asks sizes
  // on a dim other than 0 to divide evenly; here they need not). The same placements on every rank
  // (fully_shard checks). ShardInfo::dim reports it; checkpoints and state dicts hold the full
  // parameters as ever.
  std::function<std::optional<Shard>(const std::string& name, const at::Tensor& param)>
      shard_placement_fn;
  // FSDP2's mp_policy. Per group: fully_shard on a parent does not pass it to sharded children.
  MixedPrecisionPolicy mixed_precision;
  // FSDP2's offload_policy: unset is OffloadPolicy() (no offloading).
  std::optional<CPUOffloadPolicy> offload_policy;
  // FSDP2's ignored_params: parameters of this module (or below it, not in a sharded submodule)
  // that fully_shard leaves whole on every rank and unmanaged: never gathered, resharded or
  // reduced (each rank's gradient is its own), not cast by mixed precision. The handle's
  // parameters() lists them (an optimizer built on it steps them); full_state_dict gives this
  // rank's values, checkpoints store rank 0's.
  std::vector<at::Tensor> ignored_params;
  // What each parameter puts on the wire when the group is all-gathered (fsdp/gather_transform.h):
  // fsdp-cpp's counterpart of FSDP2's tensor-subclass extension (fsdp_pre_all_gather /
  // fsdp_post_all_gather). Unset: the parameters' values in their compute dtype.
  GatherTransformFn gather_transform_fn;

  RuntimeOptions runtime;  // fsdp-cpp's own settings
  DebugOptions debug;      // debugging aids

  // Deprecated spellings of runtime's and debug's fields (fully_shard takes either; these go in a
  // later release).
  [[deprecated(
      "use ShardOptions::runtime.activation_checkpointing")]] bool activation_checkpointing = false;
  [[deprecated("use ShardOptions::runtime.broadcast_buffers")]] bool broadcast_buffers = false;
  [[deprecated("use ShardOptions::runtime.sync_module_states")]] bool sync_module_states = false;
  [[deprecated("use ShardOptions::runtime.max_unsharded_groups")]] std::optional<int>
      max_unsharded_groups;
  [[deprecated("use ShardOptions::debug.audit")]] bool audit = false;
};

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
inline ShardOptions::ShardOptions() = default;
inline ShardOptions::ShardOptions(const ShardOptions&) = default;
inline ShardOptions::ShardOptions(ShardOptions&&) noexcept = default;
inline ShardOptions& ShardOptions::operator=(const ShardOptions&) = default;
inline ShardOptions& ShardOptions::operator=(ShardOptions&&) noexcept = default;
inline ShardOptions::~ShardOptions() = default;
#pragma GCC diagnostic pop

}  // namespace fsdp
