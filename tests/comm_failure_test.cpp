// How ranks fail, by message: a dead peer is named and reported as such (not as a timeout), a
// failed Work rethrows on every wait, SIGPIPE cannot kill a rank, Ctrl-C ends a rendezvous, and
// the advertised address is chosen from the route or the named interface. Failure texts are
// checked on generated Gloo-style causes, and on real ranks.
#include <ATen/ATen.h>
#include <fsdp/communicator.h>
#include <fsdp/error.h>
#include <fsdp/init.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/address.h"
#include "comm/failure.h"
#include "comm/mesh_connect.h"
#include "comm/rendezvous_keys.h"
#include "harness.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::comm_failure_test {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::vector<PeerInfo> three_peers(const std::string& host_of_2) {
  return {{0, detail::this_host(), "10.1.0.1", 100},
          {1, detail::this_host(), "10.1.0.1", 101},
          {2, host_of_2, "10.1.0.2", 102}};
}

// ---- failure texts on generated causes ----
TEST(CommFailureText, ClassifiesGlooCauses) {
  using K = detail::FailureKind;
  const std::map<std::string, K> cases = {
      {"[gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.1.0.2]:4242",
       K::kPeerClosed},
      {"[gloo/transport/tcp/pair.cc:575] Read error [10.1.0.2]:4242: Connection reset by peer",
       K::kReset},
      {"[gloo/transport/tcp/pair.cc:589] Write error [10.1.0.2]:4242: Broken pipe", K::kReset},
      {"[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 2000ms for recv operation",
       K::kTimeout},
      {"Operation timed out!", K::kTimeout},
      {"Gloo: something else went wrong", K::kOther},
  };
  for (const auto& [cause, kind] : cases)
    EXPECT_EQ(static_cast<int>(detail::classify_failure(cause)), static_cast<int>(kind)) << cause;
}

TEST(CommFailureText, DeadLocalPeerIsNamedWithPidAndHost) {
  auto peers = three_peers("elsewhere");
  auto alive = [](int64_t pid) { return pid != 101; };  // rank 1's process is gone
  const std::string what = "all_gather of 64 bytes on communicator 'world' (rank 0 of ranks 0..2)";
  auto m = detail::describe_failure(what, "Connection closed by peer [10.1.0.1]:5000", 0.21, 20s,
                                    peers, 0, alive);
  EXPECT_TRUE(contains(m, what + " failed after 0.21 s: the peer closed the connection")) << m;
  EXPECT_TRUE(contains(m, "rank 1 (pid 101 on " + detail::this_host() + ") has exited")) << m;
  EXPECT_TRUE(contains(m, "Check rank 1's output")) << m;
  EXPECT_TRUE(contains(m, "OOM killer")) << m;
  EXPECT_FALSE(contains(m, "did not complete within")) << m;  // not a timeout
  m = detail::describe_failure(what, "Read error [10.1.0.1]:5000: Connection reset by peer", 0.5,
                               20s, peers, 0, alive);
  EXPECT_TRUE(contains(m, "the connection was reset; rank 1")) << m;
}

// A rank that has exited but is not yet reaped by its launcher (a zombie) counts as exited, for the
// shared-memory exchange that notices it and for the message that names it alike: the clean-clone
// run of 2026-12-02 caught the exchange failing on a zombie peer that the message then could not
// name ("has exited" missing from DeadPeerIsNamedAtOnceAndSigpipeCannotKill).
TEST(CommFailureText, AZombiePeerIsNamedAsExited) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(3);
  // Not reaped: the child stays a zombie until waitpid below.
  bool zombie = false;
  for (int i = 0; i < 500 && !zombie; ++i) {
    zombie = !detail::process_alive(child);
    if (!zombie) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_TRUE(zombie) << "an exited, unreaped child still counts as running";
  auto peers = three_peers("elsewhere");
  peers[1].pid = child;
  auto m = detail::describe_failure("all_gather of 64 bytes", "connection closed by peer", 0.1, 20s,
                                    peers, 0, nullptr);
  EXPECT_TRUE(
      contains(m, detail::cat("rank 1 (pid ", child, " on ", detail::this_host(), ") has exited")))
      << m;
  EXPECT_TRUE(detail::process_alive(::getpid()));
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_FALSE(detail::process_alive(child));  // reaped: gone altogether
}

