// ShardOptions::ignored_params (FSDP2's ignored_params): the parameters named stay whole on every
// rank, are never gathered, freed or reduced (each rank's gradient is its own), are listed by the
// handle for the optimizer, and travel in state dicts (this rank's values) and checkpoints (rank
// 0's, with their optimizer state); every other parameter trains exactly as unsharded.
#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad_norm.h>
#include <fsdp/state_dict.h>

#include <filesystem>

#include "adversarial.h"
#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::ignored_params_test {
namespace {

namespace fs = std::filesystem;
using adv::Plain;

// Plain's a.bias (in a sharded child, activation-checkpointed or not) and scale (the root's own)
// left whole.
struct Sharded {
  fsdp::Sharded<Plain> m{Plain()};
  FSDPModule root;
  explicit Sharded(Rank& r, bool checkpointed = false) {
    m->to(torch::kDouble);
    ShardOptions child = audited();
    child.runtime.activation_checkpointing = checkpointed;
    child.ignored_params = {m->a->bias};
    fully_shard(m->a, r.world(), child);
    fully_shard(m->b, r.world(), audited());
    ShardOptions top = audited();
    top.ignored_params = {m->scale};
    root = fully_shard(m, r.world(), top);
  }
};

at::Tensor batch(int step, int rank) {
  torch::manual_seed(100 * step + rank);
  return torch::randn({4, 5}, torch::kDouble);
}

// Under activation checkpointing the recompute's backward reaches them too.
void trains_exactly(bool checkpointed) {
  run_ranks(2, [&](Rank& r) {
    torch::manual_seed(0);
    Sharded s(r, checkpointed);
    torch::manual_seed(0);
    Plain ref;
    ref->to(torch::kDouble);
    std::map<std::string, ShardInfo> by;
    for (auto& i : s.root.shards()) by[i.name] = i;
    ASSERT_EQ(by.size(), 6u);
    EXPECT_TRUE(by["a.bias"].ignored && by["scale"].ignored);
    EXPECT_FALSE(by["a.weight"].ignored || by["b.bias"].ignored || by["tiny"].ignored);
    EXPECT_TRUE(by["a.bias"].shard.is_same(s.m->a->bias));
    EXPECT_EQ(by["scale"].row_offset, 0);
    EXPECT_EQ(s.root.parameters().size(), 6u);
    const void* bias_at = s.m->a->bias.data_ptr();
    torch::optim::SGD opt(s.root.parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    auto named_ref = ref->named_parameters();
    for (int step = 0; step < 3; ++step) {
      s.m(batch(step, r.rank)).pow(2).mean().backward();
      // The reference: the mean over ranks, and this rank's own gradient of the ignored ones.
      for (int rr = 0; rr < 2; ++rr) (ref(batch(step, rr)).pow(2).mean() / 2).backward();
      auto own = torch::autograd::grad({ref(batch(step, r.rank)).pow(2).mean()},
                                       {ref->a->bias, ref->scale});
      ASSERT_TRUE(s.m->a->bias.grad().defined());
      EXPECT_TRUE(torch::allclose(s.m->a->bias.grad(), own[0], 0, 1e-12));
      EXPECT_TRUE(torch::allclose(s.m->scale.grad(), own[1], 0, 1e-12));
      EXPECT_EQ(s.m->a->bias.data_ptr(), bias_at);  // never freed nor moved
      for (auto& i : s.root.shards()) {
        if (i.ignored) continue;
        const at::Tensor& full = named_ref[i.name].grad();
        const int64_t n = i.shard.dim() == 0 ? 1 : i.shard.size(0);
        at::Tensor rows = i.global_shape.empty() ? full.reshape({1}).narrow(0, i.row_offset, n)
                                                 : full.narrow(0, i.row_offset, n);
        EXPECT_TRUE(torch::allclose(i.shard.grad().reshape(rows.sizes()), rows, 0, 1e-12))
            << i.name;
      }
      // The user's own synchronisation of the ignored gradients: then every rank steps alike.
      for (auto* t : {&s.m->a->bias, &s.m->scale})
        r.world()->all_reduce(t->mutable_grad(), ReduceOp::kAvg).wait();
      opt.step();
      ref_opt.step();
      opt.zero_grad();
      ref_opt.zero_grad();
    }
    auto full = full_state_dict(s.root);
    for (const auto& p : named_ref)
      EXPECT_TRUE(torch::allclose(full[p.key()], p.value(), 0, 1e-12)) << p.key();
  });
}

TEST(IgnoredParams, StayWholeWithEachRanksOwnGradientAndTheRestIsExact) { trains_exactly(false); }
TEST(IgnoredParams, ActivationCheckpointingReachesThem) { trains_exactly(true); }

// clip_grad_norm_ counts and scales the sharded gradients only: the ignored ones are each rank's
// own, and counting them would give each rank a coefficient of its own.
TEST(IgnoredParams, ClipGradNormLeavesThemOut) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    Sharded s(r);
    s.m(batch(0, r.rank)).pow(2).mean().backward();
    const at::Tensor bias = s.m->a->bias.grad().clone();
    double local = 0;
    for (auto& i : s.root.shards())
      if (!i.ignored) local += i.shard.grad().pow(2).sum().item<double>();
    auto sum = torch::tensor({local}, torch::kDouble);
    r.world()->all_reduce(sum, ReduceOp::kSum).wait();
    EXPECT_NEAR(clip_grad_norm_(s.root, 1e-3), std::sqrt(sum.item<double>()), 1e-12);
    EXPECT_TRUE(torch::equal(s.m->a->bias.grad(), bias));
  });
}

