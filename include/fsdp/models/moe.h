// A mixture-of-experts GPT for examples and benchmarks: token and position embeddings, then per
// layer a GPT block (attention and MLP, fsdp::models::Block) and an expert layer (a router and E
// experts, each a 4x GELU MLP, top-k routing with softmax weights over the chosen scores, a
// residual around it); the head is tied to the token embedding. Each block and each expert is
// declared fsdp::Sharded<...>, so fully_shard can give every expert a group of its own; a rank
// then calls only the experts its tokens are routed to. Thread-safety: as any torch::nn module.
#pragma once

#include <fsdp/fully_shard.h>
#include <fsdp/models/gpt.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <vector>

namespace fsdp::models {

struct MoEConfig {
  int64_t vocab_size = 256;
  int64_t tokens = 4;  // sequence length
  int64_t layers = 2;
  int64_t width = 64;
  int64_t heads = 2;
  int64_t experts = 16;
  int64_t top_k = 2;
  Attention attention = Attention::kFused;  // the blocks' (fsdp::models::Attention)
  // Throws fsdp::Error naming the offending field.
  void validate() const;
};

class ExpertImpl : public torch::nn::Module {
 public:
  explicit ExpertImpl(int64_t width);
  torch::Tensor forward(const torch::Tensor& x);  // (N, C) -> (N, C)
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Expert);

class MoELayerImpl : public torch::nn::Module {
 public:
  explicit MoELayerImpl(const MoEConfig& cfg);
  // (N, C) -> (N, C): h + the routed experts' weighted outputs. An expert that none of the tokens
  // chose is not called, unless force_all (then it runs on an empty batch, as FSDP2 requires).
  torch::Tensor forward(const torch::Tensor& h);

  int64_t top_k = 1;
  bool force_all = false;
  int64_t calls = 0;  // expert calls so far
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear router{nullptr};
  std::vector<fsdp::Sharded<Expert>> experts;
};
TORCH_MODULE(MoELayer);

class MoEGPTImpl : public torch::nn::Module {
 public:
  // Initialises deterministically from the current torch::manual_seed.
  explicit MoEGPTImpl(const MoEConfig& cfg);
  // (1, T) token ids and targets -> the mean next-token cross-entropy.
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& targets);
  void set_force_all(bool on);
  int64_t expert_calls() const;

  MoEConfig cfg;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::vector<fsdp::Sharded<Block>> blocks;
  std::vector<MoELayer> moes;
};
TORCH_MODULE(MoEGPT);

// Shards every block and every expert (one group each), then the root (embeddings, routers,
// LayerNorms), declared calls_may_differ (each rank calls only its routed experts). Returns the
// root handle.
FSDPModule shard_moe_gpt(fsdp::Sharded<MoEGPT>& model, std::shared_ptr<Communicator> comm,
                         const ShardOptions& options = {});

}  // namespace fsdp::models
