// fully_shard semantics beyond the guarantee: shard layout (uneven, empty, 0-d), names, buffers,
// the unshard/reshard API, storage really freed, memory per rank, debug log, and every error path
// by its message.
#include <fsdp/models/mlp.h>

#include "adversarial.h"
#include "compat/optim.h"
#include "core/comm_context.h"
#include "core/faults.h"
#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::fully_shard_test {
namespace {

using adv::Plain;
using adv::SLinear;

// A root with a 0-d parameter, a buffer, and a parameter with fewer rows than ranks.
struct OddImpl : torch::nn::Module {
  OddImpl() {
    lin = register_module("lin", torch::nn::Linear(3, 5));
    temperature = register_parameter("temperature", torch::tensor(1.5));
    rows2 = register_parameter("rows2", torch::ones({2, 3}));
    counter = register_buffer("counter", torch::full({4}, -1.0));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return lin(x).sum(1) * temperature + rows2.sum();
  }
  SLinear lin{nullptr};
  torch::Tensor temperature, rows2, counter;
};
TORCH_MODULE(Odd);

TEST(FullyShard, ShardLayoutNamesAndBuffers) {
  run_ranks(3, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Odd> m{Odd()};
    if (r.rank == 0) m->counter.fill_(7);  // rank 0's buffers win
    fully_shard(m->lin, r.world());
    auto root = fully_shard(m, r.world());
    EXPECT_TRUE(torch::equal(m->counter, torch::full({4}, 7.0)));
    std::map<std::string, ShardInfo> by;
    for (auto& s : root.shards()) by[s.name] = s;
    ASSERT_EQ(by.size(), 4u);
    // lin.weight (5, 3) over 3 ranks: chunk 2 -> rows 2, 2, 1.
    EXPECT_EQ(by["lin.weight"].rows_per_rank, 2);
    EXPECT_EQ(by["lin.weight"].shard.size(0), r.rank < 2 ? 2 : 1);
    EXPECT_EQ(by["lin.weight"].row_offset, 2 * r.rank);
    // rows2 (2, 3): chunk 1 -> rows 1, 1, 0 (an empty shard on rank 2).
    EXPECT_EQ(by["rows2"].shard.size(0), r.rank < 2 ? 1 : 0);
    // 0-d: one element on rank 0, none elsewhere; global shape [].
    EXPECT_TRUE(by["temperature"].global_shape.empty());
    EXPECT_EQ(by["temperature"].shard.numel(), r.rank == 0 ? 1 : 0);
    // The module's own parameters keep their full shapes, with no storage while resharded.
    EXPECT_EQ(m->lin->weight.sizes(), (std::vector<int64_t>{5, 3}));
    EXPECT_EQ(m->lin->weight.storage().nbytes(), 0u);
    // unshard() gathers this module's own group; values equal the original init.
    torch::manual_seed(0);
    Odd fresh;
    root.unshard();
    EXPECT_TRUE(torch::equal(m->rows2, fresh->rows2));
    EXPECT_TRUE(torch::equal(m->temperature, fresh->temperature));
    root.reshard();
    EXPECT_EQ(m->rows2.storage().nbytes(), 0u);
    // Gradients: 0-d and empty shards get their (possibly empty) slice of the mean gradient.
    m(torch::ones({2, 3})).sum().backward();
    for (auto& s : root.shards()) EXPECT_TRUE(s.shard.grad().defined()) << s.name;
    if (r.rank == 0) {
      EXPECT_NEAR(by["temperature"].shard.grad().item<double>(),
                  fresh(torch::ones({2, 3})).sum().item<double>() / 1.5 -
                      fresh->rows2.sum().item<double>() * 2 / 1.5,
                  1e-4);
    }
  });
}

TEST(FullyShard, FrozenParametersAreShardedAndGatheredNeverReduced) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Plain> m{Plain()};
    m->a->weight.set_requires_grad(false);
    fully_shard(m->a, r.world(), audited());
    fully_shard(m->b, r.world(), audited());
    auto root = fully_shard(m, r.world(), audited());
    m(torch::randn({4, 5})).sum().backward();
    for (auto& s : root.shards()) {
      if (s.name == "a.weight") {
        EXPECT_FALSE(s.requires_grad);
        EXPECT_FALSE(s.shard.grad().defined());
      } else {
        EXPECT_TRUE(s.shard.grad().defined()) << s.name;
      }
    }
  });
}

