// fsdp::clip_grad_norm_: the total norm and the clipped shard gradients equal
// torch::nn::utils::clip_grad_norm_ on the unsharded model (fp64, 1e-6) at N=1..4, for the 2-norm,
// a p-norm and the inf-norm, with frozen parameters and parameters with fewer rows than ranks
// (empty shards); generated cases clip and do not clip. Bad arguments and non-finite norms by
// their message.
#include <algorithm>
#include <iostream>
#include <limits>
#include <random>

#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::clip_grad_norm_test {
namespace {

// Two rows (empty shards at N >= 3) and a frozen parameter beside a linear layer.
struct InnerImpl : torch::nn::Module {
  InnerImpl() {
    lin = register_module("lin", torch::nn::Linear(6, 6));
    tiny = register_parameter("tiny", torch::randn({2, 6}));
    frozen = register_parameter("frozen", torch::randn({3, 6}), /*requires_grad=*/false);
  }
  torch::Tensor forward(const torch::Tensor& x) {  // (B, 6) -> (B, 6)
    return torch::tanh(lin(x)) + 0.3 * x.matmul(tiny.t()).sum(-1, true) +
           0.1 * x.matmul(frozen.t()).mean(-1, true);
  }
  torch::nn::Linear lin{nullptr};
  torch::Tensor tiny, frozen;
};
TORCH_MODULE(Inner);

// Two sharded blocks and a root whose head weight has one row (empty shards from N = 2).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    b0 = register_module("b0", Inner());
    b1 = register_module("b1", Inner());
    head = register_module("head", torch::nn::Linear(6, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(b1(b0(x))).pow(2).mean(); }
  fsdp::Sharded<Inner> b0{nullptr}, b1{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

fsdp::Sharded<Net> build(uint64_t seed) {
  torch::manual_seed(seed);
  fsdp::Sharded<Net> m{Net()};
  m->to(torch::kDouble);
  return m;
}

torch::Tensor batch(uint64_t seed, int rank) {
  torch::manual_seed(1000 * seed + rank);
  return torch::randn({5, 6}, torch::kDouble) * 3;
}

const double kInf = std::numeric_limits<double>::infinity();
double max_norm_rel_error = 0;  // over the cases of one rank (FSDP_TEST_VERBOSE=1 prints it)

// One generated case: seed, norm type; max_norm drawn around the true norm so that about half
// the cases clip. Returns whether the reference clipped.
bool check_case(Rank& r, uint64_t seed, double norm_type) {
  SCOPED_TRACE(detail::cat("seed ", seed, " norm_type ", norm_type, " world ", r.size));
  auto ref = build(seed);
  for (int k = 0; k < r.size; ++k) ref(batch(seed, k)).backward();
  for (auto& p : ref->parameters())
    if (p.grad().defined()) p.mutable_grad() = p.grad() / r.size;
  const double pre = torch::nn::utils::clip_grad_norm_(ref->parameters(), kInf, norm_type);
  std::mt19937_64 gen(seed);
  const double max_norm = pre * std::uniform_real_distribution<double>(0.3, 1.7)(gen);
  const double want = torch::nn::utils::clip_grad_norm_(ref->parameters(), max_norm, norm_type);
  EXPECT_NEAR(want, pre, 1e-12 * pre);  // the reference's norm does not depend on max_norm

  auto model = build(seed);
  fully_shard(model->b0, r.world());
  fully_shard(model->b1, r.world());
  auto root = fully_shard(model, r.world());
  model(batch(seed, r.rank)).backward();
  const double got = fsdp::clip_grad_norm_(root, max_norm, norm_type);
  EXPECT_NEAR(got, want, 1e-6 * want);
  max_norm_rel_error = std::max(max_norm_rel_error, std::abs(got - want) / want);
  EXPECT_EQ(expect_shard_grads(root, full_grads(*ref.ptr()), 1e-6, 1e-9), 8);
  return max_norm < want;
}

void run_cases(int world) {
  run_ranks(world, [](Rank& r) {
    int clipped = 0, kept = 0;
    for (double norm_type : {2.0, kInf, 1.5})
      for (uint64_t seed = 1; seed <= 4; ++seed)
        (check_case(r, seed, norm_type) ? clipped : kept)++;
    // The generated max_norm must exercise both sides of the rule.
    EXPECT_GT(clipped, 0);
    EXPECT_GT(kept, 0);
    std::cout << "clip_grad_norm_ N=" << r.size << " rank " << r.rank
              << ": largest relative error of the total norm " << max_norm_rel_error << "\n";
  });
}

TEST(ClipGradNorm, EqualsUnshardedN1) { run_cases(1); }
TEST(ClipGradNorm, EqualsUnshardedN2) { run_cases(2); }
TEST(ClipGradNorm, EqualsUnshardedN3) { run_cases(3); }
TEST(ClipGradNorm, EqualsUnshardedN4) { run_cases(4); }

TEST(ClipGradNorm, BadNormTypeAndNonFiniteByMessage) {
  run_ranks(2, [](Rank& r) {
    auto model = build(7);
    fully_shard(model->b0, r.world());
    fully_shard(model->b1, r.world());
    auto root = fully_shard(model, r.world());
    model(batch(7, r.rank)).backward();
    for (double bad : {0.0, -2.0, std::nan("")})
      expect_error([&] { fsdp::clip_grad_norm_(root, 1.0, bad); }, {"norm_type", "not supported"});
    expect_error([&] { fsdp::clip_grad_norm_(root, std::nan(""), 2.0); }, {"max_norm is NaN"});
    // A NaN on rank 1 only: every rank sees the non-finite total.
    std::vector<torch::Tensor> shards;  // those with a gradient (not the frozen ones)
    for (auto& s : root.parameters())
      if (s.grad().defined()) shards.push_back(s);
    if (r.rank == 1) shards[0].mutable_grad().view(-1)[0] = std::nan("");
    std::vector<torch::Tensor> before;
    for (auto& s : shards) before.push_back(s.grad().clone());
    for (double p : {2.0, kInf})
      expect_error([&] { fsdp::clip_grad_norm_(root, 1.0, p, /*error_if_nonfinite=*/true); },
                   {"non-finite", "nan", "no gradient was changed"});
    for (size_t i = 0; i < shards.size(); ++i)
      EXPECT_TRUE(torch::equal(shards[i].grad().nan_to_num(0), before[i].nan_to_num(0)));
    // As torch does without the check: the NaN total is returned and scales every gradient.
    EXPECT_TRUE(std::isnan(fsdp::clip_grad_norm_(root, 1.0, 2.0)));
    for (auto& s : shards) {
      if (s.grad().numel()) {
        EXPECT_TRUE(s.grad().isnan().all().item<bool>());
      }
    }
  });
}

}  // namespace
}  // namespace fsdp::testing::clip_grad_norm_test
