// torchrun (python3 -m torch.distributed.run, of the torch the build uses: tests/comm.cmake)
// launching a real multi-rank program: its elastic agent already serves the store on MASTER_PORT,
// so the ranks must use it (TORCHELASTIC_USE_AGENT_STORE) instead of binding the port themselves.
// Skipped where no python3 with torch is installed.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "harness.h"

namespace fsdp::testing {
namespace {

using namespace std::chrono_literals;

const char* kPython = FSDP_TORCH_PYTHON;

// Where that torch installs torchrun; asking Python to import it costs ~10 s.
bool have_torchrun() {
  return ::access(kPython, X_OK) == 0 && ::access(FSDP_TORCHRUN_SCRIPT, R_OK) == 0;
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

TEST(TorchrunTest, QuickstartTrainsOnTwoRanksUsingTheAgentStore) {
  if (!have_torchrun()) GTEST_SKIP() << "no " << kPython << " with torch (python3-torch)";
  // torchrun 1.13 on Python 3.11 crashes before starting workers without --redirects/--tee
  // (torch's bug; see README "Launching").
  auto r = run_process({kPython, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1",
                        "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--no_python",
                        "--master_port", std::to_string(free_port()), bin_dir() + "/fsdp-example"},
                       180s, {{"FSDP_TIMEOUT_S", "60"}});
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step 15 loss"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("address already in use"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace fsdp::testing
