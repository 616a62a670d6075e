// The model and optimizer of fsdp-train, built one way for the trainer and for fsdp-bench's
// training modes (so the benchmark times the trainer's step): the GPT of docs/trainer.md sections
// 3-4 from the settings, sharded with fully_shard (one group per block, the root another) or
// plain, and AdamW with weight decay on the 2-D weights only (section 5).
// Thread-safety: call from the thread that trains.
#pragma once

#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/models/gpt.h>
#include <fsdp/models/llama.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <string>
#include <vector>

#include "train/config.h"

namespace fsdp::train {

struct TrainModel {
  fsdp::Sharded<models::GPT> gpt{nullptr};      // --model gpt
  fsdp::Sharded<models::Llama> llama{nullptr};  // --model llama (gpt is null then)
  FSDPModule root;                              // undefined when built without a communicator
  DeviceMesh mesh;                   // --hsdp's layout; mesh.shard = the world for plain FSDP
  std::vector<at::Tensor> decay;     // 2-D weights (local shards when sharded): weight decay
  std::vector<at::Tensor> no_decay;  // biases and LayerNorm parameters
  int64_t parameter_count = 0;       // of the full model
  int64_t regathered_count = 0;      // sharded: parameters gathered again in backward
  bool sharded() const { return root.defined(); }
  // (B, T) token ids -> (B, T, vocab) logits, of whichever model this is.
  at::Tensor logits(const at::Tensor& idx);
  torch::nn::Module& module();
  // The ranks that hold one copy of the shards: what checkpoint save/load take (under HSDP the
  // replica, since replicas hold equal shards; metrics reduce over the world instead).
  Communicator& shard_group() const { return *mesh.shard; }
};

// Seeds torch with cfg.seed, builds the model of cfg.model (the GPT of layers, heads, width, seq,
// vocab, or the Llama of llama_config_of(cfg)) and, when `comm` is
// non-null, shards it over init_mesh(comm, cfg.hsdp) (blocks with cfg.reshard_after_forward, but
// the last, which backward needs first, never reshards after forward; blocks with
// cfg.activation_checkpointing; every group with cfg.mixed_precision's policy, the root casting
// its output to fp32 so the loss is fp32). Every rank gets the same initial weights. Collective
// over `comm` when cfg.hsdp > 1. Throws fsdp::Error for invalid sizes, an --hsdp that does not
// divide the world, or fp16 (no CPU kernels).
// `mesh`, when given, replaces init_mesh's (an elastic replica's, fsdp/elastic.h).
std::unique_ptr<TrainModel> build_model(const TrainConfig& cfg,
                                        const std::shared_ptr<Communicator>& comm,
                                        const DeviceMesh* mesh = nullptr);

// The MixedPrecisionPolicy of --mixed-precision (none: the empty policy, fp32 throughout) and
// --mixed-precision-reduce (`reduce`: param or fp32). `root`:
// also cast the output to fp32. Throws fsdp::Error for fp16 (LibTorch 1.13 has no CPU Half
// LayerNorm/matmul) or another name.
MixedPrecisionPolicy mixed_precision_policy(const std::string& name, const std::string& reduce,
                                            bool root);

// AdamW(lr, beta1, beta2, eps) with two groups: decay (cfg.weight_decay) and no_decay (0):
// fsdp::optim::AdamW (cfg.optimizer "fused"), or torch::optim::AdamW ("torch").
std::unique_ptr<torch::optim::AdamW> build_optimizer(const TrainConfig& cfg, TrainModel& m);

}  // namespace fsdp::train
