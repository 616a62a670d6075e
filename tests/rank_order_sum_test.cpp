// The one rank-order summation (src/comm/rank_order_sum.h) on generated cases, against a left fold
// that ATen computes independently: every dtype it sums, 1 to 11 rows (each count up to 8 has its
// own one-pass loop, more go through an accumulator), lengths around and across its span, rows at
// odd offsets (unaligned), sums and averages, the output separate or one of the rows exactly (an
// in-place reduce-scatter's own block). Bitwise: the reduce-scatter paths promise these exact bits.
#include "comm/rank_order_sum.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "comm_data.h"
#include "harness.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::rank_order_sum_test {
namespace {

const at::ScalarType kTypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                 at::kLong,  at::kInt,    at::kChar, at::kByte};

at::ScalarType accumulator(at::ScalarType t) {
  if (t == at::kHalf || t == at::kBFloat16) return at::kFloat;
  return at::isFloatingType(t) ? t : at::kLong;
}

// Lengths that matter to a span of 2048 elements: tiny, around one span, several spans and a tail.
int64_t draw_length(std::mt19937_64& gen) {
  switch (gen() % 4) {
    case 0:
      return 1 + static_cast<int64_t>(gen() % 40);
    case 1:
      return 2048 - 2 + static_cast<int64_t>(gen() % 5);
    default:
      return 1 + static_cast<int64_t>(gen() % 9000);
  }
}

// Row values: order-sensitive floating values (comm_data.h), integers over the whole range (their
// sums wrap, as the kernel's do).
at::Tensor draw_row(int64_t n, uint64_t seed, at::ScalarType t) {
  if (at::isFloatingType(t)) return order_sensitive_values(n, seed, t);
  return random_bits(n, seed, t);
}

// ((rows[0] + rows[1]) + ...) [/ count], accumulated in `accumulator(t)`, rounded once.
at::Tensor left_fold(const std::vector<at::Tensor>& rows, bool average) {
  const at::ScalarType t = rows[0].scalar_type();
  auto acc = rows[0].to(accumulator(t));
  for (size_t j = 1; j < rows.size(); ++j) acc = acc.add(rows[j].to(accumulator(t)));
  if (average) acc = acc.div(at::full_like(acc, static_cast<double>(rows.size())));
  return acc.to(t);
}

TEST(RankOrderSumTest, GeneratedCasesEqualALeftFoldBitwise) {
  std::mt19937_64 gen(20261202);
  int cases = 0, in_place = 0;
  for (int round = 0; round < 800; ++round) {
    const at::ScalarType t = kTypes[gen() % std::size(kTypes)];
    const int count = 1 + static_cast<int>(gen() % 11);
    const int64_t n = draw_length(gen);
    const bool average = at::isFloatingType(t) && gen() % 2 == 0;
    // Rows live at odd element offsets inside larger buffers: no alignment to rely on.
    std::vector<at::Tensor> rows;
    for (int j = 0; j < count; ++j) {
      const int64_t pad = static_cast<int64_t>(gen() % 3);
      rows.push_back(draw_row(n + pad, gen(), t).narrow(0, pad, n));
    }
    const auto expected = left_fold(rows, average);
    const int target = gen() % 3 == 0 ? static_cast<int>(gen() % count) : -1;
    const auto output = target >= 0 ? rows[target] : at::full({n + 1}, 7, t).narrow(0, 1, n);
    detail::sum_in_rank_order(output, rows, average);
    ASSERT_TRUE(bit_equal(output, expected))
        << "round " << round << ": " << t << ", " << count << " rows of " << n
        << (average ? ", average" : ", sum")
        << (target >= 0 ? ", into row " + std::to_string(target) : std::string());
    ++cases;
    in_place += target >= 0;
  }
  EXPECT_GT(in_place, 100) << "too few in-place cases drawn: " << in_place << " of " << cases;
}

TEST(RankOrderSumTest, TheOrderIsVisibleInTheData) {
  // The check above could not tell a different order apart if the data summed alike in any order.
  std::vector<at::Tensor> rows;
  for (int j = 0; j < 4; ++j) rows.push_back(order_sensitive_values(4096, 100 + j, at::kFloat));
  auto forward = at::empty({4096});
  detail::sum_in_rank_order(forward, rows, false);
  std::vector<at::Tensor> reversed(rows.rbegin(), rows.rend());
  EXPECT_FALSE(bit_equal(forward, left_fold(reversed, false)));
  EXPECT_TRUE(bit_equal(forward, left_fold(rows, false)));
}

TEST(RankOrderSumTest, AnIntegerAverageIsRefusedByName) {
  auto rows = std::vector<at::Tensor>{at::ones({4}, at::kInt), at::ones({4}, at::kInt)};
  expect_error([&] { detail::sum_in_rank_order(at::empty({4}, at::kInt), rows, true); },
               {"would be truncated", "reduce with a sum and divide"});
}

}  // namespace
}  // namespace fsdp::testing::rank_order_sum_test