TEST(CommFailureText, RemotePeerIsNamedByItsAddress) {
  auto peers = three_peers("otherhost");
  auto all_alive = [](int64_t) { return true; };
  auto m =
      detail::describe_failure("broadcast of 8 bytes", "Connection closed by peer [10.1.0.2]:7",
                               1.5, 20s, peers, 0, all_alive);
  EXPECT_TRUE(contains(m, "rank 2 (pid 102 on otherhost) has exited")) << m;
  // Two ranks behind one address, both alive: both are named, neither is blamed alone.
  m = detail::describe_failure("broadcast of 8 bytes", "Connection closed by peer [10.1.0.1]:7",
                               1.5, 20s, peers, 2, all_alive);
  EXPECT_TRUE(contains(m, "one of ranks 0, 1 has exited")) << m;
  // Nothing known: no rank is made up.
  m = detail::describe_failure("barrier", "Connection closed by peer [10.9.9.9]:7", 1.5, 20s, peers,
                               0, all_alive);
  EXPECT_TRUE(contains(m, "a peer rank's process exited or was killed")) << m;
  EXPECT_FALSE(contains(m, "rank 1")) << m;
}

// In a subgroup the peers carry world ranks and `self` is this rank's index among them: an HSDP
// shard group of world ranks {2, 3} seen from its rank 0 (world rank 2) blames world rank 3, never
// itself (the index was compared with world ranks, so rank 2 could name itself and spare 3).
TEST(CommFailureText, ASubgroupNamesItsPeerByWorldRank) {
  auto world = three_peers("elsewhere");
  world.push_back({3, detail::this_host(), "10.1.0.3", 103});
  world[2].host = detail::this_host();
  const std::vector<PeerInfo> group{world[2], world[3]};  // index 0 = world rank 2
  auto dead3 = [](int64_t pid) { return pid != 103; };
  auto m = detail::describe_failure("all_gather of 64 bytes", "Connection closed by peer", 0.1, 20s,
                                    group, 0, dead3);
  EXPECT_TRUE(contains(m, "rank 3 (pid 103 on " + detail::this_host() + ") has exited")) << m;
  auto dead2 = [](int64_t pid) { return pid != 102; };  // this rank's own pid: never blamed
  m = detail::describe_failure("all_gather of 64 bytes", "Connection closed by peer", 0.1, 20s,
                               group, 0, dead2);
  EXPECT_FALSE(contains(m, "rank 2 (pid 102")) << m;
  m = detail::describe_failure("all_gather of 64 bytes", "Connection closed by peer [10.1.0.3]:7",
                               0.1, 20s, group, 0, [](int64_t) { return true; });
  EXPECT_TRUE(contains(m, "rank 3 (pid 103")) << m;
}

TEST(CommFailureText, RealTimeoutSaysSoAndWhatToCheck) {
  auto m = detail::describe_failure("all_reduce of 800 bytes", "Operation timed out!", 2.0, 2000ms,
                                    three_peers("h"), 0, [](int64_t) { return true; });
  EXPECT_TRUE(contains(m, "all_reduce of 800 bytes did not complete within 2 s")) << m;
  EXPECT_TRUE(contains(m, "no peer connection failed")) << m;
  EXPECT_TRUE(contains(m, "same collectives in the same order")) << m;
  EXPECT_TRUE(contains(m, "FSDP_TIMEOUT_S")) << m;
}

// A timeout's census names the ranks that did not arrive, as a dead rank is named; a peer of this
// host in an abnormal state is named by that state even when the store did not answer.
TEST(CommFailureText, TimeoutNamesTheRanksThatDidNotArrive) {
  auto none = [](int64_t) { return std::string(); };
  auto alive = [](int64_t) { return true; };
  detail::Census c{true, {2}, {}};
  auto m = detail::describe_failure("all_reduce of 16 bytes", "Operation timed out!", 20.1, 20s,
                                    three_peers("h"), 0, alive, &c, none);
  EXPECT_TRUE(contains(m,
                       "did not complete within 20 s: no peer connection failed, and rank 2 "
                       "(pid 102 on h) did not arrive (every other rank reported waiting"))
      << m;
  EXPECT_FALSE(contains(m, "a peer rank is hung")) << m;
  c = {true, {}, {}};
  m = detail::describe_failure("x", "timed out", 20.1, 20s, three_peers("h"), 0, alive, &c, none);
  EXPECT_TRUE(contains(m,
                       "every rank reached a collective of this communicator, so they issued "
                       "different collectives"))
      << m;
  c = {false, {}, {}};
  m = detail::describe_failure(
      "x", "timed out", 20.1, 20s, three_peers("h"), 2, alive, &c, [](int64_t pid) {
        return pid == 100 ? std::string("its process is stopped (T)") : std::string();
      });
  EXPECT_TRUE(contains(m, "rank 0 (pid 100 on " + detail::this_host() +
                              ") did not arrive: its process is stopped (T)"))
      << m;
  m = detail::describe_failure("x", "timed out", 20.1, 20s, three_peers("h"), 2, alive, &c, none);
  EXPECT_TRUE(contains(m, "the store did not answer either, so rank 0 (pid 100 on ")) << m;
  EXPECT_EQ(detail::process_state(::getpid()), "");
}

