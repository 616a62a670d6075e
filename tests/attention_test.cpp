// The models' attention through at::scaled_dot_product_attention (fsdp::models::Attention::kFused)
// against the written-out form it replaced (issue 50, item 5): the same mathematics, so in fp64
// the two agree within rounding (outputs and gradients, attention alone and the whole GPT), and
// training the trainer's model with the trainer's AdamW gives the same losses within 1e-5. On
// LibTorch 1.13, which lacks the fused function, kFused is the written-out form (src/compat/
// attention.h) and the comparisons hold exactly.
#include <fsdp/models/gpt.h>
#include <fsdp/models/moe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::attention_test {
namespace {

using models::Attention;
using models::causal_self_attention;
using models::GPT;
using models::GPTConfig;
using models::MoEConfig;
using models::MoEGPT;

// The oracle: softmax(q k^T / sqrt(hd), future positions masked) v, written here independently
// of the library's own written-out path.
torch::Tensor reference_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v) {
  const int64_t T = q.size(2);
  auto scores = torch::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(q.size(3)));
  auto future = torch::arange(T).unsqueeze(0) > torch::arange(T).unsqueeze(1);  // (T, T): j > i
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(scores, -1), v);
}

// The largest difference relative to the largest element of b, or to 1 where b is smaller (the
// gradients of q and k are zeros with one position; the inputs are of order 1).
double max_rel(const torch::Tensor& a, const torch::Tensor& b) {
  const double diff = (a - b).abs().max().item<double>();
  return diff == 0 ? 0.0 : diff / std::max(b.abs().max().item<double>(), 1.0);
}

TEST(Attention, FusedEqualsWrittenOutInFp64WithinRounding) {
  torch::manual_seed(7);
  for (auto [B, H, T, hd] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{2, 3, 7, 5}, {1, 4, 33, 16}, {3, 2, 1, 8}}) {
    auto opts = torch::dtype(torch::kDouble).requires_grad(true);
    auto q = torch::randn({B, H, T, hd}, opts), k = torch::randn({B, H, T, hd}, opts),
         v = torch::randn({B, H, T, hd}, opts);
    auto w = torch::randn({B, H, T, hd}, torch::kDouble);  // a loss that weighs every output
    auto fused = causal_self_attention(q, k, v, Attention::kFused);
    auto gf = torch::autograd::grad({(fused * w).sum()}, {q, k, v});
    auto ref = reference_attention(q, k, v);
    auto gr = torch::autograd::grad({(ref * w).sum()}, {q, k, v});
    const double out = max_rel(fused, ref);
    double grad = 0;
    for (int i = 0; i < 3; ++i) grad = std::max(grad, max_rel(gf[i], gr[i]));
    std::cout << "attention (" << B << ", " << H << ", " << T << ", " << hd
              << ") fp64: fused against written out, output " << out << ", gradients " << grad
              << " (relative to the largest element)\n";
    // fp64 rounding of a softmax over T terms: a few ulps (2.2e-16 each).
    EXPECT_LE(out, 1e-14);
    EXPECT_LE(grad, 1e-13);
    // The library's own written-out path is the same form.
    EXPECT_LE(max_rel(causal_self_attention(q, k, v, Attention::kWrittenOut), ref), 1e-15);
  }
}

GPTConfig small_config(Attention how) {
  GPTConfig c;
  c.vocab_size = 64, c.seq_len = 16, c.n_layer = 2, c.n_head = 4, c.n_embd = 32;
  c.attention = how;
  return c;
}

TEST(Attention, GptInFp64WithinRounding) {
  torch::manual_seed(3);
  auto idx = torch::randint(0, 64, {2, 16}, torch::kLong);
  auto targets = torch::randint(0, 64, {2, 16}, torch::kLong);
  std::vector<torch::Tensor> logits, grads;
  for (auto how : {Attention::kFused, Attention::kWrittenOut}) {
    torch::manual_seed(11);
    GPT gpt(small_config(how));
    gpt->to(torch::kDouble);
    auto out = gpt->forward(idx);
    torch::nn::functional::cross_entropy(out.view({-1, 64}), targets.view({-1})).backward();
    logits.push_back(out.detach());
    std::vector<torch::Tensor> g;
    for (auto& p : gpt->parameters()) g.push_back(p.grad().flatten());
    grads.push_back(torch::cat(g));
  }
  const double out = max_rel(logits[0], logits[1]), grad = max_rel(grads[0], grads[1]);
  std::cout << "GPT fp64: fused against written out, logits " << out << ", gradients " << grad
            << "\n";
  EXPECT_LE(out, 1e-13);
  EXPECT_LE(grad, 1e-12);
}

