// A mixture-of-experts GPT in which each rank calls only the experts its tokens are routed to.
// Every expert is a sharded group of its own; a rank skips the experts that got none of its tokens,
// and fsdp-cpp still issues the same collectives on every rank (docs/design.md, [Note: calls that
// differ between ranks]).
//
//   build/bin/fsdp-run -n 2 build/bin/fsdp-moe                   train, loss per step
//   build/bin/fsdp-run -n 2 build/bin/fsdp-moe --check           and compare with the unsharded
//                                                                model on rank 0 (exit 1 > 1e-5)
//   build/bin/fsdp-run -n 2 build/bin/fsdp-moe --force-all       every expert called on every
//                                                                rank (FSDP2's requirement)
//   build/bin/fsdp-run -n 2 build/bin/fsdp-moe --bench           both, side by side
// Options: --experts E (16) --top-k K (2) --layers L (2) --width C (64) --tokens T (per rank, 4)
//          --steps S (10) --rounds R (3, --bench)
#include <fsdp/fsdp.h>
#include <fsdp/models/gpt.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr int64_t kVocab = 256;

struct Options {
  int64_t experts = 16, top_k = 2, layers = 2, width = 64, tokens = 4, steps = 10, rounds = 3;
  bool check = false, force_all = false, bench = false;
};

struct ExpertImpl : torch::nn::Module {
  explicit ExpertImpl(int64_t c)
      : fc1(register_module("fc1", torch::nn::Linear(c, 4 * c))),
        fc2(register_module("fc2", torch::nn::Linear(4 * c, c))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Expert);

// Top-k routing: each token goes to its k highest-scoring experts, weighted by the softmax of those
// scores. An expert with no token on this rank is not called (unless force_all).
struct MoEImpl : torch::nn::Module {
  MoEImpl(int64_t c, int64_t experts, int64_t k) : k(k) {
    router = register_module("router",
                             torch::nn::Linear(torch::nn::LinearOptions(c, experts).bias(false)));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
    for (int64_t e = 0; e < experts; ++e)
      this->experts.push_back(register_module("expert" + std::to_string(e), Expert(c)));
  }
  torch::Tensor forward(const torch::Tensor& h) {  // (N, C) -> (N, C)
    auto x = ln(h);
    auto top = router(x).topk(k, -1);
    auto weights = torch::softmax(std::get<0>(top), -1);
    const auto& chosen = std::get<1>(top);  // (N, k)
    auto out = torch::zeros_like(x);
    for (size_t e = 0; e < experts.size(); ++e) {
      auto hit = chosen.eq(static_cast<int64_t>(e));
      auto rows = hit.any(-1).nonzero().squeeze(1);
      if (rows.numel() == 0 && !force_all) continue;  // this rank's tokens skip expert e
      ++called;
      auto w = (weights * hit).sum(-1).index_select(0, rows).unsqueeze(1);
      out = out.index_add(0, rows, experts[e](x.index_select(0, rows)) * w);
    }
    return h + out;
  }
  int64_t k;
  bool force_all = false;
  int64_t called = 0;  // expert calls on this rank
  torch::nn::Linear router{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  std::vector<fsdp::Sharded<Expert>> experts;
};
TORCH_MODULE(MoE);

// Token and position embeddings, then per layer a GPT block (attention and MLP) and an expert
// layer; the head is tied to the token embedding.
struct MoEGPTImpl : torch::nn::Module {
  explicit MoEGPTImpl(const Options& o) {
    fsdp::models::GPTConfig cfg;
    cfg.seq_len = o.tokens;
    cfg.n_embd = o.width;
    cfg.n_head = 2;
    cfg.n_layer = o.layers;
    wte = register_module("wte", torch::nn::Embedding(kVocab, o.width));
    wpe = register_module("wpe", torch::nn::Embedding(o.tokens, o.width));
    for (int64_t l = 0; l < o.layers; ++l) {
      blocks.push_back(register_module("block" + std::to_string(l), fsdp::models::Block(cfg)));
      moes.push_back(register_module("moe" + std::to_string(l), MoE(o.width, o.experts, o.top_k)));
    }
    torch::NoGradGuard no_grad;  // GPT-2's scale: the tied head starts near uniform logits
    wte->weight.normal_(0.0, 0.02);
    wpe->weight.normal_(0.0, 0.02);
  }
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& targets) {  // (1, T)
    auto h = wte(idx) + wpe(torch::arange(idx.size(1), torch::kLong));
    for (size_t l = 0; l < blocks.size(); ++l) h = moes[l](blocks[l](h).squeeze(0)).unsqueeze(0);
    auto logits = h.squeeze(0).matmul(wte->weight.t());
    return torch::nn::functional::cross_entropy(logits, targets.reshape({-1}));
  }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::vector<fsdp::Sharded<fsdp::models::Block>> blocks;
  std::vector<MoE> moes;
};
TORCH_MODULE(MoEGPT);

// Rank r's tokens for `step`: the same on every run.
std::pair<torch::Tensor, torch::Tensor> batch(const Options& o, int rank, int64_t step) {
  torch::manual_seed(1000 * step + rank);
  auto seq = torch::randint(kVocab, {1, o.tokens + 1}, torch::kLong);
  return {seq.narrow(1, 0, o.tokens), seq.narrow(1, 1, o.tokens)};
}

torch::optim::AdamW optimizer(std::vector<torch::Tensor> params) {
  return torch::optim::AdamW(std::move(params), torch::optim::AdamWOptions(1e-3));
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> int64_t {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return std::stoll(argv[++i]);
    };
    if (a == "--experts")
      o.experts = value();
    else if (a == "--top-k")
      o.top_k = value();
    else if (a == "--layers")
      o.layers = value();
    else if (a == "--width")
      o.width = value();
    else if (a == "--tokens")
      o.tokens = value();
    else if (a == "--steps")
      o.steps = value();
    else if (a == "--rounds")
      o.rounds = value();
    else if (a == "--check")
      o.check = true;
    else if (a == "--force-all")
      o.force_all = true;
    else if (a == "--bench")
      o.bench = true;
    else
      throw std::runtime_error("unknown option " + a + " (see examples/moe.cpp)");
  }
  if (o.top_k < 1 || o.top_k > o.experts)
    throw std::runtime_error("--top-k must be between 1 and --experts");
  return o;
}

