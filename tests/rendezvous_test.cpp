// parse_rendezvous_env and resolve_timeout: every launcher's variables, and each invalid case by
// its message. Single process; the environment is a map passed as the lookup function.
#include <fsdp/error.h>
#include <fsdp/init.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>
#include <string>

namespace fsdp {
namespace {

using Env = std::map<std::string, std::string>;

RendezvousInfo parse(const Env& env) {
  return parse_rendezvous_env([&env](const char* k) -> const char* {
    auto it = env.find(k);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

// The error message of parse(env), or "" when it succeeds.
std::string error_of(const Env& env) {
  try {
    parse(env);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

TEST(RendezvousEnvTest, Torchrun) {
  auto i = parse({{"RANK", "3"},
                  {"WORLD_SIZE", "4"},
                  {"LOCAL_RANK", "1"},
                  {"MASTER_ADDR", "10.0.0.7"},
                  {"MASTER_PORT", "29611"}});
  EXPECT_EQ(i.source, "torchrun");
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.world_size, 4);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.master_addr, "10.0.0.7");
  EXPECT_EQ(i.master_port, 29611);
}

TEST(RendezvousEnvTest, TorchrunAgentStoreAndAttempt) {
  Env env{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}};
  EXPECT_FALSE(parse(env).agent_store);  // fsdp-run, mpirun, srun: rank 0 serves the store
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["TORCHELASTIC_RESTART_COUNT"] = "3";
  auto i = parse(env);
  EXPECT_TRUE(i.agent_store);
  EXPECT_EQ(i.restart_count, 3);
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";  // PyTorch compares with "True" exactly
  EXPECT_FALSE(parse(env).agent_store);
  env["TORCHELASTIC_RESTART_COUNT"] = "again";
  EXPECT_HAS(error_of(env), "TORCHELASTIC_RESTART_COUNT='again' is not an integer");
}

TEST(RendezvousEnvTest, OpenMpi) {
  auto i = parse({{"OMPI_COMM_WORLD_RANK", "2"},
                  {"OMPI_COMM_WORLD_SIZE", "8"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                  {"MASTER_ADDR", "node0"}});
  EXPECT_EQ(i.source, "openmpi");
  EXPECT_EQ(i.rank, 2);
  EXPECT_EQ(i.world_size, 8);
  EXPECT_EQ(i.local_rank, 0);
  EXPECT_EQ(i.master_addr, "node0");
  EXPECT_EQ(i.master_port, 29500);  // the default port
}

TEST(RendezvousEnvTest, Slurm) {
  auto i = parse({{"SLURM_PROCID", "5"},
                  {"SLURM_NTASKS", "6"},
                  {"SLURM_LOCALID", "1"},
                  {"SLURM_STEP_ID", "0"},  // srun sets it for every task (slurm_test.cpp)
                  {"MASTER_ADDR", "127.0.0.1"},
                  {"MASTER_PORT", "1234"}});
  EXPECT_EQ(i.source, "slurm");
  EXPECT_EQ(i.rank, 5);
  EXPECT_EQ(i.world_size, 6);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.master_port, 1234);
}

TEST(RendezvousEnvTest, TorchrunWinsOverSchedulerVariables) {
  // torchrun inside a Slurm allocation: the per-process torchrun variables describe this rank.
  auto i = parse({{"RANK", "1"},
                  {"WORLD_SIZE", "2"},
                  {"SLURM_PROCID", "0"},
                  {"SLURM_NTASKS", "1"},
                  {"MASTER_ADDR", "127.0.0.1"}});
  EXPECT_EQ(i.source, "torchrun");
  EXPECT_EQ(i.rank, 1);
}

TEST(RendezvousEnvTest, NothingSetIsOneRank) {
  auto i = parse({});
  EXPECT_EQ(i.source, "none");
  EXPECT_EQ(i.rank, 0);
  EXPECT_EQ(i.world_size, 1);
  EXPECT_EQ(i.local_rank, 0);
  // An empty variable counts as unset.
  EXPECT_EQ(parse({{"RANK", ""}, {"WORLD_SIZE", ""}}).world_size, 1);
}

TEST(RendezvousEnvTest, RankNotBelowWorldSizeIsRejected) {
  auto m = error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}});
  EXPECT_HAS(m, "RANK=2 must be less than WORLD_SIZE=2");
  m = error_of(
      {{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}, {"SLURM_STEP_ID", "0"}, {"MASTER_ADDR", "h"}});
  EXPECT_HAS(m, "SLURM_PROCID=4 must be less than SLURM_NTASKS=4");
}

TEST(RendezvousEnvTest, NonNumbersAreRejectedNamingTheVariable) {
  auto m = error_of({{"RANK", "one"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}});
  EXPECT_HAS(m, "RANK='one' is not an integer");
  m = error_of({{"RANK", "0"}, {"WORLD_SIZE", "2x"}, {"MASTER_ADDR", "127.0.0.1"}});
  EXPECT_HAS(m, "WORLD_SIZE='2x' is not an integer");
  m = error_of({{"OMPI_COMM_WORLD_RANK", "0"},
                {"OMPI_COMM_WORLD_SIZE", "2"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "-"},
                {"MASTER_ADDR", "h"}});
  EXPECT_HAS(m, "OMPI_COMM_WORLD_LOCAL_RANK='-' is not an integer");
  m = error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "http"}});
  EXPECT_HAS(m, "MASTER_PORT='http' is not an integer");
}

TEST(RendezvousEnvTest, OutOfRangeValuesAreRejected) {
  EXPECT_HAS(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), "WORLD_SIZE=0 is out of range");
  EXPECT_HAS(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}),
             "RANK=-1 is out of range");
  EXPECT_HAS(
      error_of(
          {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}),
      "MASTER_PORT=70000 is out of range 1..65535");
}

TEST(RendezvousEnvTest, HalfSetLauncherIsRejected) {
  EXPECT_HAS(error_of({{"RANK", "0"}}), "WORLD_SIZE is not set");
  EXPECT_HAS(error_of({{"SLURM_NTASKS", "2"}}), "SLURM_PROCID is not set");
}

TEST(RendezvousEnvTest, MissingMasterAddrForSeveralRanksIsRejected) {
  auto m = error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  EXPECT_HAS(m, "world size 2 (from torchrun) needs MASTER_ADDR");
  // One rank needs no master.
  EXPECT_EQ(parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}}).world_size, 1);
}

TEST(ResolveTimeoutTest, OptionThenEnvironmentThenDefault) {
  using std::chrono::milliseconds;
  ::unsetenv("FSDP_TIMEOUT_S");
  EXPECT_EQ(resolve_timeout(std::nullopt), milliseconds(300000));
  ::setenv("FSDP_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(resolve_timeout(std::nullopt), milliseconds(2500));
  EXPECT_EQ(resolve_timeout(milliseconds(700)), milliseconds(700));
  ::setenv("FSDP_TIMEOUT_S", "soon", 1);
  try {
    resolve_timeout(std::nullopt);
    ADD_FAILURE() << "FSDP_TIMEOUT_S=soon accepted";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), "FSDP_TIMEOUT_S='soon' is not a positive number of seconds");
  }
  ::unsetenv("FSDP_TIMEOUT_S");
}

}  // namespace
}  // namespace fsdp