// A module that uses a weight it does not own (tied to a sibling's).
struct UsesImpl : torch::nn::Module {
  explicit UsesImpl(torch::Tensor w) { weight = register_parameter("tied", w); }
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(Uses);
struct TwoSiblingsImpl : torch::nn::Module {
  TwoSiblingsImpl() {
    a = register_module("a", torch::nn::Linear(4, 4));
    u = register_module("u", Uses(a->weight));
  }
  torch::Tensor forward(const torch::Tensor& x) { return u(a(x)); }
  SLinear a{nullptr};
  fsdp::Sharded<Uses> u{nullptr};
};
TORCH_MODULE(TwoSiblings);

// A forward whose all-gather throws (here a custom one, once) leaves the module as it was: the
// next forward gathers and trains as if nothing had happened.
struct ThrowsOnce : AllGather {
  bool thrown = false;
  Work operator()(const at::Tensor& out, const at::Tensor& in, Communicator& g) override {
    if (!thrown) {
      thrown = true;
      throw std::runtime_error("custom all-gather failed once");
    }
    return g.all_gather(out, in);
  }
};

TEST(FullyShard, AForwardWhoseGatherThrowsLeavesTheModuleUsable) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Plain> m{Plain()};
    torch::manual_seed(0);
    Plain ref;
    auto a = fully_shard(m->a, r.world(), audited());
    fully_shard(m->b, r.world(), audited());
    auto root = fully_shard(m, r.world(), audited());
    a.set_custom_all_gather(std::make_shared<ThrowsOnce>());
    auto x = torch::randn({4, 5});
    EXPECT_HAS(error_of([&] { m(x); }), "custom all-gather failed once");
    auto y = m(x);
    EXPECT_TRUE(torch::allclose(y, ref(x), 1e-5, 1e-6));
    y.sum().backward();
    for (auto& s : root.shards()) EXPECT_TRUE(s.shard.grad().defined()) << s.name;
  });
}

TEST(FullyShard, ReshardAfterBackwardOffKeepsParametersGathered) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Plain> m{Plain()};
    fully_shard(m->a, r.world(), audited());
    fully_shard(m->b, r.world(), audited());
    auto root = fully_shard(m, r.world(), audited());
    root.set_reshard_after_backward(false);
    m(torch::randn({4, 5})).sum().backward();
    // Kept gathered through backward (ZeRO-2-like): the next forward needs no all-gather.
    EXPECT_GT(m->a->weight.storage().nbytes(), 0u);
    EXPECT_EQ(root.memory_stats().unsharded_groups, 2);  // a and b; the root is not counted
    root.set_reshard_after_backward(true);
    m(torch::randn({4, 5})).sum().backward();
    EXPECT_EQ(m->a->weight.storage().nbytes(), 0u);
    EXPECT_EQ(root.memory_stats().unsharded_groups, 0);
  });
}

