// The guarantee when ranks take different paths through the same modules, and the root's and a
// forward's lifecycle around them (issue: agreement on both lanes). fp64 against the unsharded
// model (mean of every rank's full gradients) at 1e-9, audit on and off, world sizes 2 and 3.
#include "core/faults.h"
#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::guarantee_paths_test {
namespace {

using SLinear = fsdp::Sharded<torch::nn::Linear>;

torch::Tensor input_for(int rank, int iteration = 0, bool requires_grad = false) {
  torch::manual_seed(100 + 10 * rank + iteration);
  return torch::randn({3, 4}, torch::kDouble).set_requires_grad(requires_grad);
}

// Two branches of two blocks each, every block called on every rank; `rows` sets the branches'
// hidden widths (equal: groups of equal size, whose mixed-up shards would go unnoticed by Gloo).
struct TwoBranchImpl : torch::nn::Module {
  explicit TwoBranchImpl(int64_t rows_a = 6, int64_t rows_b = 6) {
    a1 = register_module("a1", torch::nn::Linear(4, rows_a));
    a2 = register_module("a2", torch::nn::Linear(rows_a, 4));
    b1 = register_module("b1", torch::nn::Linear(4, rows_b));
    b2 = register_module("b2", torch::nn::Linear(rows_b, 4));
    scale = register_parameter("scale", torch::ones({4}, torch::kDouble));
    to(torch::kDouble);
  }
  // Rank 0's loss uses branch a, the other ranks' branch b; the root's parameter is used on rank
  // 0 only when `root_on_rank0_only`.
  torch::Tensor forward(const torch::Tensor& x, int rank, bool root_on_rank0_only) {
    auto ya = a2(torch::tanh(a1(x)));
    auto yb = b2(torch::tanh(b1(x)));
    auto y = rank == 0 ? ya : yb;
    if (!root_on_rank0_only || rank == 0) y = y * scale;
    return y.pow(2).sum();
  }
  SLinear a1{nullptr}, a2{nullptr}, b1{nullptr}, b2{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(TwoBranch);

struct PathCase {
  int world;
  bool audit;
};
std::string case_name(const ::testing::TestParamInfo<PathCase>& info) {
  return "world" + std::to_string(info.param.world) + (info.param.audit ? "_audit" : "_noaudit");
}

class Paths : public ::testing::TestWithParam<PathCase> {
 protected:
  ShardOptions opts() const {
    ShardOptions o;
    o.debug.audit = GetParam().audit;
    return o;
  }
  // Shards the four blocks and the root; returns the root handle.
  FSDPModule shard(fsdp::Sharded<TwoBranch>& m, Rank& r, ShardOptions child, ShardOptions root) {
    for (auto* b : {&m->a1, &m->a2, &m->b1, &m->b2}) fully_shard(*b, r.world(), child);
    return fully_shard(m, r.world(), root);
  }
  // Runs `iterations` steps of forward, backward, check against the reference, SGD; `between`
  // runs after each backward, before the step.
  template <class Between>
  void train_and_compare(int64_t rows_a, int64_t rows_b, bool root_on_rank0_only,
                         std::optional<bool> root_reshard, Between between, int iterations = 2) {
    const int world = GetParam().world;
    run_ranks(world, [&](Rank& r) {
      torch::manual_seed(0);
      TwoBranch ref(rows_a, rows_b);
      torch::manual_seed(0);
      fsdp::Sharded<TwoBranch> model{TwoBranch(rows_a, rows_b)};
      ShardOptions root_opts = opts();
      root_opts.reshard_after_forward = root_reshard;
      auto root = shard(model, r, opts(), root_opts);
      for (int it = 0; it < iterations; ++it) {
        SCOPED_TRACE("iteration " + std::to_string(it));
        model(input_for(r.rank, it), r.rank, root_on_rank0_only).backward();
        ref->zero_grad();
        for (int k = 0; k < world; ++k)
          ref->forward(input_for(k, it), k, root_on_rank0_only).backward();
        const GradMap mean = mean_of_accumulated_grads(*ref, world);
        EXPECT_GT(expect_shard_grads(root, mean, 1e-9, 1e-12), 0);
        EXPECT_EQ(root.memory_stats().unsharded_bytes, 0);
        between(model, r.rank, it);
        torch::NoGradGuard no_grad;
        for (const auto& s : root.shards()) {
          s.shard.sub_(s.shard.grad() * 0.1);
          s.shard.mutable_grad() = torch::Tensor();
        }
        for (auto& item : ref->named_parameters()) item.value().sub_(mean.at(item.key()) * 0.1);
      }
      expect_shards_equal(root, *ref, 1e-9, 1e-12);
    });
  }
};

auto nothing = [](auto&, int, int) {};

TEST_P(Paths, RanksUseDifferentOutputsEqualGroupSizes) {
  train_and_compare(6, 6, false, std::nullopt, nothing);
}

TEST_P(Paths, RanksUseDifferentOutputsUnequalGroupSizes) {
  train_and_compare(5, 9, false, std::nullopt, nothing);
}

TEST_P(Paths, RootParametersUsedOnOneRankOnly) {
  train_and_compare(6, 7, true, std::nullopt, nothing);
}

TEST_P(Paths, RootReshardsAfterForwardAndIsUsedOnOneRankOnly) {
  train_and_compare(6, 7, true, true, nothing);
}

// An evaluation forward between backward() and the optimizer step leaves the root gathered; the
// next step must see the stepped values, not the gathered ones.
TEST_P(Paths, NoGradForwardBetweenBackwardAndStep) {
  train_and_compare(
      6, 7, false, std::nullopt,
      [](auto& m, int rank, int it) {
        torch::NoGradGuard no_grad;
        m(input_for(rank, 50 + it), rank, false);
      },
      3);
}

TEST_P(Paths, GradForwardWithoutBackwardBetweenBackwardAndStep) {
  train_and_compare(
      6, 7, false, std::nullopt,
      [](auto& m, int rank, int it) { m(input_for(rank, 60 + it), rank, false); }, 3);
}

INSTANTIATE_TEST_SUITE_P(World, Paths,
                         ::testing::Values(PathCase{2, true}, PathCase{2, false}, PathCase{3, true},
                                           PathCase{3, false}),
                         case_name);

// ---- single-process cases: the forward's own lifecycle ----

// A module with two outputs from one node (chunk): the loss uses one, so the other's hook fires
// with an undefined gradient.
struct ChunkImpl : torch::nn::Module {
  ChunkImpl() { lin = register_module("lin", torch::nn::Linear(4, 8)); }
  std::vector<torch::Tensor> forward(const torch::Tensor& x) { return lin(x).chunk(2, 1); }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Chunk);

// Modifies its input in place inside forward.
struct InPlaceImpl : torch::nn::Module {
  InPlaceImpl() { lin = register_module("lin", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(torch::Tensor x) {
    x.mul_(2);
    return lin(x) + x;
  }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(InPlace);

// Throws from its forward when asked to.
struct ThrowImpl : torch::nn::Module {
  ThrowImpl() { lin = register_module("lin", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(const torch::Tensor& x, bool fail) {
    auto y = lin(x);
    if (fail) throw std::runtime_error("user error inside forward");
    return y;
  }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Throw);

struct LifeImpl : torch::nn::Module {
  LifeImpl() {
    chunk = register_module("chunk", Chunk());
    inplace = register_module("inplace", InPlace());
    thrower = register_module("thrower", Throw());
    next = register_module("next", torch::nn::Linear(4, 4));
    w = register_parameter("w", torch::randn({4, 4}) * 0.3);
    to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x, bool fail) {
    auto h = torch::tanh(x.matmul(w));
    auto parts = chunk(h);
    auto y = inplace(parts[0] * 1.0);  // parts[1] unused: its hook sees no gradient
    y = thrower(y, fail);
    return next(y).pow(2).sum();
  }
  fsdp::Sharded<Chunk> chunk{nullptr};
  fsdp::Sharded<InPlace> inplace{nullptr};
  fsdp::Sharded<Throw> thrower{nullptr};
  SLinear next{nullptr};
  torch::Tensor w;
};
TORCH_MODULE(Life);

class Lifecycle : public ::testing::TestWithParam<int> {};

// Undefined gradients at an output, in-place modification of an input, and an exception in a
// child's forward: memory back to its pre-step value, and the next step exact.
TEST_P(Lifecycle, UndefinedGradsInPlaceInputsAndAThrowingForward) {
  const int world = GetParam();
  run_ranks(world, [&](Rank& r) {
    torch::manual_seed(0);
    Life ref;
    torch::manual_seed(0);
    fsdp::Sharded<Life> model{Life()};
    const ShardOptions o = audited();
    fully_shard(model->chunk, r.world(), o);
    fully_shard(model->inplace, r.world(), o);
    fully_shard(model->thrower, r.world(), o);
    fully_shard(model->next, r.world(), o);
    auto root = fully_shard(model, r.world(), o);
    auto step_and_compare = [&](int it) {
      model(input_for(r.rank, it), false).backward();
      ref->zero_grad();
      for (int k = 0; k < world; ++k) ref->forward(input_for(k, it), false).backward();
      const GradMap mean = mean_of_accumulated_grads(*ref, world);
      EXPECT_GT(expect_shard_grads(root, mean, 1e-9, 1e-12), 0);
      for (const auto& s : root.shards()) s.shard.mutable_grad() = torch::Tensor();
    };
    step_and_compare(0);
    // The failing forward runs with forward prefetch (recorded order) in flight.
    const auto before = root.memory_stats();
    try {
      model(input_for(r.rank), true);
      ADD_FAILURE() << "the forward did not throw";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("user error inside forward"), std::string::npos);
    }
    EXPECT_EQ(root.memory_stats().unsharded_bytes, before.unsharded_bytes);
    EXPECT_EQ(root.memory_stats().unsharded_groups, before.unsharded_groups);
    step_and_compare(1);
  });
}

// ---- a backward that throws ----

// Identity whose backward throws while `fail` is set (the same on every rank).
bool g_fail_backward = false;
struct FailingBackward : torch::autograd::Function<FailingBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    if (g_fail_backward) throw std::runtime_error("user error inside backward");
    return grads;
  }
};

struct FailNetImpl : torch::nn::Module {
  FailNetImpl() {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
    to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return b(FailingBackward::apply(torch::tanh(a(x)))).pow(2).sum();
  }
  SLinear a{nullptr}, b{nullptr};
};
TORCH_MODULE(FailNet);

// The engine skips final callbacks when backward throws; the next step still matches the
// unsharded model exactly.
TEST_P(Lifecycle, ABackwardThatThrowsLeavesTheNextStepExact) {
  const int world = GetParam();
  run_ranks(world, [&](Rank& r) {
    torch::manual_seed(0);
    FailNet ref;
    torch::manual_seed(0);
    fsdp::Sharded<FailNet> model{FailNet()};
    const ShardOptions o = audited();
    fully_shard(model->a, r.world(), o);
    fully_shard(model->b, r.world(), o);
    auto root = fully_shard(model, r.world(), o);
    g_fail_backward = true;
    try {
      model(input_for(r.rank)).backward();
      ADD_FAILURE() << "the backward did not throw";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("user error inside backward"), std::string::npos);
    }
    g_fail_backward = false;
    for (const auto& s : root.shards()) s.shard.mutable_grad() = torch::Tensor();
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    model(input_for(r.rank, 1)).backward();
    for (int k = 0; k < world; ++k) ref->forward(input_for(k, 1)).backward();
    EXPECT_GT(expect_shard_grads(root, mean_of_accumulated_grads(*ref, world), 1e-9, 1e-12), 0);
  });
}

INSTANTIATE_TEST_SUITE_P(World, Lifecycle, ::testing::Values(1, 2, 3));

// ---- reading a resharded parameter: a clear error naming it, never a crash ----

struct ReaderImpl : torch::nn::Module {
  ReaderImpl() {
    child = register_module("child", torch::nn::Linear(4, 4));
    w = register_parameter("w", torch::ones({4}));
  }
  torch::Tensor forward(const torch::Tensor& x, bool parent_reads_child) {
    auto y = child(x) * w;
    if (parent_reads_child) y = y + child->weight.abs().sum();  // a child's weight, outside it
    return y.sum();
  }
  SLinear child{nullptr};
  torch::Tensor w;
};
TORCH_MODULE(Reader);

TEST(ReshardedReads, EachUseNamesTheParameterAndTheFix) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Reader> m{Reader()};
    fully_shard(m->child, r.world());
    auto root = fully_shard(m, r.world());
    // A child's weight used in the loss outside any forward.
    expect_error(
        [&] {
          (m(input_for(0).to(torch::kFloat), false) + m->child->weight.pow(2).sum()).backward();
        },
        {"aten::pow was called on parameter 'child.weight' of sharded module 'child'",
         "whose full storage is freed (resharded)", "FSDPModule::named_parameters()"});
    // A parent reducing a child's weight inside the parent's forward.
    expect_error([&] { m(input_for(0).to(torch::kFloat), true); },
                 {"aten::abs was called on parameter 'child.weight'"});
    // A root parameter read for logging between steps (the root reshards after backward).
    m(input_for(0).to(torch::kFloat), false).backward();
    expect_error([&] { (void)m->w.sum().item<float>(); },
                 {"aten::sum was called on parameter 'w' of sharded module 'root'",
                  "call unshard() on the module's FSDPModule first"});
    // Metadata stays readable, and unshard() makes the values readable.
    EXPECT_EQ(m->w.sizes(), torch::IntArrayRef({4}));
    root.unshard();
    EXPECT_EQ(m->w.sum().item<float>(), 4.0f);
    root.reshard();
  });
}

// The audit compares the all-gather lane too: a rank that swaps two backward all-gathers of
// equal size (silently mixed shards otherwise) is reported by name.
TEST(GatherLaneAudit, CatchesAllGathersOutOfOrder) {
  RunOptions opts;
  run_ranks(
      2,
      [&](Rank& r) {
        torch::manual_seed(0);
        fsdp::Sharded<TwoBranch> m{TwoBranch(4, 4)};  // equal padded sizes at world 2
        detail::faults::inject({.gather_order = true});
        const ShardOptions o = audited();
        for (auto* b : {&m->a1, &m->a2, &m->b1, &m->b2}) fully_shard(*b, r.world(), o);
        fully_shard(m, r.world(), o);
        try {
          m(input_for(r.rank), 0, false).backward();
          ADD_FAILURE() << "the audit did not report the swapped all-gathers";
        } catch (const std::exception& e) {
          EXPECT_NE(std::string(e.what()).find("Agreed: all-gather #"), std::string::npos)
              << e.what();
        }
      },
      opts);
}

}  // namespace
}  // namespace fsdp::testing::guarantee_paths_test
