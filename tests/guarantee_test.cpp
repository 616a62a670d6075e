// The post-backward guarantee, adversarially: each case checks that every reduced shard gradient
// equals its rows of the reference (the mean over ranks of per-rank full gradients of an unsharded
// copy) and that the audit (Final, Once, Agreed, Complete) passes on every rank.
#include "adversarial.h"
#include "core/faults.h"
#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::guarantee_test {
namespace {

using namespace adv;

torch::Tensor input_for(int rank, std::vector<int64_t> shape, bool requires_grad = true) {
  torch::manual_seed(1000 + rank);
  return torch::randn(shape).set_requires_grad(requires_grad);
}

// Shards the given child members of the root (bottom-up, before the root itself).
template <class... Members>
auto children(Members... members) {
  return [=](auto& m, auto comm, auto opts) { (fully_shard(m.get()->*members, comm, opts), ...); };
}

// Forward on this rank's input of `shape`, then backward of the sum of squares.
auto square_loss(std::vector<int64_t> shape, bool input_requires_grad = true) {
  return [=](auto& m, int rank) {
    m(input_for(rank, shape, input_requires_grad)).pow(2).sum().backward();
  };
}

// Builds with seed 0, shards children with `child` options and the root with audit on, runs
// `step(model, rank)` (forward + backward), compares with the reference.
template <class Net, class Shard, class Step>
void check_case(int world, Shard shard_children, Step step, ShardOptions child = audited()) {
  auto build = [] {
    torch::manual_seed(0);
    return fsdp::Sharded<Net>(Net());
  };
  run_ranks(world, [&](Rank& r) {
    auto ref = reference_mean_grads(world, build, step);
    auto model = build();
    shard_children(model, r.world(), child);
    auto root = fully_shard(model, r.world(), audited());
    step(model, r.rank);
    EXPECT_GT(expect_shard_grads(root, ref), 0);
  });
}

class Guarantee : public ::testing::TestWithParam<int> {};

TEST_P(Guarantee, A_PlainModule) {
  check_case<Plain>(GetParam(), children(&PlainImpl::a, &PlainImpl::b), square_loss({4, 5}));
}

TEST_P(Guarantee, B_WeightInBranchNotReachingInput) {
  check_case<BranchNet>(GetParam(), children(&BranchNetImpl::a, &BranchNetImpl::br),
                        square_loss({3, 4}));
}

TEST_P(Guarantee, C_TiedEmbeddingAndHeadInOneGroup) {
  check_case<Tied>(GetParam(), children(&TiedImpl::block), [](auto& m, int rank) {
    torch::manual_seed(50 + rank);
    auto ids = torch::randint(0, 11, {2, 4}, torch::kLong);
    auto logits = m(ids);
    torch::nn::functional::cross_entropy(logits.view({-1, 11}), ids.view({-1})).backward();
  });
}

TEST_P(Guarantee, D_FirstModuleInputNeedsNoGrad) {
  check_case<Plain>(GetParam(), children(&PlainImpl::a, &PlainImpl::b), square_loss({4, 5}, false));
}

TEST_P(Guarantee, E_OutputIgnoresInput) {
  check_case<IgnoreNet>(GetParam(),
                        children(&IgnoreNetImpl::a, &IgnoreNetImpl::ign, &IgnoreNetImpl::c),
                        square_loss({4, 5}));
}

TEST_P(Guarantee, F_ModuleCalledTwiceReshardAfterForward) {
  check_case<Twice>(GetParam(), children(&TwiceImpl::lin), square_loss({3, 5}), audited(true));
}

TEST_P(Guarantee, F_ModuleCalledTwiceNoReshardAfterForward) {
  check_case<Twice>(GetParam(), children(&TwiceImpl::lin), square_loss({3, 5}), audited(false));
}

TEST_P(Guarantee, G_WeightTransformedBeforeUse) {
  check_case<Transform>(GetParam(), children(&TransformImpl::lin), square_loss({4, 5}));
}

TEST_P(Guarantee, H_ParametersUnusedOnSomeRanks) {
  check_case<ForkNet>(GetParam(), children(&ForkNetImpl::pre, &ForkNetImpl::fork),
                      // Rank 0 uses `left` only; every other rank uses `right` only.
                      [](auto& m, int rank) {
                        m(input_for(rank, {4, 5}), rank == 0).pow(2).sum().backward();
                      });
}

// (i) torch::autograd::grad with explicit inputs computes the input gradient it was asked for and
// reduces nothing: no shard gradient appears, nothing is left unsharded, and the next plain
// backward is exact.
TEST_P(Guarantee, I_AutogradGradWithExplicitInputs) {
  const int world = GetParam();
  auto build = [] {
    torch::manual_seed(0);
    return fsdp::Sharded<Plain>(Plain());
  };
  auto step = [](auto& m, int rank) { m(input_for(rank, {4, 5})).pow(2).sum().backward(); };
  run_ranks(world, [&](Rank& r) {
    auto ref_model = build();
    auto x_ref = input_for(r.rank, {4, 5});
    auto dx_ref = torch::autograd::grad({ref_model(x_ref).pow(2).sum()}, {x_ref})[0];

    auto model = build();
    fully_shard(model->a, r.world(), audited());
    fully_shard(model->b, r.world(), audited());
    auto root = fully_shard(model, r.world(), audited());
    auto x = input_for(r.rank, {4, 5});
    auto dx = torch::autograd::grad({model(x).pow(2).sum()}, {x})[0];
    EXPECT_TRUE(torch::allclose(dx, dx_ref, 1e-5, 1e-6));
    for (const auto& s : root.shards()) EXPECT_FALSE(s.shard.grad().defined()) << s.name;
    EXPECT_EQ(root.memory_stats().unsharded_groups, 0);

    auto ref = reference_mean_grads(world, build, step);
    step(model, r.rank);
    EXPECT_GT(expect_shard_grads(root, ref), 0);
  });
}

TEST_P(Guarantee, J_TwoBackwardPassesWithRetainGraph) {
  check_case<Plain>(GetParam(), children(&PlainImpl::a, &PlainImpl::b), [](auto& m, int rank) {
    auto loss = m(input_for(rank, {4, 5})).pow(2).sum();
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
  });
}

TEST_P(Guarantee, K_FrozenAndTrainableInOneGroup) {
  check_case<MixNet>(GetParam(), children(&MixNetImpl::mix, &MixNetImpl::out), square_loss({4, 5}));
}

TEST_P(Guarantee, L_GroupWithNoGradientThisStep) {
  check_case<Idle>(GetParam(), children(&IdleImpl::used, &IdleImpl::discarded, &IdleImpl::never),
                   square_loss({4, 5}));
}

// The audit is not decorative: with a fault injected that issues every reduction at the first
// pre-backward hook (what an input-hook trigger does for a tied weight), it reports Final.
TEST_P(Guarantee, AuditCatchesEarlyReduction) {
  const int world = GetParam();
  RunOptions opts;
  run_ranks(
      world,
      [&](Rank& r) {
        detail::faults::inject({.issue_early = true});
        torch::manual_seed(0);
        fsdp::Sharded<Tied> model{Tied()};
        fully_shard(model->block, r.world(), audited());
        fully_shard(model, r.world(), audited());
        auto ids = torch::randint(0, 11, {2, 4}, torch::kLong);
        auto loss = model(ids).pow(2).sum();
        try {
          loss.backward();
          ADD_FAILURE() << "the audit did not report the early reduction";
        } catch (const std::exception& e) {
          EXPECT_NE(std::string(e.what()).find("Final: the gradient of parameter"),
                    std::string::npos)
              << e.what();
        }
      },
      opts);
}

INSTANTIATE_TEST_SUITE_P(World, Guarantee, ::testing::Values(2, 3));

}  // namespace
}  // namespace fsdp::testing::guarantee_test