constexpr const char* kDirEnv = "FSDP_TEST_IGNORED_DIR";

// full_state_dict holds them (this rank's values); a checkpoint restores rank 0's values and their
// AdamW state on every rank, and the run continues as the saving run did.
TEST(IgnoredParams, StateDictsAndCheckpointsCarryThem) {
  auto dir = fs::temp_directory_path() / ("fsdp_ignored_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  RunOptions o;
  o.env[kDirEnv] = dir.string();
  run_ranks(
      2,
      [](Rank& r) {
        const std::string d = std::getenv(kDirEnv);
        auto train = [&](Sharded& s, torch::optim::AdamW& opt, int from, int to) {
          std::vector<double> losses;
          for (int step = from; step < to; ++step) {
            auto loss = s.m(batch(step, r.rank)).pow(2).mean();
            loss.backward();
            for (auto* t : {&s.m->a->bias, &s.m->scale})
              r.world()->all_reduce(t->mutable_grad(), ReduceOp::kAvg).wait();
            opt.step();
            opt.zero_grad();
            losses.push_back(loss.item<double>());
          }
          return losses;
        };
        torch::manual_seed(0);
        Sharded s(r);
        torch::optim::AdamW opt(s.root.parameters(), torch::optim::AdamWOptions(0.01));
        train(s, opt, 0, 2);
        auto sd = full_state_dict(s.root);
        EXPECT_TRUE(torch::equal(sd["scale"], s.m->scale.detach()));
        EXPECT_TRUE(torch::equal(sd["a.bias"], s.m->a->bias.detach()));
        auto ckpt = checkpoint::save(d, s.root, &opt, {2, 0, {}, {}}, *r.world());
        const auto straight = train(s, opt, 2, 4);

        torch::manual_seed(1);  // other initial values, overwritten by the load
        Sharded t(r);
        torch::optim::AdamW topt(t.root.parameters(), torch::optim::AdamWOptions(0.01));
        checkpoint::load(ckpt, t.root, &topt, *r.world());
        EXPECT_EQ(train(t, topt, 2, 4), straight);

        // load_full_state_dict sets them too.
        sd["scale"].fill_(0.25);
        load_full_state_dict(t.root, sd);
        EXPECT_TRUE(torch::equal(t.m->scale.detach(), torch::full({3}, 0.25, torch::kDouble)));
        {  // each rank's own values, not rank 0's
          torch::NoGradGuard no_grad;
          t.m->scale.fill_(r.rank);
        }
        EXPECT_TRUE(torch::equal(full_state_dict(t.root)["scale"],
                                 torch::full({3}, r.rank, torch::kDouble)));
      },
      o);
  fs::remove_all(dir);
}

// fully_shard_elements hands each element the ignored parameters that are its own; one that
// belongs to no element is refused before anything is sharded.
TEST(IgnoredParams, ContainerElementsTakeTheirOwn) {
  run_ranks(2, [](Rank& r) {
    auto mlp = [] {
      return torch::nn::Sequential(torch::nn::Linear(5, 6), torch::nn::ReLU(),
                                   torch::nn::Linear(6, 3));
    };
    torch::manual_seed(0);
    fsdp::Sharded<torch::nn::Sequential> other{mlp()};
    ShardOptions bad;
    bad.ignored_params = {torch::zeros({3})};
    EXPECT_HAS(error_of([&] { fully_shard_elements(other, r.world(), bad); }),
               "ignored_params[0] (shape [3]) is not a parameter of any element");
    EXPECT_EQ(fully_shard_elements(other, r.world()).size(), 2u);  // nothing was claimed

    torch::manual_seed(0);
    fsdp::Sharded<torch::nn::Sequential> seq{mlp()};
    auto* last = seq->ptr(2)->as<torch::nn::Linear>();
    ShardOptions o = audited();
    o.ignored_params = {last->bias};
    fully_shard_elements(seq, r.world(), o);
    auto root = fully_shard(seq, r.world(), audited());
    int ignored = 0;
    for (auto& i : root.shards()) ignored += i.ignored && i.shard.is_same(last->bias);
    EXPECT_EQ(ignored, 1);
    seq(torch::randn({4, 5})).sum().backward();
    // d(sum)/d(bias) = the rows of this rank's batch: 4 each, not reduced.
    EXPECT_TRUE(torch::equal(last->bias.grad(), torch::full({3}, 4.0)));
    EXPECT_GT(last->bias.storage().nbytes(), 0u);
  });
}

// A module holding one trainable weight w, shared by two sharded siblings: `keep` lists w among
// its ignored_params, `user` holds the module too (its own claim skips w, another group's ignored
// parameter), a frozen weight f applied to w and a bias b. Called twice, the second call on the
// first's output (the first on a tensor without grad, so no input-side node of the first call):
// the node of the first call that reads f leads only to w's gradient and runs after b's gradient,
// the last event of `user`'s own.
// `user` must stay gathered until the final callback ([Note: resharding during backward]).
struct WeightImpl : torch::nn::Module {
  WeightImpl() { w = register_parameter("w", torch::randn({3, 5}, torch::kDouble)); }
  at::Tensor w;
};
TORCH_MODULE(Weight);
struct KeepImpl : torch::nn::Module {
  explicit KeepImpl(Weight shared) {
    weight = register_module("weight", shared);
    lin = register_module("lin", torch::nn::Linear(5, 5));
    lin->to(torch::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) { return lin(x) + weight->w.sum(0); }
  Weight weight{nullptr};
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Keep);
struct UserImpl : torch::nn::Module {
  explicit UserImpl(Weight shared) {
    weight = register_module("weight", shared);
    f = register_parameter("f", torch::randn({5, 5}, torch::kDouble), /*requires_grad=*/false);
    b = register_parameter("b", torch::randn({5}, torch::kDouble));
  }
  // The node reading f is made first: in the first call's backward b's gradient, the group's last
  // event, comes before it.
  at::Tensor forward(const at::Tensor& x) {
    auto from_w = weight->w.matmul(f).sum(0);
    return (x * 0.5 + b) + from_w;
  }
  Weight weight{nullptr};
  at::Tensor f, b;
};
TORCH_MODULE(User);
struct SiblingsImpl : torch::nn::Module {
  SiblingsImpl() {
    Weight shared;
    keep = register_module("keep", fsdp::Sharded<Keep>{Keep(shared)});
    user = register_module("user", fsdp::Sharded<User>{User(shared)});
  }
  at::Tensor forward(const at::Tensor& x) { return user(user(x)).pow(2).sum() + keep(x).sum(); }
  fsdp::Sharded<Keep> keep{nullptr};
  fsdp::Sharded<User> user{nullptr};
};
TORCH_MODULE(Siblings);

TEST(IgnoredParams, AGroupSharingAnotherGroupsIgnoredWeightStaysGatheredForIt) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Siblings> m{Siblings()};
    torch::manual_seed(0);
    Siblings ref;
    ShardOptions keep = audited();
    keep.ignored_params = {m->keep->weight->w};
    fully_shard(m->keep, r.world(), keep);
    fully_shard(m->user, r.world(), audited());
    auto root = fully_shard(m, r.world(), audited());
    for (int step = 0; step < 2; ++step) {
      const auto x = batch(step, r.rank);  // no grad: the first call has no input-side node
      m(x).backward();
      ref(x).backward();
      // w is ignored: this rank's own gradient, as the unsharded model's on this rank's batch.
      EXPECT_TRUE(
          torch::allclose(m->keep->weight->w.grad(), ref->keep->weight->w.grad(), 1e-12, 1e-12));
      EXPECT_EQ(root.memory_stats().unsharded_bytes, 0);
    }
  });
}

