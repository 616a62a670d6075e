// torchrun (of the torch the build uses: tests/harness.h) launching a real multi-rank program: its
// elastic agent already serves the store on MASTER_PORT, so the ranks must use it
// (TORCHELASTIC_USE_AGENT_STORE) instead of binding the port themselves.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "harness.h"

namespace fsdp::testing {
namespace {

using namespace std::chrono_literals;

TEST(TorchrunTest, QuickstartTrainsOnTwoRanksUsingTheAgentStore) {
  ASSERT_TRUE(has_torchrun()) << torchrun_command({})[0]
                              << " is missing: `make test` installs it (scripts/setup.sh)";
  auto r = run_process(
      torchrun_command({"--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                        std::to_string(free_port()), "--no-python", bin_dir() + "/fsdp-example"}),
      180s, {{"FSDP_TIMEOUT_S", "60"}});
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step 15 loss"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("address already in use"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace fsdp::testing
