// Random computation graphs over sharded modules, for the guarantee fuzzer (guarantee_fuzz_test).
//
// A FuzzNet is a root with `blocks` sharded children. Its forward runs a program that is the same
// on every rank (which block is called on which earlier value, blocks called several times or
// never), and builds a loss from choices that differ per rank: which values enter the loss, which
// block inputs are detached, whether the root's own parameter is used. Blocks have unequal or
// equal sizes, tied weights within a group, frozen weights, weights on a branch that does not
// reach the input, outputs that ignore the input, and two outputs each. Everything in fp64.
#pragma once

#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <random>
#include <string>
#include <vector>

namespace fsdp::testing::fuzz {

constexpr int64_t kWidth = 5;

enum class BlockKind { kTied, kBranch, kIgnoresInput, kFrozenTied, kCount };

struct BlockImpl : torch::nn::Module {
  BlockImpl(BlockKind kind, int64_t rows) : kind(kind) {
    wa = register_parameter("wa", torch::randn({kWidth, kWidth}, torch::kDouble) * 0.4);
    ba = register_parameter("ba", torch::randn({kWidth}, torch::kDouble) * 0.1);
    wb = register_parameter("wb", torch::randn({rows, kWidth}, torch::kDouble) * 0.3,
                            /*requires_grad=*/kind != BlockKind::kFrozenTied);
  }
  // Two outputs, (B, kWidth) each.
  std::vector<torch::Tensor> forward(const torch::Tensor& x) {
    auto a = torch::tanh(x.matmul(wa) + ba);
    torch::Tensor b;
    switch (kind) {
      case BlockKind::kTied:
      case BlockKind::kFrozenTied:
        b = x.matmul(wb.t()).matmul(wb);  // wb used twice
        break;
      case BlockKind::kBranch:
        b = a * wb.pow(2).sum(0);  // wb on a branch that does not reach x
        break;
      default:
        b = wb.sum(0).expand({x.size(0), kWidth});  // ignores x
    }
    return {a, b};
  }
  BlockKind kind;
  torch::Tensor wa, ba, wb;
};
TORCH_MODULE(Block);

// The forward program: the same on every rank.
struct Call {
  int block;  // which child
  int input;  // index into the value pool
};
// What one rank does with it.
struct RankChoice {
  std::vector<char> detach;  // per call: detach the block's input
  std::vector<int> loss_terms;
  bool use_root_w = true, use_root_scale = true;
};

struct Program {
  uint64_t seed = 0;
  int world = 2;
  std::vector<BlockKind> kinds;
  std::vector<int64_t> rows;
  std::vector<Call> calls;
  std::vector<RankChoice> ranks;
  bool input_requires_grad = false;
  // Settings.
  std::vector<int> child_reshard;  // per block: -1 default, 0 false, 1 true
  // Per block: sharded as a container element would be (gathered on first use, no holder
  // interception: fully_shard_elements' mode) rather than through its fsdp::Sharded holder.
  std::vector<bool> on_use;
  int root_reshard = -1;
  int max_unsharded_groups = 2;
  bool audit = true;
  bool eval_forward_before_step = false, grad_forward_before_step = false;

