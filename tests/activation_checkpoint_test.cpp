// Activation checkpointing (ShardOptions::activation_checkpointing and checkpoint_activations):
// a checkpointed sharded run equals the same run without checkpointing, bitwise in fp64 (losses,
// shard gradients every step, parameters after AdamW steps, the random state after each step) at
// N=1..3 with the audit on: the tiny GPT, and blocks with dropout whose outputs ranks use
// differently. The recomputation really happens (RecomputeBackward nodes, forward call counts).
// Errors by message: a checkpointed parent of sharded modules, inputs changed in place, a second
// backward.
#include <fsdp/models/gpt.h>

#include <functional>
#include <set>

#include "fsdp_test_util.h"
#include "tiny_gpt.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::activation_checkpoint_test {
namespace {

constexpr int kSteps = 4;

// What one run produced, step by step.
struct Record {
  std::vector<torch::Tensor> losses;              // per step
  std::vector<std::vector<torch::Tensor>> grads;  // per step, per shard (undefined: none)
  std::vector<torch::Tensor> rng_after;           // a draw after each backward
  std::vector<torch::Tensor> params;              // shards after the last step
  int recompute_nodes = 0;                        // in the first step's graph
};

// Nodes named `name` reachable from `root`.
int count_nodes(const torch::Tensor& root, const std::string& name) {
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{root.grad_fn().get()};
  int n = 0;
  while (!todo.empty()) {
    auto* f = todo.back();
    todo.pop_back();
    if (!f || !seen.insert(f).second) continue;
    if (f->name() == name) ++n;
    for (const auto& e : f->next_edges()) todo.push_back(e.function.get());
  }
  return n;
}

// Trains `steps` AdamW steps; `loss(step)` runs the forward. The random generator is seeded per
// step and rank, so dropout masks agree between the two runs only if backward restores it.
Record train(Rank& r, FSDPModule root, const std::function<torch::Tensor(int)>& loss) {
  Record out;
  torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  for (int s = 0; s < kSteps; ++s) {
    torch::manual_seed(900 + 10 * s + r.rank);
    auto l = loss(s);
    if (s == 0) out.recompute_nodes = count_nodes(l, "fsdp::RecomputeBackward");
    l.backward();
    out.rng_after.push_back(torch::rand({2}, torch::kDouble));
    out.losses.push_back(l.detach());
    std::vector<torch::Tensor> g;
    for (auto& p : root.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : p.grad());
    out.grads.push_back(g);
    opt.step();
    opt.zero_grad();
  }
  for (auto& p : root.parameters()) out.params.push_back(p.detach().clone());
  return out;
}

void expect_bitwise(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.defined(), b.defined()) << what;
  if (!a.defined()) return;
  EXPECT_TRUE(torch::equal(a, b)) << what << ": max abs diff "
                                  << (a - b).abs().max().item<double>();
}

void expect_same_run(const Record& plain, const Record& ckpt) {
  for (int s = 0; s < kSteps; ++s) {
    expect_bitwise(plain.losses[s], ckpt.losses[s], detail::cat("loss, step ", s));
    expect_bitwise(plain.rng_after[s], ckpt.rng_after[s], detail::cat("random state, step ", s));
    for (size_t i = 0; i < plain.grads[s].size(); ++i)
      expect_bitwise(plain.grads[s][i], ckpt.grads[s][i], detail::cat("grad ", i, ", step ", s));
  }
  for (size_t i = 0; i < plain.params.size(); ++i)
    expect_bitwise(plain.params[i], ckpt.params[i], detail::cat("parameter ", i));
}

ShardOptions checkpointed(bool on) {
  ShardOptions o = audited();
  o.runtime.activation_checkpointing = on;
  return o;
}

// ---- the tiny GPT: every block checkpointed ----

Record train_gpt(Rank& r, bool checkpoint) {
  torch::manual_seed(0);
  fsdp::Sharded<fsdp::models::GPT> model{fsdp::models::GPT(tiny_gpt())};
  model->to(torch::kDouble);
  auto root = fsdp::models::shard_gpt(model, r.world(), checkpointed(checkpoint), audited());
  return train(r, root, [&](int s) {
    torch::manual_seed(500 + s);
    auto tokens =
        torch::randint(0, tiny_gpt().vocab_size, {3 * r.size, tiny_gpt().seq_len + 1}, torch::kLong)
            .narrow(0, 3 * r.rank, 3);
    return model(tokens.narrow(1, 0, tiny_gpt().seq_len), tokens.narrow(1, 1, tiny_gpt().seq_len));
  });
}

class Checkpointing : public ::testing::TestWithParam<int> {};

TEST_P(Checkpointing, TinyGptBitwiseEqualToTheRunWithout) {
  run_ranks(GetParam(), [](Rank& r) {
    Record plain = train_gpt(r, false);
    Record ckpt = train_gpt(r, true);
    EXPECT_EQ(plain.recompute_nodes, 0);
    EXPECT_EQ(ckpt.recompute_nodes, tiny_gpt().n_layer);
    expect_same_run(plain, ckpt);
  });
}

// ---- blocks with dropout; rank 0 uses block a's output, the other ranks block b's ----

