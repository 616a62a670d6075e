// The guarantee fuzzer: random graphs over sharded modules (tests/fuzz_graph.h) whose ranks take
// different paths through the same modules, against the unsharded model in fp64 (the mean of
// every rank's full gradients, tolerance 1e-9), over two iterations with an SGD step between
// them, random reshard/prefetch/audit settings, blocks gathered on first use (container elements)
// or through their holder, and optional evaluation or grad-only forwards between backward and
// step.
//
// Many seeds run in one launch of N ranks. A failing seed prints itself ("FUZZ FAILED: seed S
// world N ..."); rerun just it with FSDP_FUZZ_FIRST_SEED=S FSDP_FUZZ_SEEDS=1. For long runs set
// FSDP_FUZZ_SEEDS (seeds per launch) and FSDP_FUZZ_FIRST_SEED.
#include <cstdlib>
#include <iostream>

#include "fsdp_test_util.h"
#include "fuzz_graph.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::guarantee_fuzz_test {
namespace {

using namespace fuzz;

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

ShardOptions options_for(const Program& p, int reshard) {
  ShardOptions o;
  o.audit = p.audit;
  o.max_unsharded_groups = p.max_unsharded_groups;
  if (reshard >= 0) o.reshard_after_forward = reshard == 1;
  return o;
}

// Mean over ranks of each rank's full gradients on the unsharded model.
GradMap reference_grads(const Program& p, Net& ref, int iteration) {
  ref->zero_grad();
  for (int k = 0; k < p.world; ++k) ref->forward(input_for(p, k, iteration), k).backward();
  return mean_of_accumulated_grads(*ref, p.world);
}

void sgd_step(const FSDPModule& root, Net& ref, const GradMap& mean) {
  torch::NoGradGuard no_grad;
  for (const auto& s : root.shards()) {
    if (!s.shard.grad().defined()) continue;
    s.shard.sub_(s.shard.grad() * 0.1);
    s.shard.mutable_grad() = torch::Tensor();
  }
  for (auto& item : ref->named_parameters()) {
    auto it = mean.find(item.key());
    if (it != mean.end()) item.value().sub_(it->second * 0.1);
  }
}

// One seed on this rank: returns false when it failed (the caller stops: collectives may be out
// of step after a failure).
bool run_seed(Rank& r, uint64_t seed) {
  const Program p = make_program(seed, r.size);
  SCOPED_TRACE(p.describe());
  const bool had_failure = ::testing::Test::HasFailure();
  try {
    torch::manual_seed(static_cast<int64_t>(seed));
    Net ref(p);
    torch::manual_seed(static_cast<int64_t>(seed));
    fsdp::Sharded<Net> model{Net(p)};
    for (size_t b = 0; b < model->blocks.size(); ++b) {
      if (p.on_use[b]) {
        // What fully_shard_elements does to each element: the holder stays unattached, so its
        // calls reach forward directly, and the group gathers on first use.
        detail::fully_shard_impl(model->blocks[b].ptr(), r.world(), nullptr, options_for(p, -1),
                                 /*already_attached=*/false, /*gathers_on_use=*/true);
      } else {
        fully_shard(model->blocks[b], r.world(), options_for(p, p.child_reshard[b]));
      }
    }
    auto root = fully_shard(model, r.world(), options_for(p, p.root_reshard));
    for (int it = 0; it < 2; ++it) {
      auto loss = model(input_for(p, r.rank, it), r.rank);
      loss.backward();
      EXPECT_EQ(root.memory_stats().unsharded_bytes, 0) << "gathered after backward";
      auto mean = reference_grads(p, ref, it);
      auto ref_loss = ref->forward(input_for(p, r.rank, it), r.rank);
      EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(),
                  1e-9 * (1 + std::abs(ref_loss.item<double>())));
      EXPECT_GT(expect_shard_grads(root, mean, 1e-9, 1e-12), 0);
      if (it == 0) {
        if (p.eval_forward_before_step) {
          torch::NoGradGuard no_grad;
          model(input_for(p, r.rank, 7), r.rank);
        }
        if (p.grad_forward_before_step) model(input_for(p, r.rank, 8), r.rank);
        sgd_step(root, ref, mean);
        expect_shards_equal(root, *ref, 1e-9, 1e-12);
      }
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  if (::testing::Test::HasFailure() && !had_failure) {
    std::cerr << "FUZZ FAILED: " << p.describe() << " (rank " << r.rank << ")\n";
    return false;
  }
  return true;
}

struct FuzzRange {
  int world;
  uint64_t first_seed;
  int64_t seeds;
};

class GuaranteeFuzz : public ::testing::TestWithParam<FuzzRange> {};

TEST_P(GuaranteeFuzz, RandomGraphsMatchTheUnshardedModel) {
  const FuzzRange range = GetParam();
  const uint64_t first = static_cast<uint64_t>(
      env_int("FSDP_FUZZ_FIRST_SEED", static_cast<int64_t>(range.first_seed)));
  const int64_t seeds = env_int("FSDP_FUZZ_SEEDS", range.seeds);
  RunOptions opts;
  opts.timeout = std::chrono::seconds(120 + 2 * seeds);
  opts.collective_timeout_s = 30;
  run_ranks(
      range.world,
      [&](Rank& r) {
        int64_t done = 0;
        for (int64_t i = 0; i < seeds; ++i, ++done)
          if (!run_seed(r, first + static_cast<uint64_t>(i))) break;
        if (r.rank == 0) std::cout << "fuzz: " << done << " seeds passed\n";
      },
      opts);
}

// 230 seeds in the suite: 120 at world size 2, 80 at 3 in launches of 40, 30 at 4 (four ranks on
// this machine's two cores: a slower launch).
INSTANTIATE_TEST_SUITE_P(Seeds, GuaranteeFuzz,
                         ::testing::Values(FuzzRange{2, 0, 40}, FuzzRange{2, 40, 40},
                                           FuzzRange{2, 80, 40}, FuzzRange{3, 1000, 40},
                                           FuzzRange{3, 1040, 40}, FuzzRange{4, 2000, 30}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) + "_seeds" +
                                  std::to_string(info.param.first_seed);
                         });

}  // namespace
}  // namespace fsdp::testing::guarantee_fuzz_test
