// FSDPModule::finalize_backward (FSDP2's): the gradients accumulated by backwards without
// gradient sync are reduced without another backward, as a pipeline schedule does after a step's
// last backward; plain FSDP, HSDP and one rank, against the unsharded model in fp64. Ranks that
// would issue different reductions stop, naming the difference.
#include <fsdp/clip_grad_norm.h>

#include "adversarial.h"
#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::finalize_backward_test {
namespace {

using adv::Plain;

at::Tensor batch(int step, int micro, int rank) {
  torch::manual_seed(100 * step + 10 * micro + rank);
  return torch::randn({4, 5}, torch::kDouble);
}

void accumulates_then_finalizes(int world, int replicas) {
  run_ranks(world, [&](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Plain> m{Plain()};
    m->to(torch::kDouble);
    torch::manual_seed(0);
    Plain ref;
    ref->to(torch::kDouble);
    const DeviceMesh mesh = replicas > 1 ? init_mesh(r.world(), replicas) : DeviceMesh{};
    auto shard = [&](auto& holder) {
      return replicas > 1 ? fully_shard(holder, mesh, audited())
                          : fully_shard(holder, r.world(), audited());
    };
    shard(m->a);
    shard(m->b);
    auto root = shard(m);
    torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(0.05));
    torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(0.05));
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      root.set_requires_gradient_sync(false);
      for (int micro = 0; micro < 3; ++micro) {
        m(batch(step, micro, r.rank)).pow(2).mean().backward();
        for (int k = 0; k < world; ++k) ref(batch(step, micro, k)).pow(2).mean().backward();
      }
      if (step == 0) {  // nothing reduced yet: accumulated unsharded
        for (const auto& s : root.shards()) EXPECT_FALSE(s.shard.grad().defined()) << s.name;
      }
      root.set_requires_gradient_sync(true);
      root.finalize_backward();
      EXPECT_EQ(root.memory_stats().unsharded_bytes, 0) << "resharded";
      expect_shard_grads(root, mean_of_accumulated_grads(*ref, world), 0, 1e-12);
      for (auto& p : ref->parameters()) p.mutable_grad().div_(world);
      EXPECT_NEAR(clip_grad_norm_(root, 0.1),
                  torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.1), 1e-12);
      opt.step();
      ref_opt.step();
      opt.zero_grad();
      ref_opt.zero_grad();
    }
    expect_shards_equal(root, *ref, 0, 1e-12);
  });
}

TEST(FinalizeBackward, ReducesWhatBackwardsWithoutSyncAccumulated) {
  accumulates_then_finalizes(2, 1);
  accumulates_then_finalizes(1, 1);
}
TEST(FinalizeBackward, ReducesAcrossReplicasUnderHsdp) { accumulates_then_finalizes(4, 2); }

// What set_manual_backward_finalization is for in FSDP2 (a backward run as several calls: the
// input gradients first, as a pipeline stage sends them on, then the weight gradients) needs no
// switch: each call finalizes itself, and the weights' gradients come out as unsharded.
TEST(FinalizeBackward, ABackwardSplitIntoInputAndWeightCallsTrainsAsUnsharded) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Plain> m{Plain()};
    m->to(torch::kDouble);
    torch::manual_seed(0);
    Plain ref;
    ref->to(torch::kDouble);
    fully_shard(m->a, r.world(), audited());
    fully_shard(m->b, r.world(), audited());
    auto root = fully_shard(m, r.world(), audited());
    for (int step = 0; step < 2; ++step) {
      auto x = batch(step, 0, r.rank).requires_grad_();
      auto loss = m(x).pow(2).mean();
      const auto gx = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true)[0];
      loss.backward();
      auto rx = batch(step, 0, r.rank).requires_grad_();
      const auto want = torch::autograd::grad({ref(rx).pow(2).mean()}, {rx})[0];
      EXPECT_TRUE(torch::allclose(gx, want, 0, 1e-12));
      for (int k = 0; k < 2; ++k) ref(batch(step, 0, k)).pow(2).mean().backward();
      expect_shard_grads(root, mean_of_accumulated_grads(*ref, 2), 0, 1e-12);
      for (auto& p : ref->parameters()) p.mutable_grad() = torch::Tensor();
      for (auto& p : root.parameters()) p.mutable_grad() = torch::Tensor();
    }
  });
}

TEST(FinalizeBackward, RanksThatWouldReduceDifferentlyStopNamingIt) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Plain> m{Plain()};
    auto a = fully_shard(m->a, r.world());
    fully_shard(m->b, r.world());
    auto root = fully_shard(m, r.world());
    EXPECT_HAS(error_of([&] { a.finalize_backward(); }), "call it on the root's handle");
    root.set_requires_gradient_sync(false);
    m(torch::randn({4, 5})).sum().backward();
    root.set_requires_gradient_sync(true);
    if (r.rank == 1) a.set_requires_gradient_sync(false);
    const std::string differs = error_of([&] { root.finalize_backward(); });
    EXPECT_HAS(differs, "the ranks' gradient synchronisation differs");
    EXPECT_HAS(differs, "called finalize_backward reducing");
    a.set_requires_gradient_sync(true);
    const std::string err = error_of([&] {
      if (r.rank == 0)
        root.finalize_backward();
      else
        clip_grad_norm_(root, 1.0);
    });
    EXPECT_HAS(err, "the ranks' top-level calls differ");
    EXPECT_HAS(err, r.rank == 0 ? "finalize_backward" : "clip_grad_norm_");
  });
}

}  // namespace
}  // namespace fsdp::testing::finalize_backward_test
