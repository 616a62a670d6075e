// The internal helpers every area shares: environment variables (src/util/env.h), the byte
// checksum (src/util/checksum.h) and the pure part of cross-rank agreement
// (src/comm/rank_agreement.h; its collectives run in the fully_shard and checkpoint tests).
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "comm/rank_agreement.h"
#include "harness.h"
#include "util/checksum.h"
#include "util/env.h"

namespace fsdp::testing::util_test {
namespace {

using detail::EnvLookup;

EnvLookup lookup_of(const std::map<std::string, std::string>& env) {
  return [env](const char* k) -> const char* {
    auto it = env.find(k);
    return it == env.end() ? nullptr : it->second.c_str();
  };
}

std::string error_text(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

TEST(Env, StringAndFlag) {
  auto env = lookup_of({{"A", "x"}, {"EMPTY", ""}, {"ZERO", "0"}, {"ONE", "1"}});
  EXPECT_EQ(detail::env_string("A", env), "x");
  EXPECT_EQ(detail::env_string("EMPTY", env), std::nullopt);
  EXPECT_EQ(detail::env_string("UNSET", env), std::nullopt);
  EXPECT_EQ(detail::env_value("EMPTY", env), nullptr);
  EXPECT_TRUE(detail::env_flag("ONE", env));
  EXPECT_FALSE(detail::env_flag("ZERO", env));
  EXPECT_FALSE(detail::env_flag("EMPTY", env));
  EXPECT_FALSE(detail::env_flag("UNSET", env));
}

TEST(Env, Int) {
  auto env = lookup_of({{"N", "42"}, {"BAD", "4x"}, {"BIG", "99"}});
  EXPECT_EQ(detail::env_int("N", 1, 50, env), 42);
  EXPECT_EQ(detail::env_int("UNSET", 1, 50, env), std::nullopt);
  EXPECT_NE(error_text([&] {
              detail::env_int("BAD", 1, 50, env);
            }).find("environment variable BAD='4x' is not an integer; set it to a number in 1..50"),
            std::string::npos);
  EXPECT_NE(error_text([&] {
              detail::env_int("BIG", 1, 50, env);
            }).find("environment variable BIG=99 is out of range 1..50"),
            std::string::npos);
  EXPECT_EQ(detail::env_int_hint("N", 1, 50, env), 42);
  EXPECT_EQ(detail::env_int_hint("BAD", 1, 50, env), std::nullopt);
  EXPECT_EQ(detail::env_int_hint("BIG", 1, 50, env), std::nullopt);
}

TEST(Env, PositiveAndChoice) {
  auto env = lookup_of({{"T", "2.5"}, {"NEG", "-1"}, {"MODE", "ring"}, {"ODD", "star"}});
  EXPECT_EQ(detail::env_positive("T", "seconds", env), 2.5);
  EXPECT_EQ(detail::env_positive("UNSET", "seconds", env), std::nullopt);
  EXPECT_NE(error_text([&] {
              detail::env_positive("NEG", "seconds", env);
            }).find("NEG='-1' is not a positive number of seconds"),
            std::string::npos);
  EXPECT_EQ(detail::env_choice("MODE", {"direct", "ring"}, "direct", env), "ring");
  EXPECT_EQ(detail::env_choice("UNSET", {"direct", "ring"}, "direct", env), "direct");
  EXPECT_NE(error_text([&] {
              detail::env_choice("ODD", {"direct", "ring"}, "direct", env);
            }).find("environment variable ODD='star' is not one of direct, ring"),
            std::string::npos);
}

TEST(Checksum, BytesAndValues) {
  const std::string a = "abc", b = "abd";
  EXPECT_EQ(detail::checksum_bytes(a.data(), a.size()), detail::checksum_bytes(a.data(), 3));
  EXPECT_NE(detail::checksum_bytes(a.data(), a.size()), detail::checksum_bytes(b.data(), 3));
  auto t = at::arange(10, at::kFloat);
  EXPECT_EQ(detail::value_checksum(t), detail::value_checksum(t.clone()));
  EXPECT_EQ(detail::value_checksum(t.view({2, 5}).t()),
            detail::value_checksum(t.view({2, 5}).t().contiguous()));
  EXPECT_NE(detail::value_checksum(t), detail::value_checksum(t + 1));
  EXPECT_GE(detail::value_checksum(t), 0);
}

TEST(RankAgreement, FirstDifferenceFromRank0) {
  using V = std::vector<std::vector<int64_t>>;
  EXPECT_FALSE(detail::first_difference_from_rank0(V{{1, 2}}));
  EXPECT_FALSE(detail::first_difference_from_rank0(V{{1, 2}, {1, 2}, {1, 2}}));
  auto d = detail::first_difference_from_rank0(V{{1, 2, 3}, {1, 2, 3}, {1, 5, 4}, {1, 6, 3}});
  ASSERT_TRUE(d);
  EXPECT_EQ(d->index, 1u);
  EXPECT_EQ(d->rank, 2);
  d = detail::first_difference_from_rank0(
      V{{1, 2}, {1, 2, 3}});  // a longer list differs at its end
  ASSERT_TRUE(d);
  EXPECT_EQ(d->index, 2u);
  EXPECT_EQ(d->rank, 1);
  d = detail::first_difference_from_rank0(V{{1, 2}, {1}});
  ASSERT_TRUE(d);
  EXPECT_EQ(d->index, 1u);
}

}  // namespace
}  // namespace fsdp::testing::util_test