// The unsharded model on one process, every rank's batch in turn: the mean of the ranks' losses,
// as the sharded run computes it. Returns the loss per step.
std::vector<double> reference_losses(const Options& o, int world) {
  torch::manual_seed(0);
  MoEGPT model(o);
  auto opt = optimizer(model->parameters());
  std::vector<double> losses;
  for (int64_t step = 0; step < o.steps; ++step) {
    torch::Tensor total = torch::zeros({});
    for (int r = 0; r < world; ++r) {
      auto [x, y] = batch(o, r, step);
      total = total + model->forward(x, y) / world;
    }
    total.backward();
    // As sharded training defines it: a parameter no rank used has a zero gradient (AdamW then
    // still applies its weight decay), not none.
    for (auto& p : model->parameters())
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    opt.step();
    opt.zero_grad();
    losses.push_back(total.item<double>());
  }
  return losses;
}

fsdp::Sharded<MoEGPT> seeded_model(const Options& o) {
  torch::manual_seed(0);  // the same initial model on every rank
  return fsdp::Sharded<MoEGPT>(o);
}

struct ShardedMoE {
  fsdp::Sharded<MoEGPT> model;
  fsdp::FSDPModule root;
  ShardedMoE(const Options& o, const std::shared_ptr<fsdp::Communicator>& world)
      : model(seeded_model(o)) {
    for (auto& b : model->blocks) fsdp::fully_shard(b, world);
    for (auto& m : model->moes)
      for (auto& e : m->experts) fsdp::fully_shard(e, world);  // one group per expert
    root = fsdp::fully_shard(model, world);                    // embeddings, routers, LayerNorms
  }
  void force_all(bool on) {
    for (auto& m : model->moes) m->force_all = on;
  }
  int64_t expert_calls() const {
    int64_t n = 0;
    for (const auto& m : model->moes) n += m->called;
    return n;
  }
};

