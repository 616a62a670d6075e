// Communicator tests on real ranks (processes over loopback Gloo): every collective x dtype x world
// size 1-4 against a locally computed reference, overlap with compute, input validation, and the
// timeout errors of a missing peer.
#include <ATen/ATen.h>
#include <fsdp/communicator.h>
#include <fsdp/error.h>
#include <fsdp/init.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <thread>

#include "comm/communicator_impl.h"
#include "comm_data.h"
#include "harness.h"
#include "util/checksum.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::comm_test {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

const at::ScalarType kDtypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A distinct seed per (case, dtype, rank) so every rank can rebuild every other rank's input.
uint64_t seed_of(int op, at::ScalarType t, int rank, int64_t n) {
  return 1000003ull * op + 10007ull * static_cast<int>(t) + 101ull * rank +
         static_cast<uint64_t>(n);
}

// Exact reference of a SUM/AVG over ranks: sum in fp64 (exact for exact_sum_values), divide in the
// dtype the implementation divides in (fp32 for low precision), round once to `t`.
at::Tensor reduce_reference(const std::vector<at::Tensor>& contributions, ReduceOp op,
                            at::ScalarType t) {
  const bool low = t == at::kHalf || t == at::kBFloat16;
  const auto acc = low ? at::kFloat : t;
  auto sum = at::zeros_like(contributions[0], at::TensorOptions(acc));
  for (const auto& c : contributions) sum.add_(c.to(acc));
  if (op == ReduceOp::kAvg) sum.div_(static_cast<double>(contributions.size()));
  return sum.to(t);
}

std::string describe(const char* op, at::ScalarType t, int64_t n, int ws) {
  return detail::cat(op, " dtype=", t, " n=", n, " world=", ws);
}

void check_all_gather(Communicator& c, at::ScalarType t, int64_t n) {
  const int ws = c.size();
  std::vector<at::Tensor> parts;
  for (int q = 0; q < ws; ++q) parts.push_back(random_bits(n, seed_of(1, t, q, n), t));
  auto out = at::full({ws * n}, 0, at::TensorOptions(t));
  auto work = c.all_gather(out, parts[c.rank()]);
  work.wait();
  EXPECT_TRUE(work.is_completed());
  EXPECT_TRUE(bit_equal(out, at::cat(parts))) << describe("all_gather", t, n, ws);
}

void check_broadcast(Communicator& c, at::ScalarType t, int64_t n, int root) {
  auto expected = random_bits(n, seed_of(2, t, root, n), t);
  auto buf = c.rank() == root ? expected.clone() : at::zeros({n}, at::TensorOptions(t));
  c.broadcast(buf, root).wait();
  EXPECT_TRUE(bit_equal(buf, expected))
      << describe("broadcast", t, n, c.size()) << " root=" << root;
}

// In place: the output is this rank's own block of the input.
void check_reduce_scatter(Communicator& c, at::ScalarType t, int64_t n, ReduceOp op,
                          bool in_place = false) {
  const int ws = c.size();
  std::vector<at::Tensor> blocks;  // block `rank` of every rank's input
  at::Tensor mine;
  for (int q = 0; q < ws; ++q) {
    auto in = exact_sum_values(ws * n, seed_of(3, t, q, n), t);
    if (q == c.rank()) mine = in;
    blocks.push_back(in.narrow(0, c.rank() * n, n).clone());
  }
  auto out = in_place ? mine.narrow(0, c.rank() * n, n) : at::empty({n}, at::TensorOptions(t));
  c.reduce_scatter(out, mine, op).wait();
  const std::string name =
      std::string(op == ReduceOp::kSum ? "reduce_scatter SUM" : "reduce_scatter AVG") +
      (in_place ? " in place" : "");
  EXPECT_TRUE(bit_equal(out, reduce_reference(blocks, op, t))) << describe(name.c_str(), t, n, ws);
  // The input is left untouched (but for the output, in place).
  auto fresh = exact_sum_values(ws * n, seed_of(3, t, c.rank(), n), t);
  if (in_place) fresh.narrow(0, c.rank() * n, n).copy_(out);
  EXPECT_TRUE(bit_equal(mine, fresh)) << describe(name.c_str(), t, n, ws);
}