// A rank whose wait times out closes its connections, so a rank still waiting sees "closed by
// peer" with every peer process alive. When the census has a peer's own timeout, the message is
// that timeout's, naming the rank that did not arrive (before: "one of ranks 1, 2 has exited",
// which no rank had); with no peer reporting a timeout it stays a closed connection.
TEST(CommFailureText, AConnectionClosedByAPeersTimeoutIsThatTimeout) {
  auto alive = [](int64_t) { return true; };
  const std::function<std::string(int64_t)> stopped_2 = [](int64_t pid) {
    return pid == 102 ? std::string("its process is stopped (T)") : std::string();
  };
  const std::function<std::string(int64_t)> nobody = [](int64_t) { return std::string(); };
  const auto peers = three_peers(detail::this_host());
  const std::string cause = "Connection closed by peer [10.1.0.1]:7";
  // Peers of another host cannot be probed: a closed connection asks the census.
  const auto remote = three_peers("h");
  EXPECT_TRUE(detail::wants_census(cause, {remote[0], remote[2]}, 0));
  EXPECT_TRUE(detail::wants_census("Operation timed out!", peers, 0));
  EXPECT_FALSE(detail::wants_census("unknown failure", {remote[0], remote[2]}, 0));
  EXPECT_FALSE(detail::wants_census(cause, {}, 0));  // an elastic lane knows no peers
  // A dead peer of this host (pid 1 << 30 cannot exist) is the answer: no census.
  EXPECT_FALSE(
      detail::wants_census(cause, {peers[0], {2, detail::this_host(), "10.1.0.1", 1 << 30}}, 0));
  detail::Census c{true, {2}, {1}};
  auto m = detail::describe_failure("all_reduce of 16 bytes", cause, 2.9, 3s, peers, 0, alive, &c,
                                    stopped_2);
  EXPECT_TRUE(contains(m,
                       "all_reduce of 16 bytes did not complete within 3 s: rank 1 timed out "
                       "waiting for it and closed its connections (here after 2.9 s); no peer "
                       "process of this host has exited, and rank 2 (pid 102 on " +
                           detail::this_host() + ") did not arrive: its process is stopped (T)"))
      << m;
  EXPECT_FALSE(contains(m, "exited without")) << m;
  EXPECT_FALSE(contains(m, "rank 1 (pid")) << m;
  // A peer that reported is waiting, whatever its state at this instant: only the absent are named.
  m = detail::describe_failure("x", "timed out", 3.0, 3s, peers, 0, alive, &c,
                               [](int64_t) { return std::string("its process is in (D)"); });
  EXPECT_TRUE(contains(m, "rank 2 (pid 102 on " + detail::this_host() +
                              ") did not arrive: its process is in (D) (every other"))
      << m;
  EXPECT_FALSE(contains(m, "rank 1 (pid")) << m;
  // Two peers timed out, and the census names nobody absent: the others' reports only.
  c = {true, {}, {1, 2}};
  m = detail::describe_failure("x", "Connection reset by peer", 1.0, 3s, peers, 0, alive, &c,
                               nobody);
  EXPECT_TRUE(contains(m, "ranks 1, 2 timed out waiting for it and closed their connections")) << m;
  EXPECT_TRUE(contains(m, "every rank reached a collective of this communicator")) << m;
  // The store did not answer (its server is stopped): a stopped peer of this host closes
  // nothing, so a live peer's timeout closed it.
  c = {false, {}, {}};
  m = detail::describe_failure("x", cause, 1.5, 3s, peers, 0, alive, &c, stopped_2);
  EXPECT_TRUE(contains(m,
                       "x did not complete within 3 s: a peer closed its connections (here after "
                       "1.5 s), as a rank does when its own wait times out; no peer process of "
                       "this host has exited, and rank 2 (pid 102"))
      << m;
  // No peer reported a timeout, or nothing points at one: a peer closed it, as before.
  for (const detail::Census& other : {detail::Census{true, {2}, {}}, detail::Census{}}) {
    for (const detail::Census* census : {&other, static_cast<const detail::Census*>(nullptr)}) {
      m = detail::describe_failure("x", cause, 0.4, 3s, peers, 0, alive, census,
                                   other.complete ? stopped_2 : nobody);
      EXPECT_TRUE(contains(m, "x failed after 0.4 s: the peer closed the connection")) << m;
      EXPECT_FALSE(contains(m, "did not complete")) << m;
    }
  }
  // A peer process of this host has exited: that is the cause, whatever the census says.
  c = {true, {2}, {1}};
  m = detail::describe_failure(
      "x", cause, 0.4, 3s, peers, 0, [](int64_t pid) { return pid != 102; }, &c, stopped_2);
  EXPECT_TRUE(contains(m, "rank 2 (pid 102 on " + detail::this_host() + ") has exited")) << m;
}

