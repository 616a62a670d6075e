// Whole-model state of a sharded model under the names of the unsharded model: the full tensors
// gathered from the shards (to save for inference, or to compare), and loading such a dictionary
// back into the shards. Buffers (BatchNorm running statistics, ...) are included.
//
//   auto sd = fsdp::full_state_dict(root, {/*rank0_only=*/true});   // collective
//   if (rank == 0) ... fsdp::safetensors::write(path, views, meta)  // views: view_of(name, tensor)
//   fsdp::load_full_state_dict(root, sd_on_every_rank);                // local
//
// Thread-safety: call from the thread that trains; full_state_dict and check_buffers_agree are
// collectives over root.communicator() (every rank, same order).
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/fully_shard.h>
#include <torch/ordered_dict.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

using StateDict = torch::OrderedDict<std::string, at::Tensor>;

struct StateDictOptions {
  // Only rank 0 gets the tensors (the others get an empty dictionary). The gathers are the same
  // either way (one all-gather per parameter); this only saves the other ranks the copies.
  bool rank0_only = false;
};

// Collective. Every parameter managed at or below `root` as one full tensor (gathered from the
// shards, one all-gather per parameter, in registration order), then every buffer of root's
// module (this rank's values), named as the unsharded model names them (named_parameters() and
// named_buffers()). Tensors are new CPU tensors, detached. A parameter tied within a group appears
// once, under its first name. REQUIRES: not inside a forward or backward.
StateDict full_state_dict(const FSDPModule& root, const StateDictOptions& options = {});

// Collective: every rank calls it at the same point (one small agreement round, so that a rank
// calling it alone stops every rank by name; no tensor crosses ranks). Copies each rank's rows of
// every parameter from `dict` into its shard, and every buffer whole. Strict: names missing from
// `dict`, names the model does not have and shape mismatches are one error listing them all, raised
// before anything is copied. Values are converted to the model's dtypes (as torch's load_state_dict
// does). Every rank passes the full dictionary (e.g. read from the same file).
void load_full_state_dict(const FSDPModule& root, const StateDict& dict);

// The defined buffers of root's module, by name relative to it (named_buffers order).
std::vector<std::pair<std::string, at::Tensor>> named_buffers(const FSDPModule& root);

// Collective (one small all-gather, skipped when root was sharded with
// ShardOptions::broadcast_buffers, whose next forward makes every rank's buffers rank 0's again):
// compares every buffer's checksum with rank 0's. When some differ, rank 0 writes one warning to
// TORCH_WARN naming the first, the rank, `what` (e.g. "checkpoint save keeps rank 0's values") and
// the fix; returns that buffer's name on every rank, or nullopt when all agree.
std::optional<std::string> check_buffers_agree(const FSDPModule& root, const std::string& what);

}  // namespace fsdp
