// clip_grad_norm_: gradient-norm clipping over a sharded model (FSDP2's clip_grad_norm_ on
// DTensors). torch::nn::utils::clip_grad_norm_ on the shards would clip each rank by its own
// shard's norm; this computes the norm of the whole (unsharded) gradient with one collective.
//
// Thread-safety: as the model; collective: every rank of root.communicator() calls it together.
#pragma once

#include <fsdp/fully_shard.h>

namespace fsdp {

// The `norm_type`-norm of all shard gradients of `root` taken together (as if unsharded), and
// scales every shard gradient in place by min(1, max_norm / (total + 1e-6)), the rule of
// torch::nn::utils::clip_grad_norm_ in LibTorch 1.13. Returns the total norm.
//
// norm_type: p > 0 (2.0: the Euclidean norm), or std::numeric_limits<double>::infinity() (the
// largest absolute element). Anything else (0, negative, NaN) is an fsdp::Error.
// Shards without a gradient (frozen parameters, empty shards on trailing ranks) count as zero.
// Parameters left whole by ShardOptions::ignored_params are neither counted nor scaled: their
// gradients are each rank's own, and counting them would give each rank its own coefficient.
// Non-finite total: like torch (error_if_nonfinite = false, the default), the gradients are
// scaled by the resulting NaN/0 coefficient and the non-finite total is returned; with
// error_if_nonfinite = true it is an fsdp::Error naming the total, and no gradient is changed.
// REQUIRES: called after a backward that reduced the gradients (not inside no_sync accumulation:
// unsharded local gradients are not included). One all-reduce (p-norm) or one all-gather of one
// double per rank (inf-norm) on root.communicator(); under HSDP that is the shard group, across
// which the replicas' equal gradients need no further reduction.
double clip_grad_norm_(const FSDPModule& root, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);

}  // namespace fsdp
