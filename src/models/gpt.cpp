#include <fsdp/models/gpt.h>
#include <torch/torch.h>

#include <cmath>

#include "compat/attention.h"

namespace fsdp::models {

torch::Tensor causal_self_attention(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, Attention how) {
  if (how == Attention::kFused && compat::has_scaled_dot_product_attention())
    return compat::scaled_dot_product_attention(q, k, v, /*is_causal=*/true);
  const int64_t T = q.size(-2), hd = q.size(-1);
  auto att = q.matmul(k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  auto mask =
      torch::ones({T, T}, q.options().dtype(torch::kBool)).triu(1);  // (T, T) future positions
  att = torch::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
  return att.matmul(v);  // (B, nh, T, hd)
}

void GPTConfig::validate() const {
  auto positive = [](const char* name, int64_t v) {
    FSDP_CHECK(v > 0, "GPT config: ", name, " must be positive, got ", v);
  };
  positive("vocab_size", vocab_size);
  positive("seq_len", seq_len);
  positive("n_layer", n_layer);
  positive("n_head", n_head);
  positive("n_embd", n_embd);
  FSDP_CHECK(n_embd % n_head == 0, "GPT config: width n_embd=", n_embd,
             " is not divisible by the number of heads n_head=", n_head,
             "; choose a width that is a multiple of the heads");
}

BlockImpl::BlockImpl(const GPTConfig& cfg) : n_head(cfg.n_head), attention(cfg.attention) {
  const int64_t c = cfg.n_embd;
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
  c_attn = register_module("c_attn", torch::nn::Linear(c, 3 * c));
  c_proj = register_module("c_proj", torch::nn::Linear(c, c));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
  c_fc = register_module("c_fc", torch::nn::Linear(c, 4 * c));
  mlp_proj = register_module("mlp_proj", torch::nn::Linear(4 * c, c));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / n_head;
  auto qkv = c_attn(ln_1(x)).split(C, /*dim=*/2);  // 3 x (B, T, C)
  auto heads = [&](const torch::Tensor& t) {
    return t.view({B, T, n_head, hd}).transpose(1, 2);  // (B, nh, T, hd)
  };
  auto y = causal_self_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), attention)
               .transpose(1, 2)
               .contiguous()
               .view({B, T, C});
  auto h = x + c_proj(y);
  return h + mlp_proj(torch::gelu(c_fc(ln_2(h)), "tanh"));
}

GPTImpl::GPTImpl(const GPTConfig& config) : cfg(config) {
  cfg.validate();
  wte = register_module("wte", torch::nn::Embedding(cfg.vocab_size, cfg.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(cfg.seq_len, cfg.n_embd));
  auto h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layer; ++i) {
    blocks.emplace_back(Block(cfg));
    h->push_back(blocks.back().ptr());
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.n_embd})));
  init_weights();
}

void GPTImpl::init_weights() {
  torch::NoGradGuard no_grad;
  const double std = 0.02, proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg.n_layer));
  wte->weight.normal_(0.0, std);
  wpe->weight.normal_(0.0, std);
  for (auto& b : blocks) {
    for (auto* lin : {&b->c_attn, &b->c_proj, &b->c_fc, &b->mlp_proj}) {
      const bool residual = lin == &b->c_proj || lin == &b->mlp_proj;
      (*lin)->weight.normal_(0.0, residual ? proj_std : std);
      (*lin)->bias.zero_();
    }
    for (auto* ln : {&b->ln_1, &b->ln_2}) {
      (*ln)->weight.fill_(1.0);
      (*ln)->bias.zero_();
    }
  }
  ln_f->weight.fill_(1.0);
  ln_f->bias.zero_();
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  const int64_t T = idx.size(1);
  FSDP_CHECK(T <= cfg.seq_len, "GPT: sequence of ", T, " tokens exceeds seq_len ", cfg.seq_len);
  auto pos = torch::arange(T, idx.options().dtype(torch::kLong));
  auto x = wte(idx) + wpe(pos);  // (B, T, C)
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (before_block) before_block(i);
    x = blocks[i](x);
  }
  x = ln_f(x);
  return x.matmul(wte->weight.t());  // (B, T, V), tied head
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx, const torch::Tensor& targets) {
  auto logits = forward(idx);
  return torch::nn::functional::cross_entropy(logits.view({-1, cfg.vocab_size}),
                                              targets.reshape({-1}));
}

FSDPModule shard_gpt(fsdp::Sharded<GPT>& model, std::shared_ptr<Communicator> comm,
                     const ShardOptions& block_options, const ShardOptions& root_options) {
  for (auto& b : model->blocks) fully_shard(b, comm, block_options);
  return fully_shard(model, comm, root_options);
}

}  // namespace fsdp::models