// Two parameters that are views of one buffer, one of them ignored: stepping the ignored one in
// place moved the version counter the views share, and the other's group took it for a write to
// its gathered parameter in forward (guarantee fuzz seed 700270). Each sharded parameter has a
// counter of its own.
struct TwoViewsImpl : torch::nn::Module {
  TwoViewsImpl() {
    auto buf = torch::randn({24}, torch::kDouble);
    a = register_parameter("a", buf.narrow(0, 0, 16).view({4, 4}));
    b = register_parameter("b", buf.narrow(0, 16, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return x.matmul(a) + b; }
  at::Tensor a, b;
};
TORCH_MODULE(TwoViews);
struct TwoViewsNetImpl : torch::nn::Module {
  TwoViewsNetImpl() { block = register_module("block", fsdp::Sharded<TwoViews>{TwoViews()}); }
  at::Tensor forward(const at::Tensor& x) { return block(x).pow(2).sum(); }
  fsdp::Sharded<TwoViews> block{nullptr};
};
TORCH_MODULE(TwoViewsNet);

TEST(IgnoredParams, AViewOfTheSameBufferSteppedInPlaceIsNoWriteToTheOther) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<TwoViewsNet> m{TwoViewsNet()};
    ShardOptions o = audited();
    o.reshard_after_forward = false;
    o.ignored_params = {m->block->b};
    fully_shard(m->block, r.world(), o);
    auto root = fully_shard(m, r.world(), audited());
    torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(0.1));
    for (int step = 0; step < 3; ++step) {
      const auto x = batch(step, r.rank).narrow(1, 0, 4);
      m(x).backward();
      (void)m(x);  // a forward without backward: the block stays gathered across the step
      opt.step();  // steps the ignored b in place
      opt.zero_grad();
    }
  });
}

TEST(IgnoredParamsErrors, NameTheTensorAndTheFix) {
  run_ranks(1, [](Rank& r) {
    fsdp::Sharded<Plain> m{Plain()};
    ShardOptions o;
    o.ignored_params = {torch::ones({2})};
    auto msg = error_of([&] { fully_shard(m->a, r.world(), o); });
    EXPECT_HAS(msg, "ignored_params[0] (shape [2]) is not a parameter of this module");
    fully_shard(m->a, r.world());
    o.ignored_params = {m->a->weight};
    msg = error_of([&] { fully_shard(m, r.world(), o); });
    EXPECT_HAS(msg, "ignored parameter 'a.weight' is already managed by sharded submodule 'a'");
    EXPECT_HAS(msg, "pass it in that submodule's ignored_params");
    EXPECT_NO_THROW(fully_shard(m, r.world()));  // the failed calls claimed nothing
  });
}

}  // namespace
}  // namespace fsdp::testing::ignored_params_test
