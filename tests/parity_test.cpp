// Parity: the GPT trained with AdamW on N ranks (each rank its slice of one global batch) matches a
// single-process unsharded run with the same init and global batch, step by step (loss) and at the
// end (every parameter), within 1e-5 relative in fp32.
#include <fsdp/models/gpt.h>

#include "fsdp_test_util.h"
#include "tiny_gpt.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::parity_test {
namespace {

using fsdp::models::GPT;
using fsdp::models::GPTConfig;

constexpr int kSteps = 10;
constexpr int64_t kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4

fsdp::Sharded<GPT> build(torch::Dtype dtype = torch::kFloat) {
  torch::manual_seed(0);
  fsdp::Sharded<GPT> m{GPT(tiny_gpt())};
  m->to(dtype);
  return m;
}

// Step k's global batch: (kGlobalBatch, seq_len + 1) tokens, inputs and next-token targets.
std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(500 + step);
  auto tokens = torch::randint(0, tiny_gpt().vocab_size, {kGlobalBatch, tiny_gpt().seq_len + 1},
                               torch::kLong);
  return {tokens.narrow(1, 0, tiny_gpt().seq_len), tokens.narrow(1, 1, tiny_gpt().seq_len)};
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

// kNewStorage: after sharding, every other shard is given new storage (set_data, same values),
// so its group's flat shard block no longer holds it and the all-gather must pack a copy.
enum class Variant { kDefault, kNoReshard, kAccumulate, kNewStorage };

// One slice's loss and backward as a rank runs it: one micro-batch, or two (scaled so their sum is
// the slice mean) for gradient accumulation. Returns the slice's mean loss.
torch::Tensor slice_backward(fsdp::Sharded<GPT>& model, const torch::Tensor& x,
                             const torch::Tensor& y, Variant variant,
                             const std::function<void(bool)>& set_sync) {
  const int64_t n = x.size(0);
  if (variant != Variant::kAccumulate) {
    auto loss = model(x, y);
    loss.backward();
    return loss.detach();
  }
  const int64_t half = n / 2, rest = n - half;
  set_sync(false);
  auto l1 = model(x.narrow(0, 0, half), y.narrow(0, 0, half));
  (l1 * (double(half) / n)).backward();
  set_sync(true);
  auto l2 = model(x.narrow(0, half, rest), y.narrow(0, half, rest));
  (l2 * (double(rest) / n)).backward();
  return (l1 * half + l2 * rest).detach() / n;
}

// The unsharded single-process reference on the same global batch. `slices` == 1: the loss of the
// whole batch at once (the plain reference). `slices` == N: the batch gradient formed as data
// parallelism forms it, the mean of the N slice gradients, so that fp32 rounding matches closely.
std::vector<double> reference_run(fsdp::Sharded<GPT>& model, int slices, Variant variant) {
  torch::optim::AdamW opt(model->parameters(), adamw());
  std::vector<double> losses;
  auto params = model->parameters();
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    const int64_t per = kGlobalBatch / slices;
    std::vector<torch::Tensor> total(params.size());
    double loss_sum = 0;
    for (int k = 0; k < slices; ++k) {
      for (auto& p : params) p.mutable_grad() = torch::Tensor();
      auto loss = slice_backward(model, x.narrow(0, k * per, per), y.narrow(0, k * per, per),
                                 slices == 1 ? Variant::kDefault : variant, [](bool) {});
      loss_sum += loss.item<double>();
      for (size_t i = 0; i < params.size(); ++i) {
        auto g = params[i].grad();
        if (!g.defined()) g = torch::zeros_like(params[i]);
        total[i] = total[i].defined() ? total[i] + g : g.clone();
      }
    }
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = total[i] / slices;
    opt.step();
    opt.zero_grad();
    losses.push_back(loss_sum / slices);
  }
  return losses;
}

