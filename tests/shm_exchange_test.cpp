// The shared-memory transport (src/comm/shm_exchange.h) on real ranks: generated exchanges
// (every dtype, sizes around and across the slot size, ring wrap-around, several jobs in flight on
// both lanes at once, in place and not) bitwise against the collective transport of a lane that
// does not use it; ranks that disagree on a collective's sizes fail naming both streams; the choice
// of transport by FSDP_TRANSPORT; nothing left in /dev/shm; jobs that nobody waits for, or that
// the ranks wait for in different orders on the two lanes, still complete; a wait's own limit.
#include "comm/shm_exchange.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <fsdp/communicator.h>
#include <fsdp/error.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator_impl.h"
#include "comm/exchange_worker.h"
#include "comm_data.h"
#include "harness.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::shm_exchange_test {
namespace {

using detail::ShmExchange;

const at::ScalarType kTypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                 at::kInt,   at::kLong,   at::kChar, at::kByte};

// Element counts that matter to a slot of kSlotBytes: empty, tiny, one short of / exactly / one
// past a slot, and several slots (more than a channel holds, so slots are written again).
int64_t draw_numel(std::mt19937_64& gen, int64_t element_size) {
  const int64_t slot = ShmExchange::kSlotBytes / element_size;
  switch (gen() % 6) {
    case 0:
      return static_cast<int64_t>(gen() % 3);
    case 1:
      return 1 + static_cast<int64_t>(gen() % 5000);
    case 2:
      return slot - 1 + static_cast<int64_t>(gen() % 3);
    case 3:
      return slot * (1 + static_cast<int64_t>(gen() % 3)) + static_cast<int64_t>(gen() % 7) - 3;
    default:
      return static_cast<int64_t>(gen() % (slot * (ShmExchange::kSlots + 3)));
  }
}

// `n` values of `t` from `seed`: any bit pattern for a transfer; for a sum of floating values,
// values whose sum is exact (comm_data.h); integers over their whole range (sums wrap alike).
at::Tensor draw_values(int64_t n, uint64_t seed, at::ScalarType t, bool summed) {
  if (at::isFloatingType(t)) return summed ? exact_sum_values(n, seed, t) : random_bits(n, seed, t);
  auto gen = at::detail::createCPUGenerator(seed);
  const int64_t lo = t == at::kByte   ? 0
                     : t == at::kChar ? -128
                     : t == at::kInt  ? INT32_MIN
                                      : -(int64_t{1} << 62);
  const int64_t hi = t == at::kByte   ? 256
                     : t == at::kChar ? 128
                     : t == at::kInt  ? int64_t{INT32_MAX} + 1
                                      : int64_t{1} << 62;
  return at::randint(lo, hi, {n}, gen, at::TensorOptions(t));
}

// Whether /dev/shm has room for these tests' segments (a few MiB per rank and communicator; a
// container's default 64 MiB /dev/shm may not): without it the transport falls back to TCP, as it
// should, and these tests, which assert that it is used, say so and skip.
bool shm_has_room() {
  struct statvfs fs {};
  return ::statvfs("/dev/shm", &fs) == 0 &&
         static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize >= (uint64_t{256} << 20);
}
#define SKIP_WITHOUT_SHM_ROOM() \
  if (!shm_has_room()) GTEST_SKIP() << "/dev/shm has less than 256 MiB free"

std::vector<std::string> our_segments() {
  std::vector<std::string> names;
  const std::string prefix = detail::cat("fsdp-", ::getpid(), "-");
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::string(e->d_name).rfind(prefix, 0) == 0) names.push_back(e->d_name);
    ::closedir(d);
  }
  return names;
}

// One generated case: a reduce-scatter on both lanes and a gather into places, compared bit for
// bit with the TCP lane's alltoall + sum and with the pieces themselves.
struct Case {
  at::ScalarType t;
  int64_t n;
  bool in_place, average;
  std::vector<std::vector<int64_t>> lens;  // [rank][piece] of the gather
};

Case draw_case(std::mt19937_64& gen, int ws) {
  Case c;
  c.t = kTypes[gen() % 8];
  const int64_t es = at::elementSize(c.t);
  c.n = draw_numel(gen, es);
  c.in_place = gen() % 2 == 0;
  c.average = at::isFloatingType(c.t) && gen() % 2 == 0;
  const int pieces = 1 + static_cast<int>(gen() % 12);
  c.lens.assign(ws, std::vector<int64_t>(pieces));
  for (auto& row : c.lens)
    for (auto& l : row) l = gen() % 3 == 0 ? 0 : draw_numel(gen, es) / 2;
  return c;
}

