// Two "hosts" on one machine: two network namespaces joined by a veth pair (addresses exist only
// inside the namespaces this test creates), the machine's own /etc/hosts (which maps the hostname
// to a loopback address). Two ranks train a tiny sharded GPT across the link; then the link is cut
// and both ranks must exit with a collective error within FSDP_TIMEOUT_S + 5 s.
// Needs root (ip netns); skipped otherwise.
#include "netns.h"

#include <fcntl.h>
#include <fsdp/fsdp.h>
#include <fsdp/init.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "harness.h"
#include "tiny_gpt.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::netns_test {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr const char* kRoleEnv = "FSDP_NETNS_RANK";
constexpr int kTimeoutS = 5;

// In a rank: train until a collective fails; the error is printed and the rank exits 2 after its
// communicator and model are destroyed (a real program's unwinding, not _exit).
int train_until_failure() {
  try {
    auto world = init_process_group();
    std::printf("rank %d advertises %s\n", world->rank(),
                world->peers()[world->rank()].address.c_str());
    torch::manual_seed(0);
    fsdp::Sharded<models::GPT> model{models::GPT(tiny_gpt())};
    auto root = models::shard_gpt(model, world);
    torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-3));
    for (int step = 0;; ++step) {
      torch::manual_seed(100 * world->rank() + step);
      auto x = torch::randint(0, 32, {2, 8});
      auto loss = model(x, x);
      loss.backward();
      opt.step();
      opt.zero_grad();
      if (step % 10 == 0) std::printf("step %d loss %.4f\n", step, loss.item<float>());
      std::fflush(stdout);
      std::this_thread::sleep_for(10ms);
    }
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    std::fflush(stdout);
    return 2;
  }
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct RankProc {
  pid_t pid = -1;
  std::string log;
  int status = -1;
  double exit_s = -1;  // seconds after the cut
};

pid_t spawn(const std::string& ns, int rank, const std::string& log, const std::string& exe,
            const std::map<std::string, std::string>& env = {}) {
  const std::string filter =
      "--gtest_filter=" +
      std::string(::testing::UnitTest::GetInstance()->current_test_info()->test_suite_name()) +
      "." + ::testing::UnitTest::GetInstance()->current_test_info()->name();
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::setenv(kRoleEnv, "1", 1);
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("LOCAL_RANK", "0", 1);
    ::setenv("WORLD_SIZE", "2", 1);
    ::setenv("MASTER_ADDR", "10.99.0.1", 1);
    ::setenv("MASTER_PORT", "29511", 1);
    ::setenv("FSDP_TIMEOUT_S", std::to_string(kTimeoutS).c_str(), 1);
    ::setenv("OMP_NUM_THREADS", "1", 1);
    ::unsetenv("FSDP_SOCKET_IFNAME");
    ::unsetenv("GLOO_SOCKET_IFNAME");
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    ::execlp("ip", "ip", "netns", "exec", ns.c_str(), exe.c_str(), filter.c_str(), nullptr);
    ::_exit(127);
  }
  return pid;
}

TEST(TwoHostsTest, TrainsAcrossNamespacesThenACutLinkEndsBothRanks) {
  if (std::getenv(kRoleEnv)) std::exit(train_until_failure());
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces";
  char exe[4096] = {0};
  ASSERT_GT(::readlink("/proc/self/exe", exe, sizeof exe - 1), 0);
  Namespaces ns(::getpid());
  if (auto e = ns.create(); !e.empty()) GTEST_SKIP() << "cannot build the namespaces: " << e;

  char tmpl[] = "/tmp/fsdp-netns-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  RankProc ranks[2];
  for (int r = 0; r < 2; ++r) {
    ranks[r].log = dir + "/rank" + std::to_string(r) + ".log";
    ranks[r].pid = spawn(r == 0 ? ns.a : ns.b, r, ranks[r].log, exe);
  }
  auto reap = [&](Clock::time_point cut) {
    for (auto& p : ranks) {
      int st = 0;
      if (p.status == -1 && ::waitpid(p.pid, &st, WNOHANG) == p.pid) {
        p.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        p.exit_s = std::chrono::duration<double>(Clock::now() - cut).count();
      }
    }
  };
  auto dump = [&] {
    return "rank 0:\n" + slurp(ranks[0].log) + "\nrank 1:\n" + slurp(ranks[1].log);
  };
  auto kill_all = [&] {
    for (auto& p : ranks)
      if (p.status == -1) ::kill(-p.pid, SIGKILL), ::waitpid(p.pid, nullptr, 0);
  };

  // 1. Both ranks train across the link.
  const auto start = Clock::now();
  bool trained = false;
  while (!trained && Clock::now() - start < 120s) {
    reap(start);
    if (ranks[0].status != -1 || ranks[1].status != -1) break;
    trained = slurp(ranks[0].log).find("step 20 ") != std::string::npos &&
              slurp(ranks[1].log).find("step 20 ") != std::string::npos;
    std::this_thread::sleep_for(50ms);
  }
  if (!trained) kill_all();
  ASSERT_TRUE(trained) << "the ranks did not train 20 steps across the namespaces:\n" << dump();
  EXPECT_NE(slurp(ranks[0].log).find("rank 0 advertises 10.99.0.1"), std::string::npos) << dump();
  EXPECT_NE(slurp(ranks[1].log).find("rank 1 advertises 10.99.0.2"), std::string::npos) << dump();

  // 2. Cut the link: both ranks end with the collective error within the timeout + 5 s.
  const auto cut = Clock::now();
  ASSERT_EQ(ip({"-n", ns.a, "link", "set", ns.va, "down"}), "");
  while ((ranks[0].status == -1 || ranks[1].status == -1) && Clock::now() - cut < 60s) {
    reap(cut);
    std::this_thread::sleep_for(20ms);
  }
  kill_all();
  for (int r = 0; r < 2; ++r) {
    const std::string log = slurp(ranks[r].log);
    std::printf("rank %d: exit status %d, %.2f s after the cut\n", r, ranks[r].status,
                ranks[r].exit_s);
    EXPECT_EQ(ranks[r].status, 2) << dump();
    EXPECT_GE(ranks[r].exit_s, 0) << "rank " << r << " still running 60 s after the cut";
    EXPECT_LE(ranks[r].exit_s, kTimeoutS + 5.0) << dump();
    const auto at = log.find("error: fsdp: ");
    ASSERT_NE(at, std::string::npos) << dump();
    const std::string msg = log.substr(at, log.find('\n', at) - at);
    std::printf("rank %d: %s\n", r, msg.c_str());
    EXPECT_NE(msg.find(" s"), std::string::npos) << msg;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fsdp::testing::netns_test
