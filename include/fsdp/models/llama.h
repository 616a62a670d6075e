// A Llama-architecture language model (Llama 2/3, TinyLlama, SmolLM, ...): token embedding,
// pre-RMSNorm decoder layers of grouped-query causal self-attention with rotary position
// embeddings and a SwiGLU MLP, a final RMSNorm, and an output head (tied to the embedding or its
// own). It computes what transformers' LlamaForCausalLM computes (docs/guide.md, "Hugging Face
// models"), with the same parameter names (model.embed_tokens.weight,
// model.layers.0.self_attn.q_proj.weight, ..., lm_head.weight), so a Hugging Face checkpoint maps
// one to one (fsdp/hf.h). Each decoder layer is declared fsdp::Sharded, so fully_shard gives it a
// group of its own (shard_llama). Attention runs through at::scaled_dot_product_attention where
// LibTorch has it. No biases, no dropout, no buffers (the rotary tables are computed per forward).
// Thread-safety: as any torch::nn module.
#pragma once

#include <fsdp/fully_shard.h>
#include <fsdp/models/llama_config.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <utility>

namespace fsdp::models {

// x / sqrt(mean(x^2) + eps) * weight, normalised in fp32 (transformers' LlamaRMSNorm).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// The rotary tables (cos, sin), each (T, D), for positions 0..T-1: inv_freq from theta and the
// rope scaling, frequencies repeated over both halves of a head (transformers' layout).
std::pair<torch::Tensor, torch::Tensor> rotary_tables(const LlamaConfig& cfg, int64_t T,
                                                      const torch::TensorOptions& options);
// The inverse frequencies (D / 2) of the config's rope type, in fp32.
torch::Tensor rope_inv_freq(const LlamaConfig& cfg);

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const LlamaConfig& cfg);
  // x (B, T, C), cos/sin (T, D) -> (B, T, C).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  int64_t heads, kv_heads, head_dim;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public torch::nn::Module {
 public:
  explicit LlamaMLPImpl(const LlamaConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x);  // down(silu(gate(x)) * up(x))
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit LlamaDecoderLayerImpl(const LlamaConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

// transformers' LlamaModel: the embedding, the layers, the final norm (registered as "model").
class LlamaModelImpl : public torch::nn::Module {
 public:
  explicit LlamaModelImpl(const LlamaConfig& cfg);
  torch::nn::Embedding embed_tokens{nullptr};
  std::vector<fsdp::Sharded<LlamaDecoderLayer>> layers;  // registered as layers.0, layers.1, ...
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

class LlamaImpl : public torch::nn::Module {
 public:
  // Initialises deterministically from the current torch::manual_seed (init_weights).
  explicit LlamaImpl(const LlamaConfig& cfg);
  // (B, T) int64 token ids -> (B, T, vocab) logits.
  torch::Tensor forward(const torch::Tensor& idx);
  // Mean cross-entropy of next-token prediction: logits(idx) against targets (B, T).
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& targets);
  // transformers' initialisation: every Linear and the embedding N(0, 0.02), norms 1 (and the
  // padding row 0); draws in registration order from torch's default generator.
  void init_weights();

  LlamaConfig cfg;
  LlamaModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null when cfg.tie_word_embeddings
  // Called with i just before layer i runs in forward (a manual prefetch). Empty: nothing.
  std::function<void(size_t)> before_block;
};
TORCH_MODULE(Llama);

// Shards every decoder layer, then the root (embedding, final norm, head). Returns the root handle.
FSDPModule shard_llama(fsdp::Sharded<Llama>& model, std::shared_ptr<Communicator> comm,
                       const ShardOptions& block_options = {},
                       const ShardOptions& root_options = {});

}  // namespace fsdp::models
