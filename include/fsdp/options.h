// Options of fully_shard. Thread-safety: plain values.
#pragma once

#include <optional>

namespace fsdp {

struct ShardOptions {
  // Free the gathered parameters after forward and gather them again before backward. Default:
  // true for sharded submodules, false for the root (whose parameters are needed first in
  // backward).
  std::optional<bool> reshard_after_forward;
  // Check the post-backward invariants (Final, Once, Agreed, Complete) at every backward on every
  // rank; also switched on by FSDP_AUDIT=1. Costs one small all-gather per backward.
  bool audit = false;
  // How many groups' gathered parameters may be alive at once through prefetching (issue order).
  int max_unsharded_groups = 2;
  // Broadcast rank 0's initial parameter values before sharding. Off: fully_shard checks that the
  // values already agree (a checksum per parameter, one all-gather) and names the first parameter
  // that differs.
  bool sync_module_states = false;
  // Drop this module's activations after forward and recompute them in backward (the recompute
  // runs with the parameters gathered again for backward). See docs/design.md.
  bool activation_checkpointing = false;
  // Broadcast rank 0's buffers (e.g. BatchNorm running statistics) to every rank at the start of
  // each forward of the root, as DDP does. Set on the root.
  bool broadcast_buffers = false;
};

}  // namespace fsdp
