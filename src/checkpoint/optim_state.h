// Optimizer state in checkpoints: which torch::optim optimizers the format knows, the state of a
// parameter shard as rows to save, and the state read back into the optimizer on load. Internal
// to the checkpoint code. Thread-safety: as the public API.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/fully_shard.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace fsdp::checkpoint::internal {

class CheckpointReader;

enum class OptKind {
  kNone,   // no optimizer state saved / loaded
  kAdamW,  // torch::optim::AdamW, and fsdp::optim::AdamW (derived: the same state layout)
  kAdam,   // torch::optim::Adam
  kSGD,    // torch::optim::SGD, and fsdp::optim::SGD (derived: the same state layout)
};

// The kind of `opt` (kNone for null); throws for an optimizer the format does not know.
OptKind kind_of(torch::optim::Optimizer* opt);
// "adamw", "adam", "sgd" or "none": the index's "optimizer".
const char* kind_name(OptKind k);

// The state of one parameter shard: row-sharded tensors by suffix, and the step count.
void state_of(torch::optim::Optimizer* opt, OptKind kind, const at::Tensor& shard,
              std::vector<std::pair<std::string, at::Tensor>>* rows, std::optional<int64_t>* step);

// The optimizer state of every shard from the checkpoint (a parameters-only checkpoint leaves
// the optimizer untouched); `where` starts each error message.
void load_optimizer(torch::optim::Optimizer* opt, OptKind kind,
                    const std::vector<ShardInfo>& shards, CheckpointReader& rd,
                    const std::string& where);

}  // namespace fsdp::checkpoint::internal
