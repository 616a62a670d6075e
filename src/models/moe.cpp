#include <fsdp/models/moe.h>
#include <torch/torch.h>

namespace fsdp::models {

void MoEConfig::validate() const {
  auto positive = [](const char* name, int64_t v) {
    FSDP_CHECK(v > 0, "MoE config: ", name, " must be positive, got ", v);
  };
  positive("vocab_size", vocab_size);
  positive("tokens", tokens);
  positive("layers", layers);
  positive("width", width);
  positive("heads", heads);
  positive("experts", experts);
  FSDP_CHECK(top_k >= 1 && top_k <= experts, "MoE config: top_k must be between 1 and experts (",
             experts, "), got ", top_k);
  FSDP_CHECK(width % heads == 0, "MoE config: width ", width, " is not divisible by heads ", heads);
}

ExpertImpl::ExpertImpl(int64_t c) {
  fc1 = register_module("fc1", torch::nn::Linear(c, 4 * c));
  fc2 = register_module("fc2", torch::nn::Linear(4 * c, c));
}

torch::Tensor ExpertImpl::forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }

MoELayerImpl::MoELayerImpl(const MoEConfig& cfg) : top_k(cfg.top_k) {
  ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.width})));
  router = register_module(
      "router", torch::nn::Linear(torch::nn::LinearOptions(cfg.width, cfg.experts).bias(false)));
  for (int64_t e = 0; e < cfg.experts; ++e)
    experts.push_back(register_module("expert" + std::to_string(e), Expert(cfg.width)));
}

torch::Tensor MoELayerImpl::forward(const torch::Tensor& h) {
  auto x = ln(h);
  auto top = router(x).topk(top_k, -1);
  auto weights = torch::softmax(std::get<0>(top), -1);
  const auto& chosen = std::get<1>(top);  // (N, k)
  auto out = torch::zeros_like(x);
  for (size_t e = 0; e < experts.size(); ++e) {
    auto hit = chosen.eq(static_cast<int64_t>(e));
    auto rows = hit.any(-1).nonzero().squeeze(1);
    if (rows.numel() == 0 && !force_all) continue;  // no token chose expert e: not called
    ++calls;
    auto w = (weights * hit).sum(-1).index_select(0, rows).unsqueeze(1);
    out = out.index_add(0, rows, experts[e](x.index_select(0, rows)) * w);
  }
  return h + out;
}

MoEGPTImpl::MoEGPTImpl(const MoEConfig& config) : cfg(config) {
  cfg.validate();
  GPTConfig block;
  block.seq_len = cfg.tokens;
  block.n_embd = cfg.width;
  block.n_head = cfg.heads;
  block.n_layer = cfg.layers;
  block.attention = cfg.attention;
  wte = register_module("wte", torch::nn::Embedding(cfg.vocab_size, cfg.width));
  wpe = register_module("wpe", torch::nn::Embedding(cfg.tokens, cfg.width));
  for (int64_t l = 0; l < cfg.layers; ++l) {
    blocks.push_back(register_module("block" + std::to_string(l), Block(block)));
    moes.push_back(register_module("moe" + std::to_string(l), MoELayer(cfg)));
  }
  torch::NoGradGuard no_grad;  // GPT-2's scale: the tied head starts near uniform logits
  wte->weight.normal_(0.0, 0.02);
  wpe->weight.normal_(0.0, 0.02);
}

torch::Tensor MoEGPTImpl::forward(const torch::Tensor& idx, const torch::Tensor& targets) {
  auto h = wte(idx) + wpe(torch::arange(idx.size(1), idx.options().dtype(torch::kLong)));
  for (size_t l = 0; l < blocks.size(); ++l) h = moes[l](blocks[l](h).squeeze(0)).unsqueeze(0);
  auto logits = h.squeeze(0).matmul(wte->weight.t());
  return torch::nn::functional::cross_entropy(logits, targets.reshape({-1}));
}

void MoEGPTImpl::set_force_all(bool on) {
  for (auto& m : moes) m->force_all = on;
}

int64_t MoEGPTImpl::expert_calls() const {
  int64_t n = 0;
  for (const auto& m : moes) n += m->calls;
  return n;
}

FSDPModule shard_moe_gpt(fsdp::Sharded<MoEGPT>& model, std::shared_ptr<Communicator> comm,
                         const ShardOptions& options) {
  for (auto& b : model->blocks) fully_shard(b, comm, options);
  for (auto& m : model->moes)
    for (auto& e : m->experts) fully_shard(e, comm, options);  // one group per expert
  // Each rank calls the experts its tokens chose: inside the model's forward the ranks' calls
  // differ ([Note: calls that differ between ranks]).
  ShardOptions root = options;
  root.runtime.calls_may_differ = true;
  return fully_shard(model, comm, root);
}

}  // namespace fsdp::models