  std::string describe() const {
    std::string s = "seed " + std::to_string(seed) + " world " + std::to_string(world) + ": " +
                    std::to_string(kinds.size()) + " blocks, " + std::to_string(calls.size()) +
                    " calls, audit " + (audit ? "on" : "off") + ", max_unsharded_groups " +
                    std::to_string(max_unsharded_groups) + ", root reshard " +
                    std::to_string(root_reshard) +
                    (eval_forward_before_step ? ", eval forward before step" : "") +
                    (grad_forward_before_step ? ", grad forward without backward" : "");
    for (size_t b = 0; b < on_use.size(); ++b)
      if (on_use[b]) s += ", block " + std::to_string(b) + " gathered on use";
    return s;
  }
};

inline Program make_program(uint64_t seed, int world) {
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(world));
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  Program p;
  p.seed = seed;
  p.world = world;
  const int blocks = 2 + pick(4);
  const bool equal_sizes = pick(3) == 0;
  for (int b = 0; b < blocks; ++b) {
    p.kinds.push_back(static_cast<BlockKind>(pick(static_cast<int>(BlockKind::kCount))));
    p.rows.push_back(equal_sizes ? 3 : 1 + pick(7));
    p.child_reshard.push_back(pick(3) - 1);
  }
  const int calls = 2 + pick(6);
  for (int c = 0; c < calls; ++c) {
    // Pool: value 0 is the root's input projection, call c appends values 1 + 2c and 2 + 2c.
    const int pool = 1 + 2 * c;
    p.calls.push_back(
        Call{pick(blocks), pick(2) == 0 ? pick(pool) : pool - 1 - pick(std::min(pool, 2))});
  }
  const int values = 1 + 2 * calls;
  for (int r = 0; r < world; ++r) {
    RankChoice rc;
    for (int c = 0; c < calls; ++c) rc.detach.push_back(pick(6) == 0);
    const int terms = 1 + pick(3);
    for (int t = 0; t < terms; ++t) rc.loss_terms.push_back(1 + pick(values - 1));
    rc.use_root_w = pick(4) != 0;
    rc.use_root_scale = pick(3) != 0;
    p.ranks.push_back(rc);
  }
  p.input_requires_grad = pick(2) == 0;
  p.root_reshard = pick(3) - 1;
  p.max_unsharded_groups = 1 + pick(2);
  p.audit = pick(4) != 0;
  p.eval_forward_before_step = pick(3) == 0;
  p.grad_forward_before_step = pick(4) == 0;
  // Drawn last, so that the earlier draws of a seed stay what they were.
  for (int b = 0; b < blocks; ++b) p.on_use.push_back(pick(3) == 0);
  return p;
}

struct NetImpl : torch::nn::Module {
  explicit NetImpl(const Program& p) : program(p) {
    root_w = register_parameter("root_w", torch::randn({kWidth, kWidth}, torch::kDouble) * 0.4);
    root_scale = register_parameter("root_scale", torch::randn({3}, torch::kDouble) * 0.2);
    for (size_t b = 0; b < p.kinds.size(); ++b)
      blocks.push_back(register_module("b" + std::to_string(b), Block(p.kinds[b], p.rows[b])));
  }
  // x: (B, kWidth). Returns this rank's scalar loss.
  torch::Tensor forward(const torch::Tensor& x, int rank) {
    const RankChoice& rc = program.ranks[rank];
    std::vector<torch::Tensor> pool{rc.use_root_w ? torch::tanh(x.matmul(root_w)) : x * 0.5};
    for (size_t c = 0; c < program.calls.size(); ++c) {
      auto in = pool[program.calls[c].input];
      if (rc.detach[c]) in = in.detach();
      auto outs = blocks[program.calls[c].block](in);
      pool.push_back(outs[0]);
      pool.push_back(outs[1]);
    }
    // The first call's first output always depends on a trainable weight: the loss needs grad.
    auto loss = pool[1].sum() * 0.01;
    for (int t : rc.loss_terms) loss = loss + (pool[t] * 0.7).pow(2).mean();
    if (rc.use_root_scale) loss = loss * (1 + root_scale.pow(2).sum());
    return loss;
  }
  Program program;
  torch::Tensor root_w, root_scale;
  std::vector<fsdp::Sharded<Block>> blocks;
};
TORCH_MODULE(Net);

inline torch::Tensor input_for(const Program& p, int rank, int iteration) {
  torch::manual_seed(static_cast<int64_t>(p.seed * 31 + static_cast<uint64_t>(rank) * 7 +
                                          static_cast<uint64_t>(iteration)));
  return torch::randn({3, kWidth}, torch::kDouble).set_requires_grad(p.input_requires_grad);
}

}  // namespace fsdp::testing::fuzz
