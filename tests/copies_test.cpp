// The copies between a group's flat buffers and its parameters (core/param.h): where both sides
// are contiguous host tensors of one dtype they move bytes directly ([Note: plain host copies] in
// src/core/param.cpp), elsewhere through ATen. Each case runs both paths on the same values (the
// ATen path forced by a strided view of the same numbers) and asks for the same bits, padding
// and untouched columns included, for every rank of a world whose last ranks hold fewer rows or
// none.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "core/param.h"

namespace fsdp::detail {
namespace {

constexpr int kWorld = 3;
constexpr int64_t kOffset = 5;  // the parameter's columns start inside the flat buffer

// The values of `t` in a buffer twice as wide, every other element: not contiguous, so every
// copy from or into it takes ATen's path.
at::Tensor strided_copy(const at::Tensor& t) {
  at::Tensor wide = at::full({t.numel(), 2}, -3.0, t.options());
  wide.select(1, 0).copy_(t.reshape({-1}));
  return wide.select(1, 0).view(t.sizes());
}

struct Case {
  std::vector<int64_t> shape;  // sharded on dim 0; {} is a 0-d parameter
  at::ScalarType dtype;
};

std::string describe(const Case& c, int rank) {
  return "shape " + c10::str(c10::IntArrayRef(c.shape)) + " " + c10::toString(c.dtype) + " rank " +
         std::to_string(rank);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (at::ScalarType dt : {at::kFloat, at::kDouble, at::kBFloat16})
    for (std::vector<int64_t> shape : {std::vector<int64_t>{5, 3}, {2, 4}, {7}, {}})
      out.push_back({shape, dt});
  return out;
}

at::Tensor make_param(const Case& c) {
  torch::manual_seed(11);
  return torch::randn(c.shape, at::TensorOptions().dtype(c.dtype)).set_requires_grad(true);
}

ParamState state_of(const Case& c, int rank) {
  return ParamState("p", make_param(c), 0, rank, kWorld, std::nullopt);
}

int64_t flat_width(const ParamState& p) { return kOffset + p.padded_numel() + 3; }

// Garbage everywhere, so that a missed or misplaced write shows.
at::Tensor garbage(std::vector<int64_t> shape, at::ScalarType dt) {
  return at::full(shape, 7.0, at::TensorOptions().dtype(dt));
}

TEST(PlainHostCopies, PackingAGradientGivesTheBitsOfTheAtenPath) {
  for (const Case& c : cases())
    for (int rank = 0; rank < kWorld; ++rank)
      for (bool has_grad : {true, false}) {
        SCOPED_TRACE(describe(c, rank) + (has_grad ? " with a gradient" : " without"));
        ParamState plain = state_of(c, rank), reference = state_of(c, rank);
        torch::manual_seed(12);
        at::Tensor g = torch::randn(c.shape, at::TensorOptions().dtype(c.dtype));
        if (has_grad) {
          plain.param().mutable_grad() = g.clone();
          reference.param().mutable_grad() = g.clone();
        }
        at::Tensor send = garbage({kWorld, flat_width(plain)}, c.dtype);
        at::Tensor strided_send = strided_copy(send);
        ASSERT_FALSE(strided_send.is_contiguous());
        plain.pack_grad(send, kOffset);
        reference.pack_grad(strided_send, kOffset);
        EXPECT_TRUE(at::equal(send, strided_send));
        EXPECT_EQ(plain.contributed(), has_grad);
        EXPECT_FALSE(plain.param().grad().defined());  // handed over
        // The columns hold rank r's rows, then zeros: checked against the definition too.
        const at::Tensor rows = g.reshape({plain.rows(), -1});
        for (int r = 0; r < kWorld; ++r) {
          const int64_t n = has_grad ? plain.rows_of(r) * plain.row_numel() : 0;
          at::Tensor cols = send[r].narrow(0, kOffset, plain.padded_numel());
          if (n > 0) {
            EXPECT_TRUE(
                at::equal(cols.narrow(0, 0, n),
                          rows.narrow(0, plain.row_offset_of(r), plain.rows_of(r)).reshape({-1})));
          }
          EXPECT_TRUE(at::equal(cols.narrow(0, n, plain.padded_numel() - n),
                                at::zeros({plain.padded_numel() - n}, send.options())));
          EXPECT_EQ(send[r][0].item<double>(), 7.0);  // columns before the parameter's untouched
        }
      }
}

TEST(PlainHostCopies, AddingTheReducedRowsGivesTheBitsOfTheAtenPath) {
  for (const Case& c : cases())
    for (int rank = 0; rank < kWorld; ++rank) {
      SCOPED_TRACE(describe(c, rank));
      ParamState plain = state_of(c, rank), reference = state_of(c, rank);
      const int64_t width = flat_width(plain);
      torch::manual_seed(13);
      at::Tensor first = torch::randn({width}, at::TensorOptions().dtype(c.dtype));
      at::Tensor second = torch::randn({width}, at::TensorOptions().dtype(c.dtype));
      // A gradient created from none, then one accumulated into (gradient accumulation).
      plain.add_shard_grad(first, kOffset);
      reference.add_shard_grad(strided_copy(first), kOffset);
      ASSERT_TRUE(plain.shard().grad().defined());
      EXPECT_TRUE(at::equal(plain.shard().grad(), reference.shard().grad()));
      EXPECT_TRUE(at::equal(plain.shard().grad().reshape({-1}),
                            first.narrow(0, kOffset, plain.shard().numel())));
      const at::Tensor created = plain.shard().grad();
      const auto version = created._version();
      plain.add_shard_grad(second, kOffset);
      reference.add_shard_grad(strided_copy(second), kOffset);
      EXPECT_TRUE(at::equal(plain.shard().grad(), reference.shard().grad()));
      EXPECT_TRUE(plain.shard().grad().is_same(created));  // added in place, as add_ does
      if (plain.shard().numel() > 0) {
        EXPECT_EQ(created._version(), version + 1);
        EXPECT_FALSE(at::equal(plain.shard().grad().reshape({-1}),
                               first.narrow(0, kOffset, plain.shard().numel())));
      }
      // Nobody contributed: a gradient created by the reduction goes again.
      ParamState unused = state_of(c, rank);
      unused.add_shard_grad(first, kOffset);
      unused.settle_shard_grad(/*any_rank=*/false);
      EXPECT_FALSE(unused.shard().grad().defined());
    }
}

TEST(PlainHostCopies, CopyingTheGatheredRowsOutGivesTheBitsOfTheAtenPath) {
  for (const Case& c : cases())
    for (int rank = 0; rank < kWorld; ++rank) {
      SCOPED_TRACE(describe(c, rank));
      ParamState plain = state_of(c, rank), reference = state_of(c, rank);
      const at::Tensor want = plain.param().detach().clone();
      // What an all-gather leaves: every rank's padded rows at the parameter's columns.
      at::Tensor gathered = garbage({kWorld, flat_width(plain)}, c.dtype);
      const at::Tensor rows = want.reshape({plain.rows(), -1});
      for (int r = 0; r < kWorld; ++r)
        gathered[r]
            .narrow(0, kOffset, plain.rows_of(r) * plain.row_numel())
            .copy_(rows.narrow(0, plain.row_offset_of(r), plain.rows_of(r)).reshape({-1}));
      at::Tensor block = garbage({want.numel() + 16}, c.dtype);
      at::Tensor reference_block = garbage({want.numel() + 16}, c.dtype);
      plain.copy_out(gathered, kOffset, block, 0);
      reference.copy_out(strided_copy(gathered), kOffset, reference_block, 0);
      EXPECT_TRUE(at::equal(block, reference_block));
      EXPECT_TRUE(at::equal(plain.param().detach(), want));
      EXPECT_EQ(block[want.numel()].item<double>(), 7.0);  // nothing written past the parameter
    }
}

TEST(PlainHostCopies, CopyingTheShardInGivesTheBitsOfTheAtenPath) {
  for (const Case& c : cases())
    for (int rank = 0; rank < kWorld; ++rank) {
      SCOPED_TRACE(describe(c, rank));
      ParamState plain = state_of(c, rank);
      at::Tensor send = garbage({plain.padded_numel() + 2}, c.dtype);
      at::Tensor strided_send = strided_copy(send);
      plain.copy_in_shard(send.narrow(0, 0, plain.padded_numel()));
      plain.copy_in_shard(strided_send.narrow(0, 0, plain.padded_numel()));
      EXPECT_TRUE(at::equal(send, strided_send));
      const int64_t n = plain.shard().numel();
      EXPECT_TRUE(at::equal(send.narrow(0, 0, n), plain.shard().detach().reshape({-1})));
      EXPECT_TRUE(at::equal(send.narrow(0, n, plain.padded_numel() - n),
                            at::zeros({plain.padded_numel() - n}, send.options())));
      EXPECT_EQ(send[plain.padded_numel()].item<double>(), 7.0);
    }
}

}  // namespace
}  // namespace fsdp::detail