struct DropBlockImpl : torch::nn::Module {
  explicit DropBlockImpl(int64_t width) {
    lin = register_module("lin", torch::nn::Linear(4, width));
    out = register_module("out", torch::nn::Linear(width, 4));
    drop = register_module("drop", torch::nn::Dropout(0.3));
  }
  // (B, 4) -> (B, 4) and the hidden activations' sum (a second output).
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) {
    ++calls;
    auto h = drop(torch::tanh(lin(x)));
    return {out(h), h.sum()};
  }
  torch::nn::Linear lin{nullptr}, out{nullptr};
  torch::nn::Dropout drop{nullptr};
  int calls = 0;
};
TORCH_MODULE(DropBlock);

struct PathsImpl : torch::nn::Module {
  PathsImpl() {
    a = register_module("a", DropBlock(6));
    b = register_module("b", DropBlock(5));
    scale = register_parameter("scale", torch::ones({4}));
  }
  torch::Tensor forward(const torch::Tensor& x, int rank) {
    auto [ya, ha] = a(x);
    auto [yb, hb] = b(x);
    auto y = rank == 0 ? ya : yb;
    return (y * scale).pow(2).sum() + 0.01 * (rank == 0 ? ha : hb);
  }
  fsdp::Sharded<DropBlock> a{nullptr}, b{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(Paths);

Record train_paths(Rank& r, bool checkpoint, int* calls_a = nullptr) {
  torch::manual_seed(1);
  fsdp::Sharded<Paths> model{Paths()};
  model->to(torch::kDouble);
  fully_shard(model->a, r.world(), checkpointed(checkpoint));
  fully_shard(model->b, r.world(), checkpointed(checkpoint));
  auto root = fully_shard(model, r.world(), audited());
  Record run = train(r, root, [&](int s) {
    auto x = torch::randn({3, 4}, torch::kDouble).requires_grad_(s % 2 == 1);
    return model(x, r.rank);
  });
  if (calls_a) *calls_a = model->a->calls;
  return run;
}

TEST_P(Checkpointing, DropoutAndRanksOnDifferentPathsBitwiseEqual) {
  run_ranks(GetParam(), [](Rank& r) {
    int calls_plain = 0, calls_ckpt = 0;
    Record plain = train_paths(r, false, &calls_plain);
    Record ckpt = train_paths(r, true, &calls_ckpt);
    EXPECT_EQ(calls_plain, kSteps);
    // Block a's output reaches the loss on rank 0 only: recomputed there, never elsewhere.
    EXPECT_EQ(calls_ckpt, r.rank == 0 ? 2 * kSteps : kSteps);
    EXPECT_EQ(ckpt.recompute_nodes, 1);  // the used block's call; the other is not in the graph
    expect_same_run(plain, ckpt);
  });
}

INSTANTIATE_TEST_SUITE_P(World, Checkpointing, ::testing::Values(1, 2, 3));

// At fully_shard, on every rank (at the first forward, ranks calling other modules would not
// see it and would wait for the others in a collective).
TEST(CheckpointingErrors, ParentOfShardedModulesNamedAtFullyShard) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Paths> model{Paths()};
    fully_shard(model->a, r.world());
    fully_shard(model->b, r.world());
    ShardOptions o;
    o.runtime.activation_checkpointing = true;
    expect_error([&] { fully_shard(model, r.world(), o); },
                 {"activation checkpointing on '", "contains the sharded module 'a'", "innermost"});
    EXPECT_FALSE(model.is_sharded());
    fully_shard(model, r.world());  // nothing was claimed: it shards without checkpointing
    model(torch::randn({2, 4}), r.rank).sum().backward();
  });
}

// ---- checkpoint_activations without sharding ----

template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(CheckpointActivations, GradientsEqualAndMisuseNamed) {
  torch::manual_seed(3);
  torch::nn::Linear lin(5, 7);
  lin->to(torch::kDouble);
  auto fn = [&](const std::vector<torch::Tensor>& in) {
    return std::vector<torch::Tensor>{torch::dropout(torch::tanh(lin(in[0])), 0.5, true) * in[1]};
  };
  auto x = torch::randn({4, 5}, torch::kDouble).requires_grad_();
  auto w = torch::randn({4, 7}, torch::kDouble);  // an input without gradient
  std::vector<torch::Tensor> want, got;
  for (bool ckpt : {false, true}) {
    lin->zero_grad();
    x.mutable_grad() = torch::Tensor();
    torch::manual_seed(11);
    auto y = ckpt ? fsdp::checkpoint_activations(fn, {x, w}, lin->parameters())[0] : fn({x, w})[0];
    EXPECT_EQ(count_nodes(y, "fsdp::RecomputeBackward"), ckpt ? 1 : 0);
    y.pow(2).sum().backward();
    auto& out = ckpt ? got : want;
    out = {y.detach(), x.grad().clone(), lin->weight.grad().clone(), lin->bias.grad().clone()};
  }
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(torch::equal(want[i], got[i])) << i;

  auto y = fsdp::checkpoint_activations(fn, {x, w}, lin->parameters())[0];
  w.add_(1);
  EXPECT_NE(message_of([&] { y.sum().backward(); })
                .find("input #1 of a checkpointed call was "
                      "modified in place"),
            std::string::npos);
  auto z = fsdp::checkpoint_activations(fn, {x, w}, lin->parameters())[0].sum();
  z.backward();
  EXPECT_NE(message_of([&] { z.backward(); }).find("retain_graph=true"), std::string::npos)
      << message_of([&] { z.backward(); });
}

}  // namespace
}  // namespace fsdp::testing::activation_checkpoint_test