// fsdp-train's model, AdamW and schedule (src/train/config.h defaults: 4 layers, width 128, 4
// heads, seq 64; lr 3e-3 reached by a linear warmup over 30 steps, betas 0.9/0.95, weight decay
// 0.1 on the 2-D weights) for its first 30 steps in fp32.
std::vector<double> train_losses(Attention how, int steps) {
  constexpr int kRows = 16;  // the trainer's global batch
  GPTConfig c;
  c.vocab_size = 256, c.seq_len = 64, c.n_layer = 4, c.n_head = 4, c.n_embd = 128;
  c.attention = how;
  torch::manual_seed(1337);
  GPT gpt(c);
  std::vector<torch::Tensor> decay, no_decay;
  for (auto& p : gpt->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  auto opts = torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(opts).weight_decay(0.1)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(opts).weight_decay(0.0)));
  torch::optim::AdamW opt(std::move(groups), opts);
  // The shipped corpus (bytes), 16 windows of 65 at random offsets per step: text that the model
  // learns, so that the losses fall.
  std::ifstream in(std::string(FSDP_SOURCE_DIR) + "/data/corpus.txt", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_GT(text.size(), 100000u);
  auto corpus = torch::from_blob(text.data(), {static_cast<int64_t>(text.size())}, torch::kUInt8)
                    .to(torch::kLong);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    for (auto& g : opt.param_groups())
      static_cast<torch::optim::AdamWOptions&>(g.options()).lr(3e-3 * (s + 1) / 30);
    auto starts = at::randint(0, corpus.size(0) - 65, {kRows}, gen, at::kLong);
    std::vector<torch::Tensor> rows;
    for (int r = 0; r < kRows; ++r) rows.push_back(corpus.narrow(0, starts[r].item<int64_t>(), 65));
    auto tokens = torch::stack(rows);
    auto loss = gpt->forward(tokens.narrow(1, 0, 64), tokens.narrow(1, 1, 64));
    loss.backward();
    opt.step();
    opt.zero_grad();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

TEST(Attention, TrainerModelLossesWithin1e5) {
  const int steps = 30;
  auto fused = train_losses(Attention::kFused, steps);
  auto written = train_losses(Attention::kWrittenOut, steps);
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    const double rel = std::abs(fused[s] - written[s]) / std::abs(written[s]);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-5) << "step " << s + 1 << ": fused " << fused[s] << ", written out "
                         << written[s];
  }
  std::cout << "trainer's GPT, 30 AdamW steps in fp32: losses " << written.front() << " -> "
            << written.back() << ", fused against written out at most " << worst << " relative\n";
  // The steps train: the comparison is not between two untrained models.
  EXPECT_LT(written.back(), written.front() - 1.0);
}

TEST(Attention, MoEBlocksTakeTheConfiguredAttention) {
  // The MoE GPT's blocks are GPT blocks: the setting reaches them, and both forms give the same
  // loss within fp64 rounding.
  std::vector<double> losses;
  for (auto how : {Attention::kFused, Attention::kWrittenOut}) {
    MoEConfig c;
    c.tokens = 12, c.experts = 4, c.top_k = 2, c.width = 32, c.heads = 4;
    c.attention = how;
    torch::manual_seed(5);
    MoEGPT moe(c);
    for (auto& b : moe->blocks) EXPECT_EQ(b->attention, how);
    moe->to(torch::kDouble);
    torch::manual_seed(6);
    auto idx = torch::randint(0, 256, {1, 12}, torch::kLong);
    auto targets = torch::randint(0, 256, {1, 12}, torch::kLong);
    losses.push_back(moe->forward(idx, targets).item<double>());
  }
  EXPECT_NEAR(losses[0], losses[1], 1e-13 * std::abs(losses[1]));
}

}  // namespace
}  // namespace fsdp::testing::attention_test
