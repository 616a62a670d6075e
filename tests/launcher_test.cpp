// fsdp-run as a real program: output prefixes, the torchrun variables, exit-status propagation,
// stopping the other ranks, and Ctrl-C. The ranks are tiny `sh -c` scripts.
#include <gtest/gtest.h>
#include <signal.h>

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

}  // namespace
}  // namespace fsdp::testing
