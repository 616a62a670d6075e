// The models LibTorch users write, trained sharded at world 2 against the unsharded model (fp64,
// AdamW, audit on): a CNN with BatchNorm2d (rank 0's buffers broadcast before each forward, as
// DDP does; without it the drift is named) and a two-input model. The lines a user changes are
// marked "// fsdp:" here and in adoption_models.h.
#include "adoption_models.h"

#include <fsdp/state_dict.h>

#include "core/buffers.h"
#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::adoption_models_test {
namespace {

std::vector<torch::Tensor> clone_buffers(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& b : m.buffers()) out.push_back(b.clone());
  return out;
}
void set_buffers(torch::nn::Module& m, const std::vector<torch::Tensor>& values) {
  torch::NoGradGuard g;
  auto bs = m.buffers();
  for (size_t i = 0; i < bs.size(); ++i) bs[i].copy_(values[i]);
}

// The reference step of the CNN: every rank's batch through the unsharded model, gradients
// averaged; the running statistics follow rank 0's batch from the common start (what every rank
// holds after the next broadcast).
void reference_cnn_step(Cnn& ref, torch::optim::AdamW& opt, int world, int step) {
  opt.zero_grad();
  const auto start = clone_buffers(*ref);
  std::vector<torch::Tensor> rank0;
  for (int k = 0; k < world; ++k) {
    set_buffers(*ref, start);
    auto [x, t] = cnn_batch(k, step);
    torch::mse_loss(ref->forward(x), t).backward();
    if (k == 0) rank0 = clone_buffers(*ref);
  }
  set_buffers(*ref, rank0);
  for (auto& p : ref->parameters()) p.mutable_grad().div_(world);
  opt.step();
}

TEST(AdoptionCnn, BatchNormTrainsLikeUnshardedWithBroadcastBuffers) {
  const int world = 2, steps = 4;
  run_ranks(world, [&](Rank& r) {
    torch::manual_seed(0);
    Cnn ref;
    torch::optim::AdamW ref_opt(ref->parameters(), adoption_adamw());

    torch::manual_seed(0);
    fsdp::Sharded<Cnn> model{Cnn()};  // fsdp: was Cnn model;
    ShardOptions o = audited();
    fully_shard(model->block1, r.world(), o);  // fsdp
    fully_shard(model->block2, r.world(), o);  // fsdp
    o.runtime.broadcast_buffers = true;
    auto root = fully_shard(model, r.world(), o);                  // fsdp
    torch::optim::AdamW opt(root.parameters(), adoption_adamw());  // fsdp: was model->parameters()

    for (int step = 0; step < steps; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      auto [x, t] = cnn_batch(r.rank, step);
      opt.zero_grad();
      torch::mse_loss(model(x), t).backward();
      opt.step();
      reference_cnn_step(ref, ref_opt, world, step);
      expect_shards_equal(root, *ref, 1e-9, 1e-12);
      auto mine = clone_buffers(*model.ptr());
      auto want = clone_buffers(*ref);
      // Rank 0's statistics are the reference's; rank 1's running mean came from its own batch.
      if (r.rank == 0) {
        for (size_t i = 0; i < want.size(); ++i)
          EXPECT_TRUE(torch::allclose(mine[i], want[i], 1e-12, 1e-12)) << "buffer #" << i;
      } else {
        EXPECT_FALSE(torch::allclose(mine[0], want[0], 1e-12, 1e-12)) << "block1.bn.running_mean";
      }
    }
    {
      // The next forward (eval: it leaves the statistics alone) broadcasts rank 0's.
      torch::NoGradGuard no_grad;
      model->eval();
      model(cnn_batch(r.rank, steps).first);
      model->train();
    }
    auto mine = clone_buffers(*model.ptr());
    auto want = clone_buffers(*ref);
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(torch::allclose(mine[i], want[i], 1e-12, 1e-12)) << "buffer #" << i;
    EXPECT_FALSE(check_buffers_agree(root, "test").has_value());
  });
}

// Without broadcast_buffers the statistics drift apart; the check names the first buffer and the
// fix, on rank 0's stderr.
TEST(AdoptionCnn, DriftingBatchNormStatisticsAreNamed) {
  run_ranks(2, [&](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Cnn> model{Cnn()};
    fully_shard(model->block1, r.world());
    fully_shard(model->block2, r.world());
    auto root = fully_shard(model, r.world());
    EXPECT_FALSE(check_buffers_agree(root, "before training").has_value());
    auto [x, t] = cnn_batch(r.rank, 0);
    torch::mse_loss(model(x), t).backward();
    ::testing::internal::CaptureStderr();
    auto name = check_buffers_agree(root, "checkpoint save keeps rank 0's values");
    const std::string err = ::testing::internal::GetCapturedStderr();
    ASSERT_TRUE(name.has_value());
    EXPECT_EQ(*name, "block1.bn.running_mean");
    if (r.rank == 0) {
      for (const char* part :
           {"fsdp: warning: buffer 'block1.bn.running_mean' differs between rank 1 and rank 0",
            "checkpoint save keeps rank 0's values", "ShardOptions::broadcast_buffers = true"})
        EXPECT_NE(err.find(part), std::string::npos) << err;
    } else {
      EXPECT_EQ(err, "");
    }
  });
}

// forward(x, y): both inputs flow through the sharded block; AdamW steps match the reference.
TEST(AdoptionTwoInputs, TrainsLikeUnsharded) {
  const int world = 2, steps = 3;
  run_ranks(world, [&](Rank& r) {
    auto batch = [](int rank, int step) {
      torch::manual_seed(50 + 7 * step + rank);
      auto x = torch::randn({3, 5}, torch::kDouble);
      auto y = torch::randn({3, 3}, torch::kDouble).set_requires_grad(true);
      return std::make_tuple(x, y, torch::randn({3, 2}, torch::kDouble));
    };
    torch::manual_seed(0);
    TwoInputNet ref;
    torch::optim::AdamW ref_opt(ref->parameters(), adoption_adamw());
    torch::manual_seed(0);
    fsdp::Sharded<TwoInputNet> model{TwoInputNet()};               // fsdp: was TwoInputNet model;
    fully_shard(model->mix, r.world(), audited());                 // fsdp
    auto root = fully_shard(model, r.world(), audited());          // fsdp
    torch::optim::AdamW opt(root.parameters(), adoption_adamw());  // fsdp: was model->parameters()
    for (int step = 0; step < steps; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      auto [x, y, t] = batch(r.rank, step);
      opt.zero_grad();
      torch::mse_loss(model(x, y), t).backward();
      opt.step();
      ref_opt.zero_grad();
      for (int k = 0; k < world; ++k) {
        auto [xk, yk, tk] = batch(k, step);
        torch::mse_loss(ref->forward(xk, yk), tk).backward();
      }
      for (auto& p : ref->parameters()) p.mutable_grad().div_(world);
      ref_opt.step();
      expect_shards_equal(root, *ref, 1e-9, 1e-12);
    }
  });
}

}  // namespace
}  // namespace fsdp::testing::adoption_models_test
