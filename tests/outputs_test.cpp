// Forwards returning tuples, pairs, vectors, optionals and non-tensor values through
// fsdp::Sharded: every tensor gets its pre-backward hook, the rest passes through, and training
// matches the unsharded model (fp64, world 2, audit on).
#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::outputs_test {
namespace {

struct TupleBlockImpl : torch::nn::Module {
  TupleBlockImpl() {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
  }
  std::tuple<torch::Tensor, std::pair<torch::Tensor, int>, std::vector<torch::Tensor>,
             std::optional<torch::Tensor>, std::string>
  forward(const torch::Tensor& x) {
    auto ha = torch::tanh(a(x));
    auto hb = b(x);
    return {ha, {hb, 7}, {ha * hb, hb.pow(2)}, std::nullopt, "tag"};
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TupleBlock);

struct TupleNetImpl : torch::nn::Module {
  TupleNetImpl() {
    block = register_module("block", TupleBlock());
    head = register_module("head", torch::nn::Linear(4, 2));
    to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto [ha, pair, vec, none, tag] = block(x);
    EXPECT_EQ(pair.second, 7);
    EXPECT_EQ(tag, "tag");
    EXPECT_FALSE(none.has_value());
    return head(ha + pair.first + vec[0] + vec[1]).pow(2).sum();
  }
  fsdp::Sharded<TupleBlock> block{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TupleNet);

TEST(Outputs, TuplesPairsVectorsAndValuesPassThrough) {
  const int world = 2;
  run_ranks(world, [&](Rank& r) {
    auto input = [](int rank) {
      torch::manual_seed(10 + rank);
      // Requires grad: the input gradient needs the gathered weights, so a missed hook fails.
      return torch::randn({3, 4}, torch::kDouble).set_requires_grad(true);
    };
    torch::manual_seed(0);
    TupleNet ref;
    torch::manual_seed(0);
    fsdp::Sharded<TupleNet> model{TupleNet()};
    const ShardOptions o = audited();
    fully_shard(model->block, r.world(), o);
    auto root = fully_shard(model, r.world(), o);
    model(input(r.rank)).backward();
    for (int k = 0; k < world; ++k) ref->forward(input(k)).backward();
    const GradMap mean = mean_of_accumulated_grads(*ref, world);
    EXPECT_EQ(expect_shard_grads(root, mean, 1e-9, 1e-12), 6);
  });
}

// Ranks that built their models from different seeds are told at fully_shard, by parameter;
// sync_module_states starts every rank from rank 0's values instead.
TEST(InitialValues, DifferingRanksAreNamedOrSynced) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(r.rank);
    fsdp::Sharded<TupleNet> differing{TupleNet()};
    expect_error([&] { fully_shard(differing->block, r.world()); },
                 {"parameter 'a.weight' has different initial values on rank 1 than on rank 0",
                  "sync_module_states"});

    torch::manual_seed(0);
    TupleNet rank0;
    torch::manual_seed(r.rank);
    fsdp::Sharded<TupleNet> synced{TupleNet()};
    ShardOptions o;
    o.runtime.sync_module_states = true;
    fully_shard(synced->block, r.world(), o);
    auto root = fully_shard(synced, r.world(), o);
    expect_shards_equal(root, *rank0, 0, 0);
  });
}

}  // namespace
}  // namespace fsdp::testing::outputs_test