// The census on a real store: a rank whose connection closed waits for the others' reports only
// while a peer's timeout may still be reported (a dead peer never reports); a rank that timed out,
// or learns that a peer did, waits the grace for the absent.
TEST(CommFailureText, TheCensusOfAClosedConnectionEndsSoonWithoutAPeersTimeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto t = Clock::now();
  auto c = detail::census_of(store, "a", 0, 3, 4000ms, /*timed_out=*/false);
  EXPECT_LT(seconds_since(t), 2.5);
  EXPECT_TRUE(c.complete);
  EXPECT_TRUE(c.timed_out.empty());
  t = Clock::now();
  c = detail::census_of(store, "b", 0, 3, 2000ms, /*timed_out=*/true);
  EXPECT_GT(seconds_since(t), 1.9);
  EXPECT_EQ(c.absent, (std::vector<int>{1, 2}));
  // Rank 1 reported its timeout (as rank 0 of census "b" just did): rank 2's closed connection
  // waits for the absent rank 0 to the grace, and names rank 1.
  store->set("fsdp/census/c/1", std::vector<uint8_t>{1});
  t = Clock::now();
  c = detail::census_of(store, "c", 2, 3, 2000ms, /*timed_out=*/false);
  EXPECT_GT(seconds_since(t), 1.9);
  EXPECT_EQ(c.absent, (std::vector<int>{0}));
  EXPECT_EQ(c.timed_out, (std::vector<int>{1}));
}

TEST(CommFailureText, UnconnectedRanksAreNamedWithTheirProcess) {
  RendezvousInfo info;
  info.rank = 0;
  info.world_size = 3;
  auto m = detail::mesh_connect_error(info, 5000ms, three_peers("other"), {2},
                                      "Wait timeout for key(s): [0/2]\nmore");
  EXPECT_TRUE(contains(m,
                       "rendezvous failed for rank 0 of 3 within 5 s (connecting to its peers): "
                       "rank 2 did not connect: it reached the store but never published"))
      << m;
  EXPECT_TRUE(contains(m, "(Wait timeout for key(s): [0/2])")) << m;
  EXPECT_TRUE(contains(m, "rank 2 is pid 102 on other")) << m;
  EXPECT_FALSE(contains(m, "more")) << m;
  m = detail::mesh_connect_error(info, 5000ms, three_peers("other"), {1, 2}, "deadline");
  EXPECT_TRUE(contains(m, "ranks 1, 2 did not connect: they reached")) << m;
  // Every rank published: the addresses are the suspects.
  m = detail::mesh_connect_error(info, 5000ms, three_peers("other"), {}, "Connect timeout [x]");
  EXPECT_TRUE(contains(m, "Connect timeout [x]. Every rank reached the store")) << m;
  EXPECT_TRUE(contains(m, "rank 2 10.1.0.2 (other)")) << m;
  EXPECT_TRUE(contains(m, "FSDP_SOCKET_IFNAME")) << m;
}

