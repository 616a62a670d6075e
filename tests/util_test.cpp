// The internal helpers every area shares: environment variables (src/util/env.h), the byte
// checksum (src/util/checksum.h), the pure part of cross-rank agreement
// (src/comm/rank_agreement.h; its collectives run in the fully_shard and checkpoint tests) and the
// free port (src/util/free_port.h).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>
#include <string>

#include "comm/rank_agreement.h"
#include "harness.h"
#include "util/checksum.h"
#include "util/env.h"
#include "util/free_port.h"

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

// Ports come from below the kernel's ephemeral range, where no outgoing connection takes its
// source port between the choice and the listener's bind (two test suites side by side lost a
// store's port that way), and a listener can take them.
TEST(FreePort, IsBelowTheEphemeralRangeAndCanBeListenedOn) {
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  ASSERT_TRUE(range >> low >> high);
  std::set<int> seen;
  for (int i = 0; i < 20; ++i) {
    const int port = detail::free_loopback_port();
    ASSERT_GT(port, 0);
    if (low > 11000) {
      EXPECT_GE(port, 10000);
      EXPECT_LT(port, low) << "a port of the ephemeral range " << low << "-" << high;
    }
    seen.insert(port);
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << port;
    EXPECT_EQ(::listen(fd, 1), 0) << port;
    ::close(fd);
  }
  EXPECT_GT(seen.size(), 10u) << "drawn at random, not one port for every caller";
}

}  // namespace
}  // namespace fsdp::testing::util_test
