// The Llama model (llama.h). Every formula follows transformers' modeling_llama.py operation by
// operation (the same fp32 kernels give the same bits where LibTorch has them), so that logits
// agree within 1e-5 (tests/hf_parity_test.cpp).
#include <fsdp/models/llama.h>
#include <torch/torch.h>

#include <cmath>

#include "compat/attention.h"

namespace fsdp::models {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  const auto h = x.to(torch::kFloat);
  const auto variance = h.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (h * torch::rsqrt(variance + eps)).to(x.scalar_type());
}

torch::Tensor rope_inv_freq(const LlamaConfig& cfg) {
  const int64_t d = cfg.dim_per_head();
  // 1 / theta^(2i / D), as transformers: pow in fp32, then the reciprocal.
  const auto exponents =
      torch::arange(0, d, 2, torch::kLong).to(torch::kFloat) / static_cast<double>(d);
  auto inv_freq = torch::pow(cfg.rope_theta, exponents).reciprocal();
  const RopeScaling& r = cfg.rope_scaling;
  if (r.type == "linear") return inv_freq / r.factor;
  if (r.type != "llama3") return inv_freq;
  // Llama 3.1: wavelengths beyond the original context / low_freq_factor are stretched by
  // `factor`, those below it / high_freq_factor kept, and a linear ramp in between.
  const double old_len = static_cast<double>(r.original_max_position_embeddings);
  const double low_wavelen = old_len / r.low_freq_factor,
               high_wavelen = old_len / r.high_freq_factor;
  const auto wavelen = inv_freq.reciprocal() * (2 * M_PI);
  auto scaled = torch::where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq);
  const auto smooth = (wavelen.reciprocal() * old_len - r.low_freq_factor) /
                      (r.high_freq_factor - r.low_freq_factor);
  const auto smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  const auto medium =
      (wavelen < high_wavelen).logical_not() * (wavelen > low_wavelen).logical_not();
  return torch::where(medium, smoothed, scaled);
}

std::pair<torch::Tensor, torch::Tensor> rotary_tables(const LlamaConfig& cfg, int64_t T,
                                                      const torch::TensorOptions& options) {
  const auto pos = torch::arange(T, torch::kLong).to(torch::kFloat).unsqueeze(1);  // (T, 1)
  const auto freqs = pos * rope_inv_freq(cfg).unsqueeze(0);                        // (T, D/2)
  const auto emb = torch::cat({freqs, freqs}, -1);                                 // (T, D)
  return {emb.cos().to(options), emb.sin().to(options)};
}

namespace {

// (x1, x2) -> (-x2, x1) over the two halves of the last dim.
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

}  // namespace

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& cfg)
    : heads(cfg.num_attention_heads), kv_heads(cfg.kv_heads()), head_dim(cfg.dim_per_head()) {
  const int64_t c = cfg.hidden_size;
  q_proj = register_module("q_proj", linear(c, heads * head_dim));
  k_proj = register_module("k_proj", linear(c, kv_heads * head_dim));
  v_proj = register_module("v_proj", linear(c, kv_heads * head_dim));
  o_proj = register_module("o_proj", linear(heads * head_dim, c));
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                          const torch::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1);
  auto split_heads = [&](const torch::Tensor& t) {
    return t.view({B, T, -1, head_dim}).transpose(1, 2);  // (B, heads, T, D)
  };
  auto q = split_heads(q_proj(x)), k = split_heads(k_proj(x)), v = split_heads(v_proj(x));
  q = q * cos + rotate_half(q) * sin;  // cos, sin (T, D) broadcast over (B, heads)
  k = k * cos + rotate_half(k) * sin;
  const auto y = compat::causal_attention(q, k, v);  // (B, H, T, D)
  return o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& cfg) {
  const int64_t c = cfg.hidden_size, f = cfg.ffn();
  gate_proj = register_module("gate_proj", linear(c, f));
  up_proj = register_module("up_proj", linear(c, f));
  down_proj = register_module("down_proj", linear(f, c));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& x) {
  return down_proj(torch::silu(gate_proj(x)) * up_proj(x));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& cfg) {
  // transformers' registration order: the parameter order of checkpoints and initialisation.
  self_attn = register_module("self_attn", LlamaAttention(cfg));
  mlp = register_module("mlp", LlamaMLP(cfg));
  input_layernorm = register_module("input_layernorm", RMSNorm(cfg.hidden_size, cfg.rms_norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(cfg.hidden_size, cfg.rms_norm_eps));
}

torch::Tensor LlamaDecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                             const torch::Tensor& sin) {
  const auto h = x + self_attn(input_layernorm(x), cos, sin);
  return h + mlp(post_attention_layernorm(h));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& cfg) {
  auto options = torch::nn::EmbeddingOptions(cfg.vocab_size, cfg.hidden_size);
  if (cfg.pad_token_id) options.padding_idx(*cfg.pad_token_id);
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(options));
  auto list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    layers.emplace_back(LlamaDecoderLayer(cfg));
    list->push_back(layers.back().ptr());
  }
  norm = register_module("norm", RMSNorm(cfg.hidden_size, cfg.rms_norm_eps));
}

LlamaImpl::LlamaImpl(const LlamaConfig& config) : cfg(config) {
  cfg.validate();
  model = register_module("model", LlamaModel(cfg));
  if (!cfg.tie_word_embeddings)
    lm_head = register_module("lm_head", linear(cfg.hidden_size, cfg.vocab_size));
  init_weights();
}

void LlamaImpl::init_weights() {
  torch::NoGradGuard no_grad;
  const double std = 0.02;  // transformers' initializer_range
  model->embed_tokens->weight.normal_(0.0, std);
  if (cfg.pad_token_id) model->embed_tokens->weight[*cfg.pad_token_id].zero_();
  for (auto& layer : model->layers) {
    auto& a = layer->self_attn;
    auto& m = layer->mlp;
    for (auto* lin : {&a->q_proj, &a->k_proj, &a->v_proj, &a->o_proj, &m->gate_proj, &m->up_proj,
                      &m->down_proj})
      (*lin)->weight.normal_(0.0, std);
    layer->input_layernorm->weight.fill_(1.0);
    layer->post_attention_layernorm->weight.fill_(1.0);
  }
  model->norm->weight.fill_(1.0);
  if (lm_head) lm_head->weight.normal_(0.0, std);
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& idx) {
  const int64_t T = idx.size(1);
  auto x = model->embed_tokens(idx);  // (B, T, C)
  const auto [cos, sin] = rotary_tables(cfg, T, x.options());
  for (size_t i = 0; i < model->layers.size(); ++i) {
    if (before_block) before_block(i);
    x = model->layers[i](x, cos, sin);
  }
  x = model->norm(x);
  const auto& head = lm_head ? lm_head->weight : model->embed_tokens->weight;
  return x.matmul(head.t());  // (B, T, V)
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& idx, const torch::Tensor& targets) {
  auto logits = forward(idx);
  return torch::nn::functional::cross_entropy(logits.view({-1, cfg.vocab_size}),
                                              targets.reshape({-1}));
}

FSDPModule shard_llama(fsdp::Sharded<Llama>& model, std::shared_ptr<Communicator> comm,
                       const ShardOptions& block_options, const ShardOptions& root_options) {
  for (auto& layer : model->model->layers) fully_shard(layer, comm, block_options);
  return fully_shard(model, comm, root_options);
}

}  // namespace fsdp::models