// ---- real ranks ----
// Rank 1 dies right after the rendezvous while rank 0 moves 4 MB: rank 0 gets a CommError at once
// (not after the 30 s limit) naming rank 1 as exited, and is not killed by SIGPIPE.
TEST(CommFailureTest, DeadPeerIsNamedAtOnceAndSigpipeCannotKill) {
  RunOptions opt;
  opt.collective_timeout_s = 30;
  opt.expect_failure = true;
  auto res = run_ranks(
      2,
      [](Rank& r) {
        auto c = r.world();
        struct sigaction sa {};
        ::sigaction(SIGPIPE, nullptr, &sa);
        EXPECT_EQ(sa.sa_handler, SIG_IGN) << "init_process_group must ignore SIGPIPE";
        c->barrier().wait();
        if (c->rank() == 1) ::_exit(3);
        auto start = Clock::now();
        auto in = at::ones({1 << 20}, at::kFloat);
        auto out = at::empty({2 << 20}, at::kFloat);
        std::string first;
        for (int i = 0; i < 50 && first.empty(); ++i) {
          auto work = c->all_gather(out, in);
          try {
            work.wait();
          } catch (const CommError& e) {
            first = e.what();
            // Every later wait rethrows the same error.
            try {
              work.wait();
              ADD_FAILURE() << "second wait() after a failure returned";
            } catch (const CommError& again) {
              EXPECT_EQ(std::string(again.what()), first);
            }
          }
        }
        ASSERT_FALSE(first.empty()) << "no error although rank 1 exited";
        EXPECT_LT(seconds_since(start), 10.0) << first;
        EXPECT_TRUE(contains(first, "rank 1 (pid ")) << first;
        EXPECT_TRUE(contains(first, "has exited")) << first;
        EXPECT_FALSE(contains(first, "did not complete within")) << first;
        std::printf("rank 0 saw: %s\n", first.c_str());
        // The group is broken: a later collective fails at once, pointing at the first error,
        // instead of waiting out its own timeout (and the communicator's teardown joins nothing).
        auto later = c->all_reduce(at::ones({4}, at::kFloat), ReduceOp::kSum);
        const auto t = Clock::now();
        try {
          later.wait();
          ADD_FAILURE() << "a collective of a broken group completed";
        } catch (const CommError& e) {
          EXPECT_TRUE(contains(e.what(), "all_reduce of 16 bytes")) << e.what();
          EXPECT_TRUE(contains(e.what(),
                               "cannot complete: an earlier collective of this group "
                               "failed (all_gather of 8388608 bytes"))
              << e.what();
        }
        EXPECT_LT(seconds_since(t), 1.0);
      },
      opt);
  if (in_rank_process()) return;
  EXPECT_EQ(res.exit_codes[1], 3) << res.output[1];
  EXPECT_EQ(res.exit_codes[0], 0) << "rank 0 (128+13 = SIGPIPE):\n" << res.output[0];
  EXPECT_TRUE(contains(res.output[0], "rank 0 saw:")) << res.output[0];
}

// A rank that never starts: every rank that did names it (on the store: which ranks arrived),
// within the timeout + 5 s.
TEST(CommFailureTest, RendezvousNamesTheRankThatNeverStarted) {
  RunOptions opt;
  opt.collective_timeout_s = 2;
  run_ranks(
      3,
      [](Rank& r) {
        if (r.rank == 1) return;  // never calls init_process_group
        auto start = Clock::now();
        try {
          r.world();
          ADD_FAILURE() << "rendezvous succeeded without rank 1";
        } catch (const CommError& e) {
          const std::string m = e.what();
          // Rank 0 serves the store; rank 2 may find it gone when rank 0 gave up first.
          EXPECT_TRUE(contains(m, "only 2 of 3 ranks joined (missing rank 1)") ||
                      (r.rank == 2 && contains(m, "lost the store (") &&
                       contains(m, "rank 0, which serves it, gave up or died")))
              << m;
        }
        EXPECT_LT(seconds_since(start), 2 + 5);
      },
      opt);
}

