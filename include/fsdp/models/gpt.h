// A GPT-2-style language model for tests, benchmarks and fsdp-train (docs/trainer.md sections 3-4
// specify it precisely): token + position embeddings, pre-LayerNorm blocks of causal self-attention
// and a 4x GELU MLP, a final LayerNorm, and an output head tied to the token embedding. Each block
// is declared fsdp::Sharded<Block>, so fully_shard can give it its own group. Attention goes
// through at::scaled_dot_product_attention (fused kernels) where LibTorch has it. Thread-safety: as
// any torch::nn module.
#pragma once

#include <fsdp/fully_shard.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <functional>

namespace fsdp::models {

// How a block computes causal self-attention.
enum class Attention {
  // at::scaled_dot_product_attention (is_causal, default scale): flash or memory-efficient kernels
  // on CUDA, a fused kernel of the same mathematics on the CPU. On LibTorch 1.13, which lacks it,
  // the written-out form (src/compat/attention.h).
  kFused,
  // softmax(q k^T / sqrt(hd), future positions masked) v as separate operations: the form the
  // models had before, kept as the parity tests' reference.
  kWrittenOut,
};

// Causal self-attention of (B, heads, T, hd) queries, keys and values -> (B, heads, T, hd).
torch::Tensor causal_self_attention(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, Attention how = Attention::kFused);

struct GPTConfig {
  int64_t vocab_size = 256;  // byte-level tokens
  int64_t seq_len = 64;      // context length (position embedding rows)
  int64_t n_layer = 2;
  int64_t n_head = 2;
  int64_t n_embd = 64;
  Attention attention = Attention::kFused;
  // Throws fsdp::Error naming the offending field (non-positive sizes, n_embd % n_head != 0).
  void validate() const;
};

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x);  // (B, T, C) -> (B, T, C)

  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};  // attention: qkv in, output projection
  torch::nn::Linear c_fc{nullptr}, mlp_proj{nullptr};  // MLP: C -> 4C -> C
  int64_t n_head = 1;
  Attention attention = Attention::kFused;
};
TORCH_MODULE(Block);

class GPTImpl : public torch::nn::Module {
 public:
  // Initialises deterministically from the current torch::manual_seed (see init_weights).
  explicit GPTImpl(const GPTConfig& cfg);
  // (B, T) int64 token ids -> (B, T, vocab) logits.
  torch::Tensor forward(const torch::Tensor& idx);
  // Mean cross-entropy of next-token prediction: logits(idx) against targets (B, T).
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& targets);
  // GPT-2 initialisation: N(0, 0.02) weights, residual projections N(0, 0.02 / sqrt(2 * n_layer)),
  // zero biases, unit LayerNorm weights; draws in registration order from torch's default
  // generator.
  void init_weights();

  GPTConfig cfg;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::vector<fsdp::Sharded<Block>> blocks;  // registered as h.0, h.1, ...
  torch::nn::LayerNorm ln_f{nullptr};
  // Called with i just before blocks[i] runs in forward (e.g. a manual prefetch of block i + 1
  // through FSDPModule::unshard(true)). Empty: nothing.
  std::function<void(size_t)> before_block;
};
TORCH_MODULE(GPT);

// Shards every block, then the root, as docs/quickstart shows. Returns the root handle.
FSDPModule shard_gpt(fsdp::Sharded<GPT>& model, std::shared_ptr<Communicator> comm,
                     const ShardOptions& block_options = {}, const ShardOptions& root_options = {});

}  // namespace fsdp::models
