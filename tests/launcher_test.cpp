// fsdp-run as a real program: output prefixes, the torchrun variables, exit-status propagation,
// stopping the other ranks, and Ctrl-C; with --replicas, the coordinator, the replicas' variables,
// and stopping and restarting one replica. The ranks are tiny `sh -c` scripts; the coordinator is a
// stand-in written at test time (python3), so these tests do not need the real one.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "harness.h"

namespace fsdp::testing {
namespace {

using namespace std::chrono_literals;

std::string launcher() { return bin_dir() + "/fsdp-run"; }

ProcResult launch(int n, const std::string& script, std::vector<std::string> extra = {}) {
  std::vector<std::string> argv{launcher(), "-n", std::to_string(n)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), {"--", "sh", "-c", script});
  return run_process(argv, 60s);
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t nl; (nl = s.find('\n', start)) != std::string::npos; start = nl + 1)
    out.push_back(s.substr(start, nl - start));
  if (start < s.size()) out.push_back(s.substr(start));
  return out;
}

bool has_line(const std::string& out, const std::string& line) {
  for (const auto& l : lines(out))
    if (l == line) return true;
  return false;
}

bool process_exists(int pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

// Every rank printed "pid=N"; none of those processes may be left behind.
void expect_ranks_reaped(const std::string& output, int ranks) {
  std::smatch m;
  std::string out = output;
  int seen = 0;
  for (std::regex re("pid=([0-9]+)"); std::regex_search(out, m, re); out = m.suffix()) {
    EXPECT_FALSE(process_exists(std::stoi(m[1]))) << "rank process " << m[1] << " left behind";
    ++seen;
  }
  EXPECT_EQ(seen, ranks) << output;
}

TEST(LauncherTest, PrefixesEveryLineAndSetsTorchrunVariables) {
  auto r = launch(3,
                  "echo \"env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR\"; "
                  "echo \"port $MASTER_PORT\"; echo to-stderr >&2; printf 'no newline'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::set<std::string> ports;
  for (int k = 0; k < 3; ++k) {
    const std::string p = "[rank " + std::to_string(k) + "] ";
    const std::string ks = std::to_string(k);
    EXPECT_TRUE(has_line(r.output, p + "env " + ks + " " + ks + " 3 3 127.0.0.1")) << r.output;
    EXPECT_TRUE(has_line(r.output, p + "to-stderr")) << r.output;
    EXPECT_TRUE(has_line(r.output, p + "no newline")) << r.output;  // partial last line flushed
    std::smatch m;
    std::string out = r.output;
    std::regex re("\\[rank " + ks + "\\] port ([0-9]+)");
    ASSERT_TRUE(std::regex_search(out, m, re)) << r.output;
    ports.insert(m[1]);
  }
  EXPECT_EQ(ports.size(), 1u) << "all ranks must share MASTER_PORT";
  // Nothing unprefixed from the ranks.
  for (const auto& l : lines(r.output)) EXPECT_EQ(l.rfind("[rank ", 0), 0u) << l;
}

TEST(LauncherTest, MasterPortOptionIsPassedThrough) {
  auto r = launch(2, "echo port=$MASTER_PORT", {"--master-port", "29999"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has_line(r.output, "[rank 0] port=29999")) << r.output;
  EXPECT_TRUE(has_line(r.output, "[rank 1] port=29999")) << r.output;
}

TEST(LauncherTest, FailingRankExitCodePropagatesAndOthersAreStopped) {
  auto r = launch(3,
                  "if [ \"$RANK\" = 1 ]; then sleep 0.3; echo failing; exit 7; fi; "
                  "echo pid=$$; exec sleep 30");
  EXPECT_EQ(r.exit_code, 7) << r.output;
  EXPECT_LT(r.seconds, 5.0) << "the sleeping ranks were not stopped promptly";
  EXPECT_TRUE(has_line(r.output, "[rank 1] failing")) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with status 7"), std::string::npos) << r.output;
  // The sleeping ranks are gone (reaped), not orphaned.
  expect_ranks_reaped(r.output, 2);
}

TEST(LauncherTest, RankKilledBySignalGives128PlusSignal) {
  auto r = launch(2, "if [ \"$RANK\" = 0 ]; then kill -KILL $$; fi; exec sleep 30");
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.output;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_NE(r.output.find("rank 0 was killed by signal 9"), std::string::npos) << r.output;
}

TEST(LauncherTest, RankIgnoringSigtermIsKilledAfterGracePeriod) {
  auto r = launch(2, "if [ \"$RANK\" = 1 ]; then sleep 0.3; exit 3; fi; trap '' TERM; sleep 30",
                  {"--grace-period", "1"});
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_LT(r.seconds, 4.0);
  EXPECT_NE(r.output.find("sending SIGKILL"), std::string::npos) << r.output;
}

TEST(LauncherTest, CtrlCStopsAllRanks) {
  // sh starts fsdp-run in the background, interrupts it once all ranks are up, and reports.
  const std::string script =
      "\"$0\" -n 3 -- sh -c 'echo pid=$$; exec sleep 30' & p=$!; "
      "sleep 1.5; kill -INT $p; wait $p; echo status=$?";
  auto r = run_process({"sh", "-c", script, launcher()}, 30s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has_line(r.output, "status=130")) << r.output;
  EXPECT_LT(r.seconds, 6.0);
  EXPECT_NE(r.output.find("received signal 2"), std::string::npos) << r.output;
  expect_ranks_reaped(r.output, 3);
}

TEST(LauncherTest, UnknownProgramAndUsageErrors) {
  auto r = run_process({launcher(), "-n", "2", "/nonexistent/prog"}, 10s);
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_NE(r.output.find("cannot execute '/nonexistent/prog': No such file or directory"),
            std::string::npos)
      << r.output;
  r = run_process({launcher(), "-n", "2"}, 10s);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no program given"), std::string::npos) << r.output;
  r = run_process({launcher(), "echo", "hi"}, 10s);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--nproc is required"), std::string::npos) << r.output;
  r = run_process({launcher(), "--help"}, 10s);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("fsdp-run -n N"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("128+signal"), std::string::npos) << r.output;
}

TEST(LauncherTest, ArgumentsAfterProgramBelongToIt) {
  // Without '--', options after PROG are PROG's, not fsdp-run's.
  auto r = run_process({launcher(), "-n", "1", "sh", "-c", "echo \"$0 $1\"", "-n", "--help"}, 10s);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has_line(r.output, "[rank 0] -n --help")) << r.output;
}

// ---- --replicas ----

// A stand-in for fsdp-coordinator: prints its pid, then accepts (and closes) connections on
// 127.0.0.1:P, given as `--port P`, until it is stopped.
const char* const kFakeCoordinator = R"(#!/bin/sh
echo pid=$$
exec python3 -c '
import socket, sys
assert sys.argv[1] == "--port", sys.argv
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[2])))
s.listen(64)
print("listening on", sys.argv[2], flush=True)
while True:
    s.accept()[0].close()