// A peer that joins the rendezvous (store, addresses) and then stalls before building the process
// group: the others' connect stage ends by the deadline, naming it and its process, within the
// timeout + 5 s (before: Gloo's own waits, one timeout per stage). Rank 2 imitates such a peer
// with the rendezvous's own keys and then sleeps past the others' deadline.
TEST(CommFailureTest, PeerThatStallsBeforeConnectingIsNamed) {
  RunOptions opt;
  opt.collective_timeout_s = 3;
  run_ranks(
      3,
      [](Rank& r) {
        if (r.rank == 2) {
          c10d::TCPStoreOptions o;
          o.port = static_cast<uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
          o.isServer = false;
          o.waitWorkers = false;
          o.timeout = 10s;
          c10d::TCPStore store(std::getenv("MASTER_ADDR"), o);
          store.set(detail::arrived_key(2), std::vector<uint8_t>{1});
          store.add(detail::joined_key(), 1);
          const std::string me = detail::cat(detail::this_host(), "\n127.0.0.1\n", ::getpid());
          store.set(detail::peer_key(2), std::vector<uint8_t>(me.begin(), me.end()));
          std::this_thread::sleep_for(6s);  // stalled; rank 0's store outlives its error
          return;
        }
        auto start = Clock::now();
        try {
          r.world();
          ADD_FAILURE() << "rendezvous succeeded without rank 2 connecting";
        } catch (const CommError& e) {
          const std::string m = e.what();
          EXPECT_TRUE(contains(m, detail::cat("rendezvous failed for rank ", r.rank,
                                              " of 3 within 3 s (connecting to its peers): rank 2 "
                                              "did not connect")))
              << m;
          EXPECT_TRUE(contains(m, detail::cat("rank 2 is pid "))) << m;
          EXPECT_TRUE(contains(m, "not stopped or stuck before init_process_group")) << m;
        }
        const double s = seconds_since(start);
        EXPECT_GT(s, 2.5);  // it waited for the peer
        EXPECT_LT(s, 3 + 5);
        // Rank 0 serves the store the other ranks read to say who did not connect; it returns at
        // once: its rendezvous waited until they had read it.
      },
      opt);
}

// A lane that cannot connect (its peer never creates it) fails by the timeout and leaves the
// communicator whole: its statistics and its destruction do not trip over the failed lane.
TEST(CommFailureTest, ALaneThatFailsToConnectLeavesItsCommunicatorWhole) {
  RunOptions opt;
  opt.collective_timeout_s = 2;
  run_ranks(
      2,
      [](Rank& r) {
        auto world = r.world();
        if (r.rank == 0) {
          EXPECT_THROW(world->lane("only-on-rank-0"), std::exception);
          EXPECT_GE(world->total_stats().collectives, 0);
        } else {
          std::this_thread::sleep_for(std::chrono::seconds(4));  // past rank 0's lane timeout
        }
        world->barrier().wait();
        auto t = at::ones({2});
        world->all_reduce(t, ReduceOp::kSum).wait();
        EXPECT_EQ(t[0].item<float>(), 2.0f);
      },
      opt);
}

// A rank stopped by SIGSTOP keeps its connections open: the others' all-reduce times out, and
// every waiting rank names it, its pid and its state (before: "a peer rank is hung ...", no
// rank). Rank 0 serves the store: when it is the stopped one the store cannot answer the census,
// and its state alone names it. A rank whose wait times out closes its connections: a waiting
// rank that arrived later (`late`, 1.5 s after the others) sees them close before its own limit,
// and names the stopped rank all the same (before: "one of ranks 1, 2, 3 has exited").
struct HungCase {
  int hung;
  int late;  // -1: every waiting rank issues the all-reduce at once
};

void PrintTo(const HungCase& c, std::ostream* os) {
  *os << "rank " << c.hung << " hung, rank " << c.late << " late";
}

class HungPeer : public ::testing::TestWithParam<HungCase> {};

