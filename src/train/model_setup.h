// The model and optimizer of fsdp-train, built one way for the trainer and for fsdp-bench's
// training modes (so the benchmark times the trainer's step): the GPT of docs/trainer.md sections
// 3-4 from the settings, sharded with fully_shard (one group per block, the root another) or
// plain, and AdamW with weight decay on the 2-D weights only (section 5).
// Thread-safety: call from the thread that trains.
#pragma once

#include <fsdp/fully_shard.h>
#include <fsdp/models/gpt.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <vector>

#include "train/config.h"

namespace fsdp::train {

struct TrainModel {
  fsdp::Sharded<models::GPT> gpt{nullptr};
  FSDPModule root;                   // undefined when built without a communicator
  std::vector<at::Tensor> decay;     // 2-D weights (local shards when sharded): weight decay
  std::vector<at::Tensor> no_decay;  // biases and LayerNorm parameters
  int64_t parameter_count = 0;       // of the full model
  bool sharded() const { return root.defined(); }
};

// Seeds torch with cfg.seed, builds the GPT (layers, heads, width, seq, vocab) and, when `comm` is
// non-null, shards it (blocks with cfg.reshard_after_forward). Every rank gets the same initial
// weights. Throws fsdp::Error for invalid sizes.
std::unique_ptr<TrainModel> build_model(const TrainConfig& cfg,
                                        const std::shared_ptr<Communicator>& comm);

// AdamW(lr, beta1, beta2, eps) with two groups: decay (cfg.weight_decay) and no_decay (0).
std::unique_ptr<torch::optim::AdamW> build_optimizer(const TrainConfig& cfg, TrainModel& m);

}  // namespace fsdp::train