// One training step; returns the mean of the ranks' losses.
double step(ShardedMoE& s, torch::optim::Optimizer& opt, fsdp::Communicator& world,
            const Options& o, int64_t i) {
  auto [x, y] = batch(o, world.rank(), i);
  auto loss = s.model(x, y);
  loss.backward();
  opt.step();
  opt.zero_grad();
  auto mean = loss.detach().clone();
  world.all_reduce(mean, fsdp::ReduceOp::kSum).wait();
  return mean.item<double>() / world.size();
}

int train(const Options& o, const std::shared_ptr<fsdp::Communicator>& world) {
  ShardedMoE s(o, world);
  s.force_all(o.force_all);
  auto opt = optimizer(s.root.parameters());
  std::vector<double> losses;
  for (int64_t i = 0; i < o.steps; ++i) {
    losses.push_back(step(s, opt, *world, o, i));
    if (world->rank() == 0)
      std::cout << "step " << i << " loss " << losses.back() << " (expert calls on rank 0 so far "
                << s.expert_calls() << ")" << std::endl;
  }
  if (!o.check || world->rank() != 0) return 0;
  const auto want = reference_losses(o, world->size());
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(losses[i] - want[i]));
    std::cout << "step " << i << " loss " << losses[i] << " unsharded " << want[i] << "\n";
  }
  std::cout << "check: largest |loss - unsharded loss| over " << want.size() << " steps: " << worst
            << (worst <= 1e-5 ? " (within 1e-5)" : " (MORE THAN 1e-5)") << std::endl;
  return worst <= 1e-5 ? 0 : 1;
}

// Routed against forced, in interleaved rounds of `steps` steps on one model: step time, bytes and
// collectives per step (every lane of the world communicator), expert calls per rank and step.
int bench(const Options& o, const std::shared_ptr<fsdp::Communicator>& world) {
  ShardedMoE s(o, world);
  auto opt = optimizer(s.root.parameters());
  struct Figures {
    std::vector<double> seconds;
    double bytes = 0, collectives = 0, calls = 0;
  } fig[2];
  int64_t i = 0;
  for (int64_t round = 0; round < o.rounds; ++round)
    for (int forced = 0; forced < 2; ++forced) {
      s.force_all(forced == 1);
      step(s, opt, *world, o, i++);  // warm-up
      world->reset_stats();
      const int64_t calls0 = s.expert_calls();
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t k = 0; k < o.steps; ++k) step(s, opt, *world, o, i++);
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const auto st = world->total_stats();
      Figures& f = fig[forced];
      f.seconds.push_back(dt / o.steps);
      f.bytes += static_cast<double>(st.bytes_sent) / o.steps / o.rounds;
      f.collectives += static_cast<double>(st.collectives) / o.steps / o.rounds;
      f.calls += static_cast<double>(s.expert_calls() - calls0) / o.steps / o.rounds;
    }
  if (world->rank() != 0) return 0;
  std::cout
      << "| mode | step s (median [min, max]) | bytes sent per step (rank 0) | collectives per "
         "step | expert calls per step (rank 0, of "
      << o.experts * o.layers << ") |\n|---|---|---|---|---|\n";
  for (int forced = 0; forced < 2; ++forced) {
    auto v = fig[forced].seconds;
    std::sort(v.begin(), v.end());
    std::cout << "| " << (forced ? "every expert on every rank" : "routed experts only") << " | "
              << v[v.size() / 2] << " [" << v.front() << ", " << v.back() << "] | "
              << static_cast<int64_t>(fig[forced].bytes) << " | " << fig[forced].collectives
              << " | " << fig[forced].calls << " |\n";
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::cout << "routed_over_forced step " << median(fig[0].seconds) / median(fig[1].seconds)
            << " bytes " << fig[0].bytes / fig[1].bytes << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  auto world = fsdp::init_process_group();
  return o.bench ? bench(o, world) : train(o, world);
} catch (const std::exception& e) {
  std::cerr << "fsdp-moe: " << e.what() << std::endl;
  return 1;
}