void check_all_reduce(Communicator& c, at::ScalarType t, int64_t n, ReduceOp op) {
  const int ws = c.size();
  std::vector<at::Tensor> all;
  for (int q = 0; q < ws; ++q) all.push_back(exact_sum_values(n, seed_of(4, t, q, n), t));
  auto buf = all[c.rank()].clone();
  c.all_reduce(buf, op).wait();
  const char* name = op == ReduceOp::kSum ? "all_reduce SUM" : "all_reduce AVG";
  EXPECT_TRUE(bit_equal(buf, reduce_reference(all, op, t))) << describe(name, t, n, ws);
}

// One launch per world size; inside, every op x dtype x size.
class CollectivesTest : public ::testing::TestWithParam<int> {};

// On each transport (the world's default, shm here, then tcp and collective).
TEST_P(CollectivesTest, EveryOpAndDtypeMatchesReference) {
  run_ranks(GetParam(), [](Rank& r) {
    auto c = r.world();
    ASSERT_EQ(c->size(), r.size);
    ASSERT_EQ(c->rank(), r.rank);
    for (auto lane : {c, r.lane_over("tcp"), r.lane_over("collective")}) {
      for (at::ScalarType t : kDtypes) {
        for (int64_t n : {int64_t{5}, int64_t{1031}}) {
          SCOPED_TRACE(to_string(lane->transport()));
          check_all_gather(*lane, t, n);
          check_broadcast(*lane, t, n, 0);
          check_broadcast(*lane, t, n, lane->size() - 1);
          check_reduce_scatter(*lane, t, n, ReduceOp::kSum);
          check_reduce_scatter(*lane, t, n, ReduceOp::kAvg);
          check_reduce_scatter(*lane, t, n, ReduceOp::kAvg, /*in_place=*/true);
          check_all_reduce(*lane, t, n, ReduceOp::kSum);
          check_all_reduce(*lane, t, n, ReduceOp::kAvg);
        }
      }
    }
    // Barrier: the last rank arrives 300 ms late; nobody may leave before it arrived.
    if (c->rank() == c->size() - 1) std::this_thread::sleep_for(300ms);
    auto start = Clock::now();
    auto b = c->barrier();
    b.wait();
    EXPECT_TRUE(b.is_completed());
    if (c->size() > 1 && c->rank() != c->size() - 1) {
      EXPECT_GE(seconds_since(start), 0.2);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, CollectivesTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "ws" + std::to_string(info.param); });

// On shm and tcp, a reduce-scatter's blocks travel in chunks (one slot of 256 KiB over shared
// memory, at most 1 MiB over tcp) and each chunk is summed as it arrives: exact here. Blocks of
// 300001 elements span several chunks, the last one short; 1,200,001 elements span more chunks
// than tcp receives ahead (kWindowChunks). In place and out of place; two reduce-scatters in flight
// at once, waited in reverse order: the sums must be exact and land on the right rank.
class PipelinedReduceScatterTest : public ::testing::TestWithParam<int> {};

TEST_P(PipelinedReduceScatterTest, ChunkedSumsAreExactOnEveryTransport) {
  run_ranks(GetParam(), [](Rank& r) {
    for (auto c : {r.world(), r.lane_over("tcp")}) {
      SCOPED_TRACE(to_string(c->transport()));
      const int ws = c->size();
      const int64_t n = 300001;
      for (at::ScalarType t : {at::kFloat, at::kDouble}) {
        check_reduce_scatter(*c, t, n, ReduceOp::kSum);
        check_reduce_scatter(*c, t, n, ReduceOp::kAvg);
        for (int64_t m : {n, int64_t{1200001}}) {
          check_reduce_scatter(*c, t, m, ReduceOp::kSum, /*in_place=*/true);
          check_reduce_scatter(*c, t, m, ReduceOp::kAvg, /*in_place=*/true);
        }
        std::vector<at::Tensor> ins, outs, expected;
        for (int k = 0; k < 2; ++k) {
          std::vector<at::Tensor> blocks;
          for (int q = 0; q < ws; ++q) {
            auto in = exact_sum_values(ws * n, seed_of(10 + k, t, q, n), t);
            if (q == c->rank()) ins.push_back(in);
            blocks.push_back(in.narrow(0, c->rank() * n, n));
          }
          expected.push_back(reduce_reference(blocks, ReduceOp::kSum, t));
          outs.push_back(at::empty({n}, at::TensorOptions(t)));
        }
        auto first = c->reduce_scatter(outs[0], ins[0], ReduceOp::kSum);
        auto second = c->reduce_scatter(outs[1], ins[1], ReduceOp::kSum);
        second.wait();
        first.wait();
        for (int k = 0; k < 2; ++k)
          EXPECT_TRUE(bit_equal(outs[k], expected[k])) << describe("in flight", t, n, ws) << k;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, PipelinedReduceScatterTest, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "ws" + std::to_string(info.param); });

// detail::reduce_scatter_digested over a span of each block (verified collectives' rotating
// part): blocks of 300001 elements in several chunks, spans that start and end inside chunks, one
// element, none, and one past the block's end (clamped). Every digest a sender reports is the
// XXH3 of exactly the span's bytes of the block it sent, every receiver's equals its sender's,
// and the sums are the plain reduce-scatter's, on every transport, fp32 and bf16.
TEST(CommTest, WireDigestsOfASpanCoverTheSameBytesOnBothSidesAcrossChunks) {
  run_ranks(3, [](Rank& r) {
    for (auto c : {r.world(), r.lane_over("tcp"), r.lane_over("collective")}) {
      const int ws = c->size(), me = c->rank();
      const int64_t n = 300001;
      for (at::ScalarType t : {at::kFloat, at::kBFloat16})
        for (auto [lo, hi] : std::vector<std::pair<int64_t, int64_t>>{
                 {0, -1}, {100000, 262145}, {262143, 262145}, {7, 7}, {299999, 400000}}) {
          SCOPED_TRACE(std::string(to_string(c->transport())) + " " +
                       std::string(c10::toString(t)) + " span [" + std::to_string(lo) + ", " +
                       std::to_string(hi) + ")");
          auto in = exact_sum_values(ws * n, seed_of(20, t, me, n), t);
          auto out = at::empty({n}, at::TensorOptions(t));
          auto plain = at::empty({n}, at::TensorOptions(t));
          Work w = detail::reduce_scatter_digested(*c, out, in, ReduceOp::kSum, nullptr,
                                                   detail::WireSpan{lo, hi});
          w.wait();
          c->reduce_scatter(plain, in.clone(), ReduceOp::kSum).wait();
          EXPECT_TRUE(bit_equal(out, plain));
          const auto d = w.digests();
          ASSERT_TRUE(d);
          const int64_t from = std::min(lo, n), to = hi < 0 ? n : std::clamp(hi, from, n);
          auto sent = at::zeros({ws}, at::kLong), received = at::zeros({ws}, at::kLong);
          for (int j = 0; j < ws; ++j) {
            if (j == me) continue;
            const auto part = in.narrow(0, j * n + from, to - from);
            EXPECT_EQ(d->sent[j],
                      detail::checksum_bytes(part.data_ptr(), static_cast<size_t>(part.nbytes())))
                << "to rank " << j;
            sent[j] = static_cast<int64_t>(d->sent[j]);
            received[j] = static_cast<int64_t>(d->received[j]);
          }
          // Rank q's received[p] must equal rank p's sent[q].
          auto all_sent = at::empty({ws * ws}, at::kLong), all_received = at::empty_like(all_sent);
          c->all_gather(all_sent, sent).wait();
          c->all_gather(all_received, received).wait();
          for (int p = 0; p < ws; ++p)
            for (int q = 0; q < ws; ++q)
              if (p != q)
                EXPECT_EQ(all_received[q * ws + p].item<int64_t>(),
                          all_sent[p * ws + q].item<int64_t>())
                    << "rank " << p << " to rank " << q;
        }
    }
  });
}

// all_gather_into: random pieces whose sizes differ between pieces and ranks (some empty, as a
// trailing rank's rows of a small parameter), landing in random, disjoint places of one block,
// every dtype, many seeds; the block bitwise against the concatenation every rank can rebuild,
// and the gaps between places untouched, on shm and tcp. A collective lane refuses it: it cannot
// put pieces in place.
class GatherIntoPlacesTest : public ::testing::TestWithParam<int> {};

TEST_P(GatherIntoPlacesTest, PiecesLandInTheirPlacesBitwise) {
  run_ranks(GetParam(), [](Rank& r) {
    for (auto c : {r.world(), r.lane_over("tcp")}) {
      SCOPED_TRACE(to_string(c->transport()));
      const int ws = c->size();
      for (int seed = 0; seed < 12; ++seed) {
        const at::ScalarType t = kDtypes[seed % 4];
        std::mt19937 gen(7919 * seed + ws);  // same on every rank: sizes and places agree
        const int pieces = 1 + static_cast<int>(gen() % 9);
        std::vector<std::vector<int64_t>> len(ws, std::vector<int64_t>(pieces));
        for (auto& row : len)
          for (auto& l : row) l = gen() % 4 == 0 ? 0 : static_cast<int64_t>(gen() % 5000);
        // Places: (rank, piece) in a shuffled order, each after a random gap.
        std::vector<std::pair<int, int>> order;
        for (int q = 0; q < ws; ++q)
          for (int i = 0; i < pieces; ++i) order.emplace_back(q, i);
        std::shuffle(order.begin(), order.end(), gen);
        std::vector<std::vector<int64_t>> where(ws, std::vector<int64_t>(pieces));
        int64_t end = 0;
        for (auto [q, i] : order) {
          end += gen() % 17;
          where[q][i] = end;
          end += len[q][i];
        }
        const auto fill = static_cast<double>(seed) + 0.5;
        auto block = at::full({end + 3}, fill, at::TensorOptions(t));
        std::vector<std::vector<at::Tensor>> places(ws);
        std::vector<at::Tensor> mine;
        auto expected = block.clone();
        for (int q = 0; q < ws; ++q)
          for (int i = 0; i < pieces; ++i) {
            auto v = random_bits(len[q][i], seed_of(30 + seed, t, q, 100 * i + 1), t);
            places[q].push_back(block.narrow(0, where[q][i], len[q][i]));
            expected.narrow(0, where[q][i], len[q][i]).copy_(v);
            if (q == c->rank()) mine.push_back(v);
          }
        ASSERT_TRUE(detail::gathers_into_places(*c, mine));
        detail::all_gather_into(*c, std::move(places), std::move(mine)).wait();
        EXPECT_TRUE(bit_equal(block, expected)) << describe("all_gather_into", t, end, ws);
      }
      EXPECT_FALSE(detail::gathers_into_places(*c, {}));
      expect_error(
          [&] {
            detail::all_gather_into(*c, std::vector<std::vector<at::Tensor>>(ws, {at::ones({4})}),
                                    {at::ones({4}, at::kDouble)});
          },
          {"all_gather_into"});
    }
    auto one = std::vector<at::Tensor>{at::ones({4})};
    if (r.size == 1) return;  // one rank gathers in place on every transport
    auto collective = r.lane_over("collective");
    EXPECT_FALSE(detail::gathers_into_places(*collective, one));
    expect_error(
        [&] {
          detail::all_gather_into(*collective, std::vector<std::vector<at::Tensor>>(r.size), one);
        },
        {"cannot be gathered into their places here", "use all_gather"});
    // Nothing above communicated on this lane: no rank leaves while a peer still connects it.
    collective->barrier().wait();
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, GatherIntoPlacesTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "ws" + std::to_string(info.param); });

// On shm and tcp, reduce-scatter sums each chunk in rank order as it arrives: bitwise the
// collective transport's result (the blocks exchanged by the backend's all-to-all, then summed)
// for every dtype, both ops and sizes from one element to more chunks than are received ahead
// (the last one short). The reverse-order check shows the data would expose a different summation
// order.
class RankOrderReduceScatterTest : public ::testing::TestWithParam<int> {};

TEST_P(RankOrderReduceScatterTest, BitwiseEqualToAlltoallThenSum) {
  run_ranks(GetParam(), [](Rank& r) {
    auto c = r.world();
    auto tcp = r.lane_over("tcp"), collective = r.lane_over("collective");
    const int ws = c->size();
    bool order_visible = false;
    for (at::ScalarType t : kDtypes) {
      // 1200001: more chunks (5 fp32, 10 fp64) than the exchange receives ahead (kWindowChunks),
      // so chunk slots are received into again (fewer than that in the 2-byte dtypes: not run).
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1031}, int64_t{70001}, int64_t{600000},
                        int64_t{1200001}}) {
        if (n == 1200001 && t != at::kFloat && t != at::kDouble) continue;
        // The other ranks' inputs only where the summation order is looked at (below).
        const bool look = t == at::kFloat && n >= 1031 && n <= 70001;
        std::vector<at::Tensor> blocks;
        at::Tensor mine;
        for (int q = 0; q < ws; ++q) {
          if (q != c->rank() && !look) continue;
          auto in = order_sensitive_values(ws * n, seed_of(20, t, q, n), t);
          if (q == c->rank()) mine = in;
          blocks.push_back(in.narrow(0, c->rank() * n, n));
        }
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          auto plain = at::empty({n}, at::TensorOptions(t));
          collective->reduce_scatter(plain, mine, op).wait();
          for (auto lane : {c, tcp}) {
            auto piped = at::empty({n}, at::TensorOptions(t));
            lane->reduce_scatter(piped, mine, op).wait();
            EXPECT_TRUE(bit_equal(piped, plain)) << describe(to_string(lane->transport()), t, n, ws)
                                                 << " op " << static_cast<int>(op);
          }
          if (look) {  // and both are the left fold over ranks 0, 1, ..., N-1
            auto fold = blocks[0].clone();
            for (int q = 1; q < ws; ++q) fold.add_(blocks[q]);
            if (op == ReduceOp::kAvg) fold.div_(ws);
            EXPECT_TRUE(bit_equal(plain, fold)) << describe("rank-order fold", t, n, ws);
          }
        }
        if (look) {
          auto forward = at::stack(blocks).sum(0);
          std::vector<at::Tensor> reversed(blocks.rbegin(), blocks.rend());
          order_visible |= !bit_equal(at::stack(reversed).sum(0), forward);
        }
      }
    }
    // Two summands commute: the order shows from three ranks on.
    if (ws >= 3) {
      EXPECT_TRUE(order_visible) << "the data cannot tell summation orders apart";
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, RankOrderReduceScatterTest, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "ws" + std::to_string(info.param); });

TEST(CommTest, CollectivesRunWhileComputeRuns) {
  run_ranks(2, [](Rank& r) {
    auto c = r.world();
    const int64_t n = 4 << 20;  // 16 MiB per rank: far longer in flight than issuing takes
    auto in = at::full({n}, static_cast<double>(c->rank() + 1), at::kFloat);
    auto out = at::empty({2 * n}, at::kFloat);
    auto rs_in = at::arange(2 * n, at::kFloat);
    auto rs_out = at::empty({n}, at::kFloat);

    auto ag = c->all_gather(out, in);
    EXPECT_FALSE(ag.is_completed()) << "a 32 MiB all-gather completed while being issued";
    auto rs = c->reduce_scatter(rs_out, rs_in, ReduceOp::kSum);  // a second one in flight

    // Compute while both travel: (I * 2) @ x == 2 x.
    auto x = at::randn({256, 256});
    auto y = x;
    for (int i = 0; i < 8; ++i) y = at::matmul(at::eye(256).mul(2), y).div(2);
    EXPECT_TRUE(at::allclose(y, x));

    // is_completed turns true without wait() once the transfer is done.
    auto deadline = Clock::now() + 30s;
    while (!ag.is_completed() && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    EXPECT_TRUE(ag.is_completed());
    rs.wait();  // completes in any order relative to the all-gather
    ag.wait();
    ag.wait();  // a second wait is a no-op
    EXPECT_TRUE(at::equal(out.narrow(0, 0, n), at::full({n}, 1.0, at::kFloat)));
    EXPECT_TRUE(at::equal(out.narrow(0, n, n), at::full({n}, 2.0, at::kFloat)));
    EXPECT_TRUE(at::equal(rs_out, at::arange(c->rank() * n, (c->rank() + 1) * n, at::kFloat) * 2));
  });
}

// Validation runs on the calling rank before anything is issued: after each rejected call the two
// ranks are still in step, which the closing all-gather proves.
TEST(CommTest, BadInputThrowsBeforeIssuingNamingExpectedAndActual) {
  run_ranks(2, [](Rank& r) {
    auto c = r.world();
    auto expect_error = [](const std::function<void()>& f, std::vector<std::string> parts) {
      try {
        f();
        ADD_FAILURE() << "no error; expected one containing '" << parts[0] << "'";
      } catch (const Error& e) {
        for (const auto& p : parts)
          EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
              << "message lacks '" << p << "': " << e.what();
      }
    };
    if (c->rank() == 1) {  // only rank 1 makes mistakes; rank 0 issues nothing meanwhile
      auto f = at::zeros({10}, at::kFloat);
      expect_error([&] { c->all_gather(at::zeros({19}, at::kFloat), f); },
                   {"all_gather", "output has 19 elements", "2 x input 10 = 20"});
      expect_error([&] { c->reduce_scatter(f, at::zeros({21}, at::kFloat), ReduceOp::kSum); },
                   {"reduce_scatter", "input has 21 elements", "2 x output 10 = 20"});
      expect_error([&] { c->all_gather(at::zeros({20}, at::kDouble), f); },
                   {"all_gather", "output dtype Double", "input dtype Float"});
      expect_error(
          [&] {
            c->reduce_scatter(at::zeros({10}, at::kBFloat16), at::zeros({20}), ReduceOp::kAvg);
          },
          {"reduce_scatter", "output dtype BFloat16", "input dtype Float"});
      auto strided = at::zeros({4, 5}, at::kFloat).t();
      expect_error([&] { c->all_reduce(strided, ReduceOp::kSum); },
                   {"all_reduce", "must be contiguous", "sizes [5, 4]", "strides [1, 5]"});
      expect_error([&] { c->all_gather(at::zeros({40}), strided); },
                   {"all_gather", "input must be contiguous"});
      expect_error([&] { c->broadcast(f, 2); }, {"broadcast", "root rank 2", "0..1"});
      auto in = at::zeros({20}, at::kFloat);  // rank 1's own block is in[10:20]
      expect_error([&] { c->reduce_scatter(in.narrow(0, 0, 10), in, ReduceOp::kSum); },
                   {"reduce_scatter", "overlaps the input", "own block"});
      expect_error([&] { c->all_reduce(at::zeros({3}, at::kBool), ReduceOp::kSum); },
                   {"all_reduce", "dtype Bool"});
    }
    auto out = at::empty({4}, at::kFloat);
    c->all_gather(out, at::full({2}, static_cast<double>(c->rank()), at::kFloat)).wait();
    EXPECT_TRUE(at::equal(out, at::tensor({0.f, 0.f, 1.f, 1.f})));
  });
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Rank 1 joins but never issues the all-gather: rank 0's wait() must fail within the timeout with
// a message naming the op, the bytes, the ranks and the timeout.
TEST(CommTest, MissingPeerCollectiveTimesOutWithCommError) {
  RunOptions opt;
  opt.collective_timeout_s = 2;
  run_ranks(
      2,
      [](Rank& r) {
        auto c = r.world();
        ASSERT_EQ(c->timeout(), 2000ms);
        if (c->rank() == 1) {
          std::this_thread::sleep_for(3500ms);  // alive, connected, silent until rank 0 gave up
          return;
        }
        auto out = at::empty({2048}, at::kFloat);
        auto work = c->all_gather(out, at::ones({1024}, at::kFloat));
        auto start = Clock::now();
        try {
          work.wait();
          ADD_FAILURE() << "wait() returned although rank 1 never issued the all-gather";
        } catch (const CommError& e) {
          const std::string m = e.what();
          EXPECT_TRUE(contains(m, "all_gather of 8192 bytes")) << m;
          EXPECT_TRUE(contains(m, "rank 0 of ranks 0..1")) << m;
          EXPECT_TRUE(contains(m, "within 2 s")) << m;
          EXPECT_TRUE(contains(m, "FSDP_TIMEOUT_S")) << m;
        }
        EXPECT_LT(seconds_since(start), 5.0);
        // A lost collective neither hangs a second wait nor passes as a success (issue 9 item 8):
        // every later wait rethrows the same error.
        for (int again = 0; again < 2; ++again) {
          auto t = Clock::now();
          try {
            work.wait();
            ADD_FAILURE() << "a second wait() after a timeout returned as if it succeeded";
          } catch (const CommError& e) {
            EXPECT_TRUE(contains(e.what(), "all_gather of 8192 bytes")) << e.what();
            EXPECT_TRUE(contains(e.what(), "within 2 s")) << e.what();
          }
          EXPECT_LT(seconds_since(t), 0.5);
        }
      },
      opt);
}

// The explicit-timeout overload reports its own limit.
// The tcp transport's point-to-point waits time out like the collectives, with the same message.
TEST(CommTest, MissingPeerPointToPointReduceScatterTimesOutWithCommError) {
  RunOptions opt;
  opt.collective_timeout_s = 2;
  run_ranks(
      2,
      [](Rank& r) {
        auto c = r.lane_over("tcp");
        if (c->rank() == 1) {
          std::this_thread::sleep_for(3500ms);  // alive, connected, silent until rank 0 gave up
          return;
        }
        auto out = at::empty({1024}, at::kFloat);
        auto work = c->reduce_scatter(out, at::ones({2048}, at::kFloat), ReduceOp::kSum);
        auto start = Clock::now();
        try {
          work.wait();
          ADD_FAILURE() << "wait() returned although rank 1 never issued the reduce-scatter";
        } catch (const CommError& e) {
          const std::string m = e.what();
          EXPECT_TRUE(contains(m, "reduce_scatter of 8192 bytes")) << m;
          EXPECT_TRUE(contains(m, "within 2 s")) << m;
        }
        EXPECT_LT(seconds_since(start), 5.0);
      },
      opt);
}

TEST(CommTest, WaitWithExplicitTimeoutNamesIt) {
  RunOptions opt;
  opt.collective_timeout_s = 2;
  run_ranks(
      2,
      [](Rank& r) {
        auto c = r.world();
        if (c->rank() == 1) {
          std::this_thread::sleep_for(1500ms);
          return;
        }
        auto buf = at::ones({100}, at::kDouble);
        auto work = c->all_reduce(buf, ReduceOp::kSum);
        auto start = Clock::now();
        try {
          work.wait(500ms);
          ADD_FAILURE() << "wait(500ms) returned although rank 1 never issued the all-reduce";
        } catch (const CommError& e) {
          const std::string m = e.what();
          EXPECT_TRUE(contains(m, "all_reduce of 800 bytes")) << m;
          EXPECT_TRUE(contains(m, "within 0.5 s")) << m;
        }
        EXPECT_LT(seconds_since(start), 2.5);
      },
      opt);
}

// A rank that never joins the rendezvous: the rank that did gets the rendezvous timeout error.
void expect_rendezvous_timeout(int joining_rank) {
  RunOptions opt;
  opt.collective_timeout_s = 2;
  run_ranks(
      2,
      [joining_rank](Rank& r) {
        if (r.rank != joining_rank) return;  // never calls init_process_group
        auto start = Clock::now();
        try {
          r.world();
          ADD_FAILURE() << "rendezvous succeeded without the other rank";
        } catch (const CommError& e) {
          const std::string m = e.what();
          EXPECT_TRUE(contains(m, "rendezvous failed for rank " + std::to_string(joining_rank) +
                                      " of 2 at 127.0.0.1:"))
              << m;
          EXPECT_TRUE(contains(m, "within 2 s")) << m;
          EXPECT_TRUE(contains(m, "MASTER_ADDR/MASTER_PORT")) << m;
          if (joining_rank == 0) {
            EXPECT_TRUE(contains(m, "only 1 of 2 ranks joined")) << m;
          }
        }
        EXPECT_LT(seconds_since(start), 4.0);
      },
      opt);
}

TEST(CommTest, RendezvousTimesOutWhenAWorkerNeverJoins) { expect_rendezvous_timeout(0); }
TEST(CommTest, RendezvousTimesOutWhenRankZeroNeverJoins) { expect_rendezvous_timeout(1); }

TEST(CommTest, SplitOrdersIndependentlyAndMatchesWorld) {
  run_ranks(3, [](Rank& r) {
    auto c = r.world();
    auto lane = c->split("prefetch");
    EXPECT_EQ(lane->size(), 3);
    EXPECT_EQ(lane->rank(), c->rank());
    // Issue on the lane then on world: both complete, whatever the wait order.
    auto a = at::full({6}, static_cast<double>(c->rank()), at::kFloat);
    auto out = at::empty({18}, at::kFloat);
    auto w1 = lane->all_gather(out, a);
    auto s = at::ones({4}, at::kDouble);
    auto w2 = c->all_reduce(s, ReduceOp::kSum);
    w2.wait();
    w1.wait();
    EXPECT_TRUE(at::equal(s, at::full({4}, 3.0, at::kDouble)));
    EXPECT_TRUE(at::equal(out, at::arange(3, at::kFloat).repeat_interleave(6)));
  });
}

// A subgroup that only some ranks create (they alone are in it) leaves the others' later splits
// and lanes as they are: each rank's split() still meets every other rank's (it once hung in the
// connect, the subgroup having moved the members' naming of later splits on).
TEST(CommTest, ASubgroupOfSomeRanksLeavesLaterSplitsInStep) {
  RunOptions o;
  o.collective_timeout_s = 20;
  run_ranks(
      3,
      [](Rank& r) {
        auto c = r.world();
        if (r.rank < 2) {
          auto pair = c->subgroup("pair", {0, 1});
          auto t = at::ones({2}, at::kFloat);
          pair->all_reduce(t, ReduceOp::kSum).wait();
          EXPECT_TRUE(at::equal(t, at::full({2}, 2.0, at::kFloat)));
        }
        for (auto lane : {c->split("after"), c->lane("after.lane")}) {
          auto t = at::ones({2}, at::kFloat);
          lane->all_reduce(t, ReduceOp::kSum).wait();
          EXPECT_TRUE(at::equal(t, at::full({2}, 3.0, at::kFloat)));
        }
      },
      o);
}

// Work::then: the step runs once, after the collective, on the thread that waits, and sees its
// result; waiting again does nothing; a step that throws fails the Work, and later waits rethrow.
TEST(CommTest, WorkThenRunsItsStepOnceAfterTheCollective) {
  run_ranks(2, [](Rank& r) {
    auto c = r.world();
    auto t = at::full({4}, 1.0 + c->rank(), at::kFloat);
    int steps = 0;
    float seen = 0;
    auto w = c->all_reduce(t, ReduceOp::kSum).then([&] {
      ++steps;
      seen = t[0].item<float>();
    });
    w.wait();
    w.wait();
    EXPECT_EQ(steps, 1);
    EXPECT_EQ(seen, 3.0f);
    EXPECT_TRUE(w.is_completed());
    auto bad = c->barrier().then([] { throw Error("the step failed"); });
    expect_error([&] { bad.wait(); }, {"the step failed"});
    expect_error([&] { bad.wait(); }, {"the step failed"});
    int local = 0;
    Work().then([&] { ++local; }).wait();  // on an empty Work: the step alone
    EXPECT_EQ(local, 1);
  });
}

}  // namespace
}  // namespace fsdp::testing::comm_test