class ShmExchangeTest : public ::testing::TestWithParam<int> {};

TEST_P(ShmExchangeTest, GeneratedExchangesMatchTheCollectivePathBitwise) {
  SKIP_WITHOUT_SHM_ROOM();
  run_ranks(GetParam(), [](Rank& r) {
    auto world = r.world();
    const int ws = world->size(), me = world->rank();
    ASSERT_EQ(world->transport(), Transport::kShm)
        << "ranks on one host use shared memory by default";
    auto lane = world->split("second");  // another shared-memory lane, ordered on its own
    ASSERT_EQ(lane->transport(), Transport::kShm);
    auto collective = r.lane_over("collective");
    ASSERT_EQ(collective->transport(), Transport::kCollective);
    EXPECT_TRUE(our_segments().empty()) << "segments are unlinked once every rank mapped them";

    std::mt19937_64 gen(4242 + ws);  // the same draws on every rank
    for (int round = 0; round < 10; ++round) {
      // Three cases in flight at once on two shared-memory lanes: jobs queue behind each other
      // in each lane's channels, and the lanes run side by side.
      std::vector<Case> cases;
      for (int i = 0; i < 3; ++i) cases.push_back(draw_case(gen, ws));
      std::vector<at::Tensor> inputs, outputs, references, blocks;
      std::vector<std::vector<std::vector<at::Tensor>>> places;
      std::vector<Work> works;
      for (size_t i = 0; i < cases.size(); ++i) {
        const Case& c = cases[i];
        const uint64_t seed = 1000 * round + 10 * i;
        const auto op = c.average ? ReduceOp::kAvg : ReduceOp::kSum;
        at::Tensor in = draw_values(ws * c.n, seed + me, c.t, true);
        at::Tensor reference = at::empty({c.n}, at::TensorOptions(c.t));
        collective->reduce_scatter(reference, in.clone(), op).wait();
        at::Tensor out = c.in_place ? in.narrow(0, me * c.n, c.n) : at::empty_like(reference);
        works.push_back((i % 2 ? lane : world)->reduce_scatter(out, in, op));
        inputs.push_back(in);
        outputs.push_back(out);
        references.push_back(reference);
        // The gather: every rank's pieces land in one block, in rank-major order.
        int64_t total = 0;
        for (const auto& row : c.lens)
          for (int64_t l : row) total += l;
        at::Tensor block = at::zeros({total}, at::TensorOptions(c.t));
        std::vector<std::vector<at::Tensor>> into(ws);
        std::vector<at::Tensor> mine;
        int64_t at_ = 0;
        for (int q = 0; q < ws; ++q)
          for (size_t p = 0; p < c.lens[q].size(); ++p) {
            into[q].push_back(block.narrow(0, at_, c.lens[q][p]));
            if (q == me)
              mine.push_back(draw_values(c.lens[q][p], seed + 100 * q + p + 7, c.t, false));
            at_ += c.lens[q][p];
          }
        works.push_back(detail::all_gather_into(i % 2 ? *world : *lane, into, mine));
        blocks.push_back(block);
      }
      for (auto& w : works) w.wait();
      for (size_t i = 0; i < cases.size(); ++i) {
        const Case& c = cases[i];
        const std::string what = detail::cat("round ", round, " case ", i, ": ", c.t, " n=", c.n,
                                             c.in_place ? " in place" : "",
                                             c.average ? " average" : " sum", " world=", ws);
        EXPECT_TRUE(bit_equal(outputs[i], references[i])) << "reduce_scatter " << what;
        // Rebuild every rank's pieces (their seeds are known) and compare the whole block.
        std::vector<at::Tensor> expected;
        for (int q = 0; q < ws; ++q)
          for (size_t p = 0; p < c.lens[q].size(); ++p)
            expected.push_back(
                draw_values(c.lens[q][p], 1000 * round + 10 * i + 100 * q + p + 7, c.t, false));
        EXPECT_TRUE(bit_equal(blocks[i], at::cat(expected))) << "all_gather_into " << what;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, ShmExchangeTest, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "ws" + std::to_string(info.param); });

// A rank that gathers a different size than its peer expects: both fail at once with the streams
// named, instead of exchanging the wrong bytes or waiting out the limit.
TEST(ShmExchange, RanksThatDisagreeOnSizesFailNamingBothStreams) {
  SKIP_WITHOUT_SHM_ROOM();
  RunOptions opt;
  opt.collective_timeout_s = 30;
  run_ranks(
      2,
      [](Rank& r) {
        auto c = r.world();
        ASSERT_EQ(c->transport(), Transport::kShm);
        const int64_t n = c->rank() == 0 ? 100 : 120;  // rank 1 sends and expects 120
        std::vector<std::vector<at::Tensor>> into{{at::empty({n})}, {at::empty({n})}};
        const auto start = std::chrono::steady_clock::now();
        expect_error([&] { detail::all_gather_into(*c, into, {at::ones({n})}).wait(); },
                     {"all_gather of", "issued different collectives or sizes",
                      c->rank() == 0 ? "400-byte stream" : "480-byte stream"});
        EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                  10.0);
      },
      opt);
}

// Runs `body` on two ranks whose world communicator uses shared memory, every collective limited
// to `timeout_s`.
void on_two_shm_ranks(int timeout_s, const std::function<void(Communicator&)>& body) {
  RunOptions opt;
  opt.collective_timeout_s = timeout_s;
  run_ranks(
      2,
      [&](Rank& r) {
        auto c = r.world();
        ASSERT_EQ(c->transport(), Transport::kShm);
        body(*c);
      },
      opt);
}

// Collectives larger than a channel holds (8 MiB per rank against 1 MiB of slots per peer), so
// that no rank finishes one without its peer running it too.
constexpr int64_t kBeyondChannel = int64_t{2} << 20;  // floats

// All-gather and reduce-scatter values from rank r: exact sums either way.
at::Tensor ramp(int64_t n, int r) { return at::arange(n, at::kFloat).fmod(1000) + 1000 * r; }

// Rank 0 waits for its all-gather first, rank 1 for its reduce-scatter: each waits on the lane
// the other's thread is not running. The exchange's worker runs a job that nobody has run for
// ExchangeWorker::kBackstop, so both complete (with the waits alone, each rank would wait for the
// other until the collective timeout).
TEST(ShmExchange, RanksThatWaitForTheTwoLanesInDifferentOrdersBothComplete) {
  SKIP_WITHOUT_SHM_ROOM();
  on_two_shm_ranks(30, [](Communicator& c) {
    const int64_t n = kBeyondChannel;
    const at::Tensor rs_in = at::cat({ramp(n, c.rank()), ramp(n, c.rank())});
    const at::Tensor rs_out = at::empty({n}), ag_out = at::empty({2 * n});
    const auto start = std::chrono::steady_clock::now();
    Work rs = c.reduce_scatter(rs_out, rs_in, ReduceOp::kSum);
    Work ag = c.all_gather(ag_out, ramp(n, c.rank()));
    if (c.rank() == 0) {
      ag.wait();
      rs.wait();
    } else {
      rs.wait();
      ag.wait();
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
              10.0);
    EXPECT_TRUE(at::equal(rs_out, ramp(n, 0) + ramp(n, 1)));
    EXPECT_TRUE(at::equal(ag_out, at::cat({ramp(n, 0), ramp(n, 1)})));
  });
}

// Rank 1 issues an all-gather and waits for it only after rank 0 has finished its own (a Gloo
// all-reduce in between tells it so): the worker's thread moves rank 1's part meanwhile.
TEST(ShmExchange, ACollectiveNobodyWaitsForYetStillProgresses) {
  SKIP_WITHOUT_SHM_ROOM();
  on_two_shm_ranks(30, [](Communicator& c) {
    const int64_t n = kBeyondChannel;
    const at::Tensor out = at::empty({2 * n});
    Work ag = c.all_gather(out, ramp(n, c.rank()));
    at::Tensor flag = at::ones({1}, at::kDouble);
    if (c.rank() == 0) ag.wait();
    c.all_reduce(flag, ReduceOp::kSum).wait();  // rank 1: only once rank 0 has its result
    ag.wait();
    EXPECT_EQ(flag.item<double>(), 2.0);
    EXPECT_TRUE(at::equal(out, at::cat({ramp(n, 0), ramp(n, 1)})));
  });
}

// A wait with a limit shorter than the collective's own gives up at that limit, naming it, while
// the peer has not issued the collective: the thread that waits does not run the job past it.
TEST(ShmExchange, AWaitGivesUpAtItsOwnLimit) {
  SKIP_WITHOUT_SHM_ROOM();
  on_two_shm_ranks(20, [](Communicator& c) {
    if (c.rank() == 1) {  // never issues it
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      return;
    }
    const at::Tensor out = at::empty({2 * kBeyondChannel});
    Work ag = c.all_gather(out, ramp(kBeyondChannel, 0));
    const auto start = std::chrono::steady_clock::now();
    expect_error([&] { ag.wait(std::chrono::milliseconds(500)); },
                 {"all_gather of", "within 0.5 s"});
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  });
}

// An exchange whose jobs move nothing: what runs the jobs is under test, not what they move.
class IdleExchange : public detail::Exchange {
 public:
  void all_gather(const std::vector<std::vector<at::Tensor>>&, const std::vector<at::Tensor>&,
                  std::chrono::milliseconds) override {}
  void exchange_blocks(const at::Tensor&, int64_t, const ChunkConsumer&,
                       std::chrono::milliseconds) override {}
  bool waiter_may_run() const override { return true; }
};

// Over shared memory a collective runs on the threads that issue or wait for it, and its end
// wakes no other thread: the worker's thread only looks every kBackstop for jobs nobody runs (a
// wake-up per collective cost a futex wake and two context switches on cores that train).
TEST(ExchangeWorker, CollectivesRunByTheirIssuersDoNotWakeTheWorker) {
  detail::ExchangeWorker worker(std::make_unique<IdleExchange>());
  constexpr int kJobs = 300;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kJobs; ++i) {
    auto work = worker.run(c10d::OpType::ALLGATHER, [](detail::Exchange&) {});
    ASSERT_TRUE(work->isCompleted());  // run at issue: nothing was queued before it
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // a woken worker would run
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  const int64_t own_looks = elapsed / detail::ExchangeWorker::kBackstop + 1;
  EXPECT_LE(worker.worker_wakeups(), own_looks + 5)
      << kJobs << " jobs in " << std::chrono::duration<double>(elapsed).count() << " s";
}

TEST(ShmExchange, TheEnvironmentChoosesTheTransport) {
  SKIP_WITHOUT_SHM_ROOM();
  run_ranks(2, [](Rank& r) {
    auto c = r.world();
    EXPECT_EQ(c->transport(), Transport::kShm);
    // Every communicator is kept to the end: what this tests is the transport each one chose.
    // (Creation ends with a barrier, so that dropping one at once cannot fail a peer that is still
    // connecting: communicator.cpp, Impl::child.)
    std::vector<std::shared_ptr<Communicator>> kept;
    auto keep = [&](std::shared_ptr<Communicator> x) { return kept.emplace_back(std::move(x)); };
    EXPECT_EQ(keep(r.lane_over("shm"))->transport(), Transport::kShm);
    auto tcp = keep(r.lane_over("tcp"));
    EXPECT_EQ(tcp->transport(), Transport::kTcp);
    EXPECT_EQ(keep(r.lane_over("collective"))->transport(), Transport::kCollective);
    // A lane keeps its communicator's transport; split() and subgroup() read the environment.
    EXPECT_EQ(tcp->lane("fsdp.all_gather")->transport(), Transport::kTcp);
    EXPECT_EQ(keep(tcp->split("again"))->transport(), Transport::kShm);
    {
      ScopedTransport scoped("collective");
      EXPECT_EQ(keep(tcp->subgroup("both", {0, 1}))->transport(), Transport::kCollective);
      EXPECT_EQ(c->lane("kept")->transport(), Transport::kShm);
    }
    auto out = at::empty({2 * 70000});
    tcp->all_gather(out, at::full({70000}, 1.0 + c->rank())).wait();
    EXPECT_EQ(out[0].item<float>(), 1.0f);
    EXPECT_EQ(out[70000].item<float>(), 2.0f);
    ::setenv("FSDP_TRANSPORT", "fast", 1);
    expect_error([&] { c->split("bad"); },
                 {"FSDP_TRANSPORT='fast' is not one of auto, shm, tcp, collective"});
    ::unsetenv("FSDP_TRANSPORT");
    EXPECT_TRUE(our_segments().empty());
  });
}

}  // namespace
}  // namespace fsdp::testing::shm_exchange_test