// Parameters that are not contiguous tensors of their own: a transposed one, and two views into
// one larger tensor (one at an offset). Their gathered values are laid out contiguously in fresh
// storage, so each reads as unsharded and freeing one frees nothing of another.
struct ViewsImpl : torch::nn::Module {
  torch::Tensor t, a, b;
  ViewsImpl() {
    t = register_parameter("t", torch::randn({7, 5}, torch::kDouble).t());  // [5, 7], strided
    auto base = torch::randn({30}, torch::kDouble);
    a = register_parameter("a", base.narrow(0, 0, 14).view({2, 7}));
    b = register_parameter("b", base.narrow(0, 16, 14).view({7, 2}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(t).matmul(b) + a.sum(0).sum(); }
};
TORCH_MODULE(Views);

TEST(FullyShard, TransposedAndViewParametersTrainAsUnsharded) {
  for (int dim : {0, 1}) {
    run_ranks(2, [dim](Rank& r) {
      torch::manual_seed(0);
      fsdp::Sharded<Views> m{Views()};
      torch::manual_seed(0);
      Views ref;
      ShardOptions o = audited();
      o.shard_placement_fn = [dim](const std::string&, const at::Tensor&) {
        return std::optional<Shard>(Shard{dim});
      };
      auto root = fully_shard(m, r.world(), o);
      expect_shards_equal(root, *ref, 0, 0);
      torch::optim::SGD opt(root.parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
      for (int step = 0; step < 2; ++step) {
        torch::manual_seed(step * 10 + r.rank);
        auto x = torch::randn({3, 5}, torch::kDouble);
        auto y = m(x);
        EXPECT_TRUE(torch::allclose(y, ref(x), 0, 1e-12)) << "step " << step;
        y.pow(2).mean().backward();
        for (int k = 0; k < 2; ++k) {
          torch::manual_seed(step * 10 + k);
          (ref(torch::randn({3, 5}, torch::kDouble)).pow(2).mean() / 2).backward();
        }
        expect_shard_grads(root, full_grads(*ref), 0, 1e-12);
        opt.step();
        ref_opt.step();
        opt.zero_grad();
        ref_opt.zero_grad();
      }
      expect_shards_equal(root, *ref, 0, 1e-12);
    });
  }
}

TEST(FullyShardErrors, ParameterSharedByTwoGroups) {
  run_ranks(1, [](Rank& r) {
    fsdp::Sharded<TwoSiblings> m{TwoSiblings()};
    fully_shard(m->a, r.world());
    auto msg = error_of([&] { fully_shard(m->u, r.world()); });
    EXPECT_HAS(msg, "parameter 'tied' of module");
    EXPECT_HAS(msg, "is already managed by fully_shard on module");
    EXPECT_HAS(msg, "shared by two groups");
    EXPECT_HAS(msg, "shard their common parent");
    // Sharding the parent directly, with the tie inside one group, is fine.
    fsdp::Sharded<TwoSiblings> ok{TwoSiblings()};
    EXPECT_NO_THROW(fully_shard(ok, r.world()));
  });
}

TEST(FullyShardErrors, AppliedTwice) {
  run_ranks(1, [](Rank& r) {
    fsdp::Sharded<Plain> m{Plain()};
    fully_shard(m->a, r.world());
    auto msg = error_of([&] { fully_shard(m->a, r.world()); });
    EXPECT_HAS(msg, "fully_shard was applied twice to module 'torch::nn::LinearImpl'");
  });
}

TEST(FullyShardErrors, ChildShardedAfterParent) {
  run_ranks(1, [](Rank& r) {
    fsdp::Sharded<Plain> m{Plain()};
    fully_shard(m, r.world());
    auto msg = error_of([&] { fully_shard(m->a, r.world()); });
    EXPECT_HAS(msg, "was called after its parent");
    EXPECT_HAS(msg, "bottom-up, children first");
  });
}

TEST(FullyShardErrors, ShapesDifferAcrossRanks) {
  run_ranks(2, [](Rank& r) {
    fsdp::Sharded<torch::nn::Linear> m{torch::nn::Linear(4, r.rank == 0 ? 6 : 7)};
    auto msg = error_of([&] { fully_shard(m, r.world()); });
    EXPECT_HAS(msg, "the model differs across ranks at parameter #0");
    EXPECT_HAS(msg, "'weight' [" + std::to_string(r.rank == 0 ? 6 : 7) + ", 4]");
    EXPECT_HAS(msg, "Every rank must construct the same model");
  });
}

struct BypassImpl : torch::nn::Module {
  BypassImpl() { a = register_module("a", torch::nn::Linear(3, 3)); }
  torch::Tensor forward(const torch::Tensor& x) { return a->forward(x); }  // skips Sharded
  SLinear a{nullptr};
};
TORCH_MODULE(Bypass);

TEST(FullyShardErrors, ParametersUsedOutsideTheirForward) {
  run_ranks(1, [](Rank& r) {
    fsdp::Sharded<Bypass> m{Bypass()};
    fully_shard(m->a, r.world());
    fully_shard(m, r.world());
    auto msg = error_of([&] { m(torch::ones({1, 3})); });
    EXPECT_HAS(msg, "parameter 'a.weight' of sharded module 'a' (torch::nn::LinearImpl)");
    EXPECT_HAS(msg, "whose full storage is freed (resharded)");
    EXPECT_HAS(msg, "not block->forward(x)");
  });
}

TEST(FullyShardErrors, MixedDtypesInOneGroup) {
  run_ranks(1, [](Rank& r) {
    fsdp::Sharded<Plain> m{Plain()};
    m->scale.set_data(m->scale.to(torch::kDouble));
    auto msg = error_of([&] { fully_shard(m, r.world()); });
    EXPECT_HAS(msg, "parameter 'tiny' has dtype Float but 'scale' has Double");
    EXPECT_HAS(msg, "parameters of one group must share a dtype");
  });
}

TEST(FullyShardErrors, EmptyHandle) {
  FSDPModule h;
  EXPECT_HAS(error_of([&] { h.parameters(); }), "this FSDPModule handle is empty");
}

// Per-rank bytes of shards, shard gradients and AdamW state are 1/N of the unsharded totals plus
// padding; with reshard after forward a deep MLP holds at most two groups' gathered parameters,
// and none once forward and backward are over.
class Memory : public ::testing::TestWithParam<int> {};

TEST_P(Memory, ShardsGradsOptimizerStateAreOneNthAndGatheredParamsAreFreed) {
  const int world = GetParam();
  run_ranks(world, [&](Rank& r) {
    const int64_t width = 63, depth = 8;
    torch::manual_seed(0);
    fsdp::Sharded<fsdp::models::MLPStack> m{fsdp::models::MLPStack(width, depth)};
    int64_t full = 0;
    for (auto& p : m->parameters()) full += p.numel() * 4;
    for (auto& l : m->layers) fully_shard(l, r.world());
    auto root = fully_shard(m, r.world());
    torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-3));
    root.reset_memory_peaks();
    // Two iterations: the second prefetches in forward along the recorded order.
    for (int it = 0; it < 2; ++it) {
      opt.zero_grad();
      auto y = m(torch::randn({16, width}));
      // After forward: every layer resharded, storage really released.
      for (auto& l : m->layers) EXPECT_EQ(l->weight.storage().nbytes(), 0u);
      y.pow(2).mean().backward();
      for (auto& l : m->layers) EXPECT_EQ(l->weight.storage().nbytes(), 0u);
      opt.step();
    }
    const int64_t group_bytes = (width * width + width) * 4;
    auto stats = root.memory_stats();
    EXPECT_LE(stats.peak_unsharded_groups, 2);
    EXPECT_LE(stats.peak_unsharded_bytes, 2 * group_bytes);
    EXPECT_EQ(stats.unsharded_bytes, 0);

    int64_t shard_bytes = 0, grad_bytes = 0, state_bytes = 0;
    for (auto& p : root.parameters()) {
      shard_bytes += p.numel() * 4;
      grad_bytes += p.grad().numel() * 4;
      auto& st =
          static_cast<torch::optim::AdamWParamState&>(*opt.state().at(compat::optim_state_key(p)));
      state_bytes += (st.exp_avg().numel() + st.exp_avg_sq().numel()) * 4;
    }
    // Padding: at most one row per parameter per rank.
    const int64_t slack = depth * 2 * width * 4;
    EXPECT_NEAR(shard_bytes, full / world, slack);
    EXPECT_NEAR(grad_bytes, full / world, slack);
    EXPECT_NEAR(state_bytes, 2 * full / world, 2 * slack);
    if (r.rank == 0)
      std::cout << "memory world " << world << ": unsharded params " << full << " B, this rank "
                << shard_bytes << " B shards + " << grad_bytes << " B grads + " << state_bytes
                << " B AdamW state; peak gathered " << stats.peak_unsharded_bytes << " B in "
                << stats.peak_unsharded_groups << " groups (one group " << group_bytes << " B)\n";
  });
}
INSTANTIATE_TEST_SUITE_P(World, Memory, ::testing::Values(1, 2, 4));

// A rank that falls behind (faults::Faults::slow_reduce: every rank but 0 issues each
// reduce-scatter that many ms late) must not make the others hold a send buffer per group: before a
// group takes its send buffer, backward waits (bounded) for the reductions in flight. With reshard
// after forward, at most three layer-sized buffers are then in use at once (the layer being
// computed, the next one's all-gather, one reduce-scatter), and the gradients are the unsharded
// model's. With a delay past the bound (3 s) the wait gives up, says so, and the results are the
// same. The bound holds too when the last layer keeps its parameters from forward into backward
// (fsdp-train's layout): its reduction is waited for although it has no backward all-gather, and
// the next layer's all-gather is issued by its pre-backward, not the root's.
struct SlowRankCase {
  int delay_ms;
  int depth;
  bool expect_expiry;
  bool keep_last = false;  // the last layer: reshard_after_forward = false
};
class SlowRank : public ::testing::TestWithParam<SlowRankCase> {};

TEST_P(SlowRank, BackwardHoldsAtMostThreeLayerBuffersAndGradientsAreRight) {
  const auto c = GetParam();
  RunOptions o;
  o.env["FSDP_DEBUG"] = "1";
  const int64_t width = 63;
  auto build = [&] {
    torch::manual_seed(0);
    return fsdp::models::MLPStack(width, c.depth);
  };
  auto data = [&](int k) {
    torch::manual_seed(100 + k);
    return torch::randn({16, width});
  };
  auto res = run_ranks(
      2,
      [&](Rank& r) {
        fsdp::Sharded<fsdp::models::MLPStack> m{build()};
        detail::faults::inject({.slow_reduce = std::chrono::milliseconds(c.delay_ms)});
        for (size_t i = 0; i < m->layers.size(); ++i) {
          ShardOptions lo;
          if (c.keep_last && i + 1 == m->layers.size()) lo.reshard_after_forward = false;
          fully_shard(m->layers[i], r.world(), lo);
        }
        auto root = fully_shard(m, r.world());
        m(data(r.rank)).pow(2).mean().backward();
        auto ref = reference_mean_grads(2, build, [&](fsdp::models::MLPStack& model, int k) {
          model(data(k)).pow(2).mean().backward();
        });
        EXPECT_EQ(expect_shard_grads(root, ref), 2 * c.depth);
        // One layer's (world, S) buffer: 32 of 63 rows of the weight and of the bias per rank.
        const int64_t layer_buffer = 2 * (32 * width + 32) * 4;
        const auto stats = root.memory_stats();
        if (!c.expect_expiry) {
          EXPECT_LE(stats.peak_buffer_bytes_in_use, 3 * layer_buffer);
        }
        EXPECT_LE(stats.peak_unsharded_groups, 2);
        EXPECT_EQ(stats.buffer_bytes_in_use, 0);
        EXPECT_LE(stats.buffer_bytes_idle, stats.peak_buffer_bytes_in_use);
      },
      o);
  if (!in_rank_process()) {
    const std::string expiry = "reduce-scatter still in flight after a bounded wait of 3000 ms";
    EXPECT_EQ(res.output.at(0).find(expiry) != std::string::npos, c.expect_expiry)
        << res.output.at(0);
  }
}
INSTANTIATE_TEST_SUITE_P(Delays, SlowRank,
                         ::testing::Values(SlowRankCase{60, 8, false},
                                           SlowRankCase{60, 8, false, true},
                                           SlowRankCase{3300, 2, true}));

// The communication-buffer pool hands a buffer to one owner at a time: one given back twice, or
// one it never handed out, is refused (two later owners would otherwise overwrite each other's
// data), and an idle buffer is reused.
TEST(BufferPool, HandsEachBufferToOneOwnerAndRefusesOneGivenBackTwice) {
  fsdp::detail::BufferPool pool;
  at::Tensor a = pool.acquire(1000, at::kFloat, at::kCPU),
             b = pool.acquire(1000, at::kFloat, at::kCPU);
  EXPECT_NE(a.data_ptr(), b.data_ptr());
  const void* a_data = a.data_ptr();
  pool.release(a);
  expect_error([&] { pool.release(a); }, {"given back twice", "please report"});
  expect_error([&] { pool.release(torch::empty({1000})); }, {"did not hand out"});
  EXPECT_EQ(pool.in_use_bytes(), 4000);
  at::Tensor c = pool.acquire(1000, at::kFloat, at::kCPU),
             d = pool.acquire(1000, at::kFloat, at::kCPU);
  EXPECT_EQ(c.data_ptr(), a_data);  // the idle one
  EXPECT_NE(d.data_ptr(), a_data);
  EXPECT_NE(d.data_ptr(), b.data_ptr());
  EXPECT_EQ(pool.in_use_bytes(), 12000);
  for (auto* t : {&b, &c, &d}) pool.release(*t);
  EXPECT_EQ(pool.in_use_bytes(), 0);
}

TEST(FullyShard, DebugLogsOneLinePerHookEvent) {
  RunOptions o;
  o.env["FSDP_DEBUG"] = "1";
  auto res = run_ranks(
      2,
      [](Rank& r) {
        torch::manual_seed(0);
        fsdp::Sharded<Plain> m{Plain()};
        fully_shard(m->a, r.world());
        fully_shard(m, r.world());
        m(torch::randn({2, 5})).sum().backward();
      },
      o);
  if (!in_rank_process()) {
    const auto& log = res.output.at(0);
    EXPECT_HAS(log, "fsdp[rank 0] group 'a' pre_forward");
    EXPECT_HAS(log, "group 'a' unshard: all-gather issued (SHARDED->GATHERING)");
    EXPECT_HAS(log, "group 'a' backward begins: expects 1 output hooks, 2 gradients");
    EXPECT_HAS(log, "group 'a' gradient final: 'weight'");
    EXPECT_HAS(log, "group 'a' reduce-scatter issued");
    EXPECT_HAS(log, "group 'root' backward complete");
  }
}

}  // namespace
}  // namespace fsdp::testing::fully_shard_test