TEST_P(HungPeer, IsNamedWhenTheOthersTimeOut) {
  const int hung = GetParam().hung;
  const int late = GetParam().late;
  RunOptions opt;
  opt.collective_timeout_s = 3;
  opt.expect_failure = true;
  auto res = run_ranks(
      4,
      [hung, late](Rank& r) {
        auto c = r.world();
        c->barrier().wait();
        if (c->rank() == hung) {
          ::raise(SIGSTOP);  // until another rank kills it
          return;
        }
        const auto arrived = Clock::now();
        if (c->rank() == late) std::this_thread::sleep_for(1500ms);
        const auto start = Clock::now();
        std::string m;
        try {
          auto t = at::ones({4});
          c->all_reduce(t, ReduceOp::kSum).wait();
          ADD_FAILURE() << "the all-reduce completed without rank " << hung;
        } catch (const CommError& e) {
          m = e.what();
        }
        const auto& p = c->peers()[hung];
        EXPECT_TRUE(contains(m, "did not complete within 3 s")) << m;
        EXPECT_TRUE(contains(m, detail::cat("rank ", hung, " (pid ", p.pid, " on ", p.host,
                                            ") did not arrive: its process is stopped (SIGSTOP")))
            << m;
        for (int other = 0; other < 4; ++other) {
          if (other != hung) {
            EXPECT_FALSE(contains(m, detail::cat("rank ", other, " (pid"))) << m;
          }
        }
        EXPECT_FALSE(contains(m, "has exited.") || contains(m, "have exited") ||
                     contains(m, "exited without"))
            << m;
        EXPECT_LT(seconds_since(start), 3 + 5 + 2) << m;  // the limit, the census, slack
        std::printf("rank %d saw: %s\n", c->rank(), m.c_str());
        // One rank ends the stopped one, and every waiting rank exits, once every waiting rank
        // has written its message (a rank still describing its failure would see a dead process
        // instead): by the late one's start, the limit, the census and slack. The store may be
        // the stopped rank's, so a fixed time after the barrier it is.
        std::this_thread::sleep_until(arrived + 1500ms + 3s + 3s + 2s);
        if (c->rank() == (hung + 1) % 4) ::kill(static_cast<pid_t>(p.pid), SIGKILL);
      },
      opt);
  if (in_rank_process()) return;
  EXPECT_FALSE(res.timed_out);
  EXPECT_EQ(res.exit_codes[hung], 128 + SIGKILL);
  for (int r = 0; r < 4; ++r) {
    if (r != hung) {
      EXPECT_EQ(res.exit_codes[r], 0) << res.output[r];
    }
  }
  if (late >= 0) {  // it saw a connection close, not its own timeout
    EXPECT_TRUE(contains(res.output[late], "here after 1.")) << res.output[late];
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, HungPeer,
    ::testing::Values(HungCase{2, -1}, HungCase{0, -1}, HungCase{2, 0}, HungCase{0, 1}),
    [](const ::testing::TestParamInfo<HungCase>& i) {
      return detail::cat("hung", i.param.hung,
                         i.param.late < 0 ? std::string() : detail::cat("_late", i.param.late));
    });

// Two hand-launched jobs given the same MASTER_PORT: a second job's rank 1 reaches the first
// job's store and stops at once, naming the address, the rank already held and the process holding
// it (before: it joined, then failed 30 s later naming neither); a rank of another world size is
// told the store's job size; the second job's rank 0 is told the port is in use. The first job
// goes on unharmed.
TEST(CommFailureTest, ASecondJobOnTheSamePortIsToldSo) {
  run_ranks(2, [](Rank& r) {
    auto c = r.world();
    if (r.rank == 0) {
      const std::string where =
          detail::cat(std::getenv("MASTER_ADDR"), ":", std::getenv("MASTER_PORT"));
      auto second = [&](const char* rank, const char* size) {
        return run_process({bin_dir() + "/fsdp-example"}, 60s,
                           {{"RANK", rank}, {"WORLD_SIZE", size}, {"FSDP_TIMEOUT_S", "20"}});
      };
      auto p = second("1", "2");
      EXPECT_NE(p.exit_code, 0) << p.output;
      EXPECT_TRUE(contains(p.output, detail::cat("rendezvous failed for rank 1 of 2 at ", where,
                                                 ": rank 1 has already joined this store as pid ",
                                                 c->peers()[1].pid)))
          << p.output;
      EXPECT_TRUE(contains(p.output, "belongs to another job")) << p.output;
      EXPECT_TRUE(contains(p.output, "give each job its own MASTER_PORT")) << p.output;
      EXPECT_LT(p.seconds, 10) << p.output;
      p = second("2", "3");
      EXPECT_TRUE(contains(p.output, "this store serves a job of 2 ranks")) << p.output;
      EXPECT_TRUE(contains(p.output, "not 3")) << p.output;
      p = second("0", "2");
      EXPECT_TRUE(contains(p.output, detail::cat("port ", std::getenv("MASTER_PORT"),
                                                 " is already in use on this host")))
          << p.output;
    }
    c->barrier().wait();
    auto t = at::ones({2});
    c->all_reduce(t, ReduceOp::kSum).wait();
    EXPECT_EQ(t[0].item<float>(), 2.0f);
  });
}

std::atomic<int> g_flag_signal{0};
void flag_only(int sig) { g_flag_signal = sig; }

// A program that turns SIGINT into a flag (as fsdp-train does) is still interrupted during the
// rendezvous: exit status 130 at once, not after the 30 s limit. Its handler is back afterwards.
TEST(CommFailureTest, CtrlCDuringRendezvousExits130) {
  RunOptions opt;
  opt.collective_timeout_s = 30;
  opt.expect_failure = true;
  auto res = run_ranks(
      2,
      [](Rank& r) {
        if (r.rank == 1) return;  // never joins: rank 0 waits for it
        struct sigaction sa {};
        sa.sa_handler = flag_only;
        ::sigaction(SIGINT, &sa, nullptr);
        std::thread([] {
          std::this_thread::sleep_for(700ms);
          ::kill(::getpid(), SIGINT);
        }).detach();
        r.world();
        ADD_FAILURE() << "rendezvous returned without rank 1";
      },
      opt);
  if (in_rank_process()) return;
  EXPECT_EQ(res.exit_codes[0], 128 + SIGINT) << res.output[0];
  EXPECT_TRUE(contains(res.output[0], "fsdp: interrupted during the rendezvous")) << res.output[0];
  EXPECT_FALSE(res.timed_out);
}

TEST(CommFailureTest, ProgramSignalHandlersAreRestoredAfterRendezvous) {
  run_ranks(2, [](Rank& r) {
    struct sigaction sa {};
    sa.sa_handler = flag_only;
    ::sigaction(SIGTERM, &sa, nullptr);
    r.world()->barrier().wait();
    struct sigaction now {};
    ::sigaction(SIGTERM, nullptr, &now);
    EXPECT_EQ(now.sa_handler, &flag_only);
    ::raise(SIGTERM);  // the program's own handler again: a flag, no exit
    EXPECT_EQ(g_flag_signal.load(), SIGTERM);
    // Each rank advertised loopback (MASTER_ADDR is 127.0.0.1) and knows its peers.
    ASSERT_EQ(r.world()->peers().size(), 2u);
    for (const auto& p : r.world()->peers()) {
      EXPECT_EQ(p.address, "127.0.0.1");
      EXPECT_GT(p.pid, 0);
    }
    EXPECT_EQ(r.world()->peers()[r.rank].pid, ::getpid());
  });
}

// ---- the advertised address ----
using Env = std::map<std::string, std::string>;
std::function<const char*(const char*)> lookup(const Env& env) {
  return [&env](const char* k) -> const char* {
    auto it = env.find(k);
    return it == env.end() ? nullptr : it->second.c_str();
  };
}

TEST(AdvertisedAddress, LoopbackMasterInterfaceOrRoute) {
  Env none;
  EXPECT_EQ(detail::advertised_address("127.0.0.1", lookup(none)), "127.0.0.1");
  EXPECT_EQ(detail::advertised_address("localhost", lookup(none)), "127.0.0.1");
  // A non-loopback spelling of this host: the address of the interface that routes to it.
  EXPECT_EQ(detail::route_address("127.0.0.1"), "127.0.0.1");
  Env lo{{"FSDP_SOCKET_IFNAME", "lo"}};
  EXPECT_EQ(detail::advertised_address("10.0.0.1", lookup(lo)), "127.0.0.1");
  Env gloo{{"GLOO_SOCKET_IFNAME", "lo"}};
  EXPECT_EQ(detail::advertised_address("10.0.0.1", lookup(gloo)), "127.0.0.1");
}

TEST(AdvertisedAddress, UnknownInterfaceAndUnresolvableMasterAreNamed) {
  Env bad{{"FSDP_SOCKET_IFNAME", "nosuch0"}};
  expect_error([&] { detail::advertised_address("10.0.0.1", lookup(bad)); },
               {"FSDP_SOCKET_IFNAME=nosuch0 names no interface", "lo (127.0.0.1)"});
  Env gbad{{"GLOO_SOCKET_IFNAME", "nosuch1"}};
  expect_error([&] { detail::advertised_address("10.0.0.1", lookup(gbad)); },
               {"GLOO_SOCKET_IFNAME=nosuch1"});
  expect_error([] { detail::route_address("no-such-host.invalid"); },
               {"MASTER_ADDR=no-such-host.invalid cannot be resolved"});
}

}  // namespace
}  // namespace fsdp::testing::comm_failure_test