void run_parity(int world, Variant variant, torch::Dtype dtype = torch::kFloat) {
  const double rtol = dtype == torch::kDouble ? 1e-10 : 1e-5;
  run_ranks(world, [&](Rank& r) {
    // fp64: the plain whole-batch reference; fp32: the slice-mean reference (see reference_run).
    auto ref_model = build(dtype);
    auto ref_losses = reference_run(ref_model, dtype == torch::kDouble ? 1 : world, variant);

    auto model = build(dtype);
    auto comm = r.world();
    ShardOptions block =
        audited(variant == Variant::kNoReshard ? std::optional<bool>(false) : std::nullopt);
    auto root = fsdp::models::shard_gpt(model, comm, block, audited());
    if (variant == Variant::kNewStorage) {
      torch::NoGradGuard no_grad;
      auto shards = root.parameters();
      for (size_t i = 0; i < shards.size(); i += 2) shards[i].set_data(shards[i].clone());
    }
    torch::optim::AdamW opt(root.parameters(), adamw());
    const int64_t per_rank = kGlobalBatch / world;
    double max_loss_rel = 0;
    for (int s = 0; s < kSteps; ++s) {
      auto [gx, gy] = batch(s);
      auto x = gx.narrow(0, r.rank * per_rank, per_rank);
      auto y = gy.narrow(0, r.rank * per_rank, per_rank);
      auto local = slice_backward(model, x, y, variant,
                                  [&](bool sync) { root.set_requires_gradient_sync(sync); });
      opt.step();
      opt.zero_grad();
      comm->all_reduce(local, ReduceOp::kAvg).wait();
      const double got = local.item<double>(), want = ref_losses[s];
      EXPECT_NEAR(got, want, rtol * std::abs(want)) << "step " << s;
      max_loss_rel = std::max(max_loss_rel, std::abs(got - want) / std::abs(want));
    }
    expect_shards_equal(root, *ref_model.ptr(), rtol, rtol * 0.1);
    double max_param_rel = 0;  // relative to each parameter tensor's largest magnitude
    std::map<std::string, torch::Tensor> ref;
    for (auto& item : ref_model->named_parameters()) ref[item.key()] = item.value().detach();
    for (const auto& sh : root.shards()) {
      if (sh.shard.numel() == 0) continue;
      auto full = ref.at(sh.name).reshape({sh.global_shape.empty() ? 1 : sh.global_shape[0], -1});
      auto want = full.narrow(0, sh.row_offset, sh.shard.size(0));
      auto diff = (sh.shard.detach().reshape(want.sizes()) - want).abs().max().item<double>();
      max_param_rel = std::max(max_param_rel, diff / full.abs().max().item<double>());
    }
    if (r.rank == 0)
      std::cout << "parity world " << world << " " << torch::toString(dtype)
                << ": max loss rel err " << max_loss_rel << ", max param err (rel. to tensor max) "
                << max_param_rel << ", final loss " << ref_losses.back() << "\n";
  });
}

class Parity : public ::testing::TestWithParam<int> {};

TEST_P(Parity, AdamWTenStepsMatchesUnsharded) { run_parity(GetParam(), Variant::kDefault); }
INSTANTIATE_TEST_SUITE_P(World, Parity, ::testing::Values(1, 2, 3, 4));

// In fp64 rounding noise cannot hide a wrong gradient: agreement to 1e-10 relative.
TEST(ParityFp64, AdamWTenStepsWorld2) { run_parity(2, Variant::kDefault, torch::kDouble); }
TEST(ParityFp64, AdamWTenStepsWorld3) { run_parity(3, Variant::kDefault, torch::kDouble); }
TEST(ParityFp64, AdamWTenStepsWorld4) { run_parity(4, Variant::kDefault, torch::kDouble); }
TEST(ParityFp64, GradientAccumulationWorld3) {
  run_parity(3, Variant::kAccumulate, torch::kDouble);
}

TEST(ParityVariants, NoReshardAfterForwardWorld2) { run_parity(2, Variant::kNoReshard); }
TEST(ParityVariants, NoReshardAfterForwardWorld3) { run_parity(3, Variant::kNoReshard); }
TEST(ParityVariants, GradientAccumulationWorld2) { run_parity(2, Variant::kAccumulate); }
TEST(ParityVariants, GradientAccumulationWorld3) { run_parity(3, Variant::kAccumulate); }
TEST(ParityVariants, ShardsGivenNewStorageWorld3) { run_parity(3, Variant::kNewStorage); }
// On the collective transport (the path of NCCL): the all-gather through a flat buffer and its
// copy-out, the reduce-scatter as the backend's all-to-all then the sum. On shm and tcp the
// all-gather lands in the full parameters' block directly.
TEST(ParityVariants, CollectiveTransportWorld3) {
  ::setenv("FSDP_TRANSPORT", "collective", 1);
  run_parity(3, Variant::kDefault, torch::kDouble);
  ::unsetenv("FSDP_TRANSPORT");
}
// Over the process group's point-to-point send/recv, the transport across hosts.
TEST(ParityVariants, TcpTransportWorld3) {
  ::setenv("FSDP_TRANSPORT", "tcp", 1);
  run_parity(3, Variant::kDefault, torch::kDouble);
  ::unsetenv("FSDP_TRANSPORT");
}

}  // namespace
}  // namespace fsdp::testing::parity_test