' "$@"
)";

// Writes an executable script `name` into `dir`; its path.
std::string write_script(const std::string& dir, const std::string& name, const std::string& body) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << body;
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

ProcResult launch_replicas(int n, int replicas, const std::string& script,
                           const std::string& coordinator, std::vector<std::string> extra = {},
                           std::map<std::string, std::string> env = {}) {
  std::vector<std::string> argv{launcher(), "-n", std::to_string(n), "--replicas",
                                std::to_string(replicas)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), {"--", "sh", "-c", script});
  env["FSDP_COORDINATOR_BIN"] = coordinator;
  return run_process(argv, 60s, env);
}

// The value of the first match of `re`'s group 1 in `out`; "" when it does not match.
std::string find(const std::string& out, const std::string& re) {
  std::smatch m;
  return std::regex_search(out, m, std::regex(re)) ? m[1].str() : "";
}

// A scratch directory for scripts, removed after the test.
class LauncherReplicasTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test_scratch_dir("FSDP_LAUNCHER_TEST_DIR", "launcher_"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // The stand-in coordinator; skips the test where python3 is missing.
  std::string coordinator() {
    static const bool has_python = std::system("python3 -c pass >/dev/null 2>&1") == 0;
    if (!has_python) return "";
    return write_script(dir_, "coordinator", kFakeCoordinator);
  }

  std::string dir_;
};

