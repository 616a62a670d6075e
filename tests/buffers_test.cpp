// src/core/buffers: rank 0's buffers to every rank in one flat broadcast (mixed dtypes, bool, 0-d),
// and the first buffer whose values differ across ranks.
#include "core/buffers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::buffers_test {
namespace {

// Buffers of several dtypes and shapes, filled from `seed`; a child module holds some.
struct BufferedImpl : torch::nn::Module {
  explicit BufferedImpl(int seed) {
    torch::manual_seed(seed);
    register_buffer("f64", torch::randn({3, 2}, torch::kDouble));
    register_buffer("count", torch::tensor(int64_t{seed}));  // 0-d
    register_buffer("mask", torch::rand({5}) > 0.5);
    child = register_module("child", torch::nn::BatchNorm1d(4));
    child->running_mean.copy_(torch::randn({4}));
    child->running_var.copy_(torch::rand({4}) + 0.5);
    weight = register_parameter("weight", torch::randn({2}));
  }
  torch::nn::BatchNorm1d child{nullptr};
  torch::Tensor weight;
};
TORCH_MODULE(Buffered);

std::vector<torch::Tensor> buffer_values(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& b : m.buffers()) out.push_back(b.clone());
  return out;
}

// World 2 and 3: every rank ends with rank 0's values, bit for bit, parameters untouched.
TEST(Buffers, BroadcastGivesEveryRankRankZerosValues) {
  for (int world : {2, 3}) {
    SCOPED_TRACE(world);
    run_ranks(world, [](Rank& r) {
      Buffered mine(r.rank + 1);
      const auto weight = mine->weight.clone();
      auto expected = buffer_values(*Buffered(1));
      ASSERT_EQ(expected.size(), 6u);
      auto comm = r.world();
      const int64_t before = comm->stats().collectives;
      detail::broadcast_buffers(*mine, *comm);
      EXPECT_EQ(comm->stats().collectives - before, 1) << "one flat broadcast";
      auto got = buffer_values(*mine);
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].scalar_type(), expected[i].scalar_type());
        EXPECT_TRUE(torch::equal(got[i], expected[i])) << "buffer #" << i;
      }
      EXPECT_TRUE(torch::equal(mine->weight, weight)) << "parameters are not buffers";
    });
  }
}

// The first differing buffer in named_buffers order and the first rank that differs, on every
// rank; nothing when all agree.
TEST(Buffers, FirstDifferingBufferIsNamed) {
  run_ranks(3, [](Rank& r) {
    Buffered m(1);
    auto comm = r.world();
    EXPECT_FALSE(detail::first_differing_buffer(*m, *comm).has_value());
    if (r.rank == 2) m->child->running_var.add_(1);
    if (r.rank == 1) m->child->num_batches_tracked.add_(1);
    auto d = detail::first_differing_buffer(*m, *comm);
    ASSERT_TRUE(d.has_value());
    EXPECT_EQ(d->name, "child.running_var");
    EXPECT_EQ(d->rank, 2);
    detail::broadcast_buffers(*m, *comm);
    EXPECT_FALSE(detail::first_differing_buffer(*m, *comm).has_value());
  });
}

}  // namespace
}  // namespace fsdp::testing::buffers_test