#define FAKE_COORDINATOR_OR_SKIP(var)    \
  const std::string var = coordinator(); \
  if (var.empty()) GTEST_SKIP() << "python3 (for the stand-in coordinator) is missing"

TEST_F(LauncherReplicasTest, EachReplicaIsItsOwnRendezvousWithTheElasticVariables) {
  FAKE_COORDINATOR_OR_SKIP(coord);
  auto r = launch_replicas(4, 2,
                           "echo \"env $FSDP_REPLICA_ID $RANK $LOCAL_RANK $WORLD_SIZE "
                           "$LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $FSDP_MIN_REPLICAS "
                           "$FSDP_REPLICA_RESTART\"; "
                           "echo \"coordinator $FSDP_ELASTIC_COORDINATOR port $MASTER_PORT\"",
                           coord);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string coord_port = find(r.output, "\\[coordinator\\] listening on ([0-9]+)");
  ASSERT_FALSE(coord_port.empty()) << r.output;
  std::set<std::string> ports[2];
  for (int rep = 0; rep < 2; ++rep)
    for (int k = 0; k < 2; ++k) {
      const std::string id = std::to_string(rep), ks = std::to_string(k);
      const std::string p = "[replica " + id + " rank " + ks + "] ";
      EXPECT_TRUE(
          has_line(r.output, p + "env " + id + " " + ks + " " + ks + " 2 2 0 127.0.0.1 2 0"))
          << r.output;
      const std::string re = "\\[replica " + id + " rank " + ks + "\\] coordinator ";
      EXPECT_EQ(find(r.output, re + "(\\S+) port"), "127.0.0.1:" + coord_port) << r.output;
      ports[rep].insert(find(r.output, re + "\\S+ port ([0-9]+)"));
    }
  EXPECT_EQ(ports[0].size(), 1u) << "the ranks of a replica share MASTER_PORT\n" << r.output;
  EXPECT_EQ(ports[1].size(), 1u) << "the ranks of a replica share MASTER_PORT\n" << r.output;
  EXPECT_NE(*ports[0].begin(), *ports[1].begin()) << "each replica is its own rendezvous";
  EXPECT_NE(*ports[0].begin(), coord_port);
  for (const auto& l : lines(r.output))
    EXPECT_TRUE(l.rfind("[replica ", 0) == 0 || l.rfind("[coordinator] ", 0) == 0) << l;
  expect_ranks_reaped(r.output, 1);  // the coordinator was stopped at the end
}

TEST_F(LauncherReplicasTest, FailingRankStopsOnlyItsReplica) {
  FAKE_COORDINATOR_OR_SKIP(coord);
  auto r = launch_replicas(4, 2,
                           "if [ \"$FSDP_REPLICA_ID\" = 1 ]; then "
                           "  if [ \"$RANK\" = 0 ]; then sleep 0.3; echo failing; exit 5; fi; "
                           "  echo pid=$$; exec sleep 30; "
                           "fi; sleep 1.5; echo done",
                           coord);
  // Replica 0 finished, replica 1 was lost: the job succeeds.
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 5.0) << "replica 1's sleeping rank was not stopped promptly";
  EXPECT_TRUE(has_line(r.output, "[replica 1 rank 0] failing")) << r.output;
  EXPECT_TRUE(has_line(r.output,
                       "fsdp-run: replica 1 rank 0 exited with status 5; stopping "
                       "replica 1's other ranks"))
      << r.output;
  EXPECT_NE(r.output.find("replica 1 stays down"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("restarting"), std::string::npos) << r.output;
  // Replica 0 was left alone and finished.
  EXPECT_TRUE(has_line(r.output, "[replica 0 rank 0] done")) << r.output;
  EXPECT_TRUE(has_line(r.output, "[replica 0 rank 1] done")) << r.output;
  expect_ranks_reaped(r.output, 2);  // replica 1's rank 1 and the coordinator
}

TEST_F(LauncherReplicasTest, JobFailsWithTheFirstStatusWhenEveryReplicaIsDown) {
  FAKE_COORDINATOR_OR_SKIP(coord);
  auto r = launch_replicas(
      4, 2,
      "if [ \"$FSDP_REPLICA_ID\" = 0 ]; then sleep 0.2; exit 3; fi; "
      "if [ \"$RANK\" = 0 ]; then sleep 0.8; kill -KILL $$; fi; echo pid=$$; exec sleep 30",
      coord);
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_NE(r.output.find("replica 1 rank 0 was killed by signal 9"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("every replica is down"), std::string::npos) << r.output;
  expect_ranks_reaped(r.output, 2);
}

TEST_F(LauncherReplicasTest, MaxRestartsRelaunchesOnlyTheFailedReplica) {
  FAKE_COORDINATOR_OR_SKIP(coord);
  // Replica 1 fails on its first launch only.
  auto r = launch_replicas(4, 2,
                           "echo \"start $FSDP_REPLICA_RESTART\"; "
                           "if [ \"$FSDP_REPLICA_ID$FSDP_REPLICA_RESTART\" = 10 ]; then "
                           "  if [ \"$RANK\" = 0 ]; then sleep 0.3; exit 9; fi; "
                           "  echo pid=$$; exec sleep 30; "
                           "fi; sleep 0.5; echo done",
                           coord, {"--max-restarts", "1", "--restart-delay", "0.2"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_TRUE(has_line(r.output, "fsdp-run: restarting replica 1 (restart 1 of 1)")) << r.output;
  for (const std::string k : {"0", "1"}) {
    EXPECT_TRUE(has_line(r.output, "[replica 1 rank " + k + "] start 0")) << r.output;
    EXPECT_TRUE(has_line(r.output, "[replica 1 rank " + k + "] start 1")) << r.output;
    EXPECT_TRUE(has_line(r.output, "[replica 1 rank " + k + "] done")) << r.output;
    EXPECT_TRUE(has_line(r.output, "[replica 0 rank " + k + "] done")) << r.output;
    EXPECT_FALSE(has_line(r.output, "[replica 0 rank " + k + "] start 1")) << r.output;
  }
  expect_ranks_reaped(r.output, 2);  // replica 1's first rank 1 and the coordinator
}

TEST_F(LauncherReplicasTest, NoReplicaIsRelaunchedOnceAnotherFinishedTheJob) {
  FAKE_COORDINATOR_OR_SKIP(coord);
  // Replica 0 finishes at once; replica 1 fails after it: its relaunch would find no job.
  auto r = launch_replicas(2, 2,
                           "if [ \"$FSDP_REPLICA_ID\" = 1 ]; then sleep 0.5; exit 5; fi; echo done",
                           coord, {"--max-restarts", "3", "--restart-delay", "0"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has_line(r.output, "[replica 0 rank 0] done")) << r.output;
  EXPECT_TRUE(
      has_line(r.output, "fsdp-run: replica 1 is not restarted: replica 0 finished the job"))
      << r.output;
  EXPECT_EQ(r.output.find("restarting replica"), std::string::npos) << r.output;
}

TEST_F(LauncherReplicasTest, RestartBudgetIsSharedByAllReplicas) {
  FAKE_COORDINATOR_OR_SKIP(coord);
  // Both replicas fail on their first launch, replica 0 first: it takes the only restart.
  auto r = launch_replicas(2, 2,
                           "if [ \"$FSDP_REPLICA_RESTART\" = 0 ]; then "
                           "  if [ \"$FSDP_REPLICA_ID\" = 0 ]; then sleep 0.2; else sleep 1; fi; "
                           "  exit 6; "
                           "fi; sleep 1.5; echo done",
                           coord, {"--max-restarts", "1", "--restart-delay", "0"});
  EXPECT_EQ(r.exit_code, 0) << r.output;  // replica 0 finished on its restart, after 1 failed
  EXPECT_TRUE(has_line(r.output, "fsdp-run: restarting replica 0 (restart 1 of 1)")) << r.output;
  EXPECT_TRUE(has_line(r.output, "[replica 0 rank 0] done")) << r.output;
  EXPECT_NE(r.output.find("replica 1 stays down: no restarts left"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("restarting replica 1"), std::string::npos) << r.output;
}

TEST_F(LauncherReplicasTest, CtrlCStopsEveryReplicaAndTheCoordinator) {
  FAKE_COORDINATOR_OR_SKIP(coord);
  const std::string script =
      "\"$0\" -n 4 --replicas 2 -- sh -c 'echo pid=$$; exec sleep 30' & p=$!; "
      "sleep 1.5; kill -INT $p; wait $p; echo status=$?";
  auto r = run_process({"sh", "-c", script, launcher()}, 30s, {{"FSDP_COORDINATOR_BIN", coord}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has_line(r.output, "status=130")) << r.output;
  EXPECT_LT(r.seconds, 6.0);
  EXPECT_NE(r.output.find("received signal 2"), std::string::npos) << r.output;
  expect_ranks_reaped(r.output, 5);  // 4 ranks and the coordinator
}

TEST_F(LauncherReplicasTest, CoordinatorThatCannotStartIsReported) {
  // Not there: nothing is launched.
  auto r = launch_replicas(2, 2, "echo launched", "/nonexistent/fsdp-coordinator");
  EXPECT_EQ(r.exit_code, 127) << r.output;
  EXPECT_NE(r.output.find("cannot execute the coordinator '/nonexistent/fsdp-coordinator': No "
                          "such file or directory"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("launched"), std::string::npos) << r.output;
  // Exits at once.
  const std::string quits = write_script(dir_, "quits", "#!/bin/sh\necho \"usage: $*\"; exit 3\n");
  r = launch_replicas(2, 2, "echo launched", quits);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has_line(r.output, "[coordinator] usage: --port " +
                                     find(r.output, "accepted connections on 127.0.0.1:([0-9]+)")))
      << r.output;
  EXPECT_NE(r.output.find("'" + quits + "' exited with status 3 before it accepted connections"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("launched"), std::string::npos) << r.output;
  // Never listens: given up after FSDP_COORDINATOR_TIMEOUT_S, and stopped.
  const std::string deaf = write_script(dir_, "deaf", "#!/bin/sh\necho pid=$$\nexec sleep 30\n");
  r = launch_replicas(2, 2, "echo launched", deaf, {}, {{"FSDP_COORDINATOR_TIMEOUT_S", "1"}});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_NE(r.output.find("'" + deaf + "' did not accept connections on 127.0.0.1:"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("launched"), std::string::npos) << r.output;
  expect_ranks_reaped(r.output, 1);
}

TEST(LauncherTest, ReplicasUsageErrors) {
  const std::vector<std::string> prog{"sh", "-c", "echo launched"};
  auto run = [&](std::vector<std::string> args) {
    args.insert(args.begin(), launcher());
    args.insert(args.end(), prog.begin(), prog.end());
    return run_process(args, 10s, {{"FSDP_COORDINATOR_BIN", "/nonexistent/fsdp-coordinator"}});
  };
  auto r = run({"-n", "4", "--replicas", "3"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--replicas 3 does not divide -n 4"), std::string::npos) << r.output;
  r = run({"-n", "2", "--replicas", "0"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--replicas must be at least 1"), std::string::npos) << r.output;
  r = run({"-n", "2", "--max-restarts", "1"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("need --replicas"), std::string::npos) << r.output;
  r = run({"-n", "4", "--replicas", "2", "--master-port", "29999"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--master-port cannot be used with --replicas"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("launched"), std::string::npos) << r.output;
  r = run_process({launcher(), "--help"}, 10s);
  EXPECT_EQ(r.exit_code, 0);
  for (const char* s :
       {"--replicas R", "FSDP_ELASTIC_COORDINATOR", "FSDP_REPLICA_ID", "FSDP_MIN_REPLICAS",
        "FSDP_REPLICA_RESTART", "FSDP_COORDINATOR_BIN", "--max-restarts", "--restart-delay"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
}

TEST(LauncherTest, OneReplicaIsThePlainMode) {
  // No coordinator, the plain prefixes and variables.
  auto r = run_process({launcher(), "-n", "2", "--replicas", "1", "--", "sh", "-c",
                        "echo \"id=$FSDP_REPLICA_ID world=$WORLD_SIZE\""},
                       10s, {{"FSDP_COORDINATOR_BIN", "/nonexistent/fsdp-coordinator"}});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has_line(r.output, "[rank 0] id= world=2")) << r.output;
  EXPECT_TRUE(has_line(r.output, "[rank 1] id= world=2")) << r.output;
}

}  // namespace
}  // namespace fsdp::testing
