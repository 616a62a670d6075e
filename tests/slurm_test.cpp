// Slurm's side of the rendezvous (src/comm/slurm.h): the host-list parser, the port formula, and
// parse_rendezvous_env for ranks started by srun without MASTER_ADDR/MASTER_PORT; each malformed
// input by its message. Single process; the environment is a map passed as the lookup function.
// The same under a real srun and sbatch: tests/slurm_cluster_test.cpp.
#include "comm/slurm.h"

#include <fsdp/error.h>
#include <fsdp/init.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace fsdp::detail {
namespace {

using Env = std::map<std::string, std::string>;
using Hosts = std::vector<std::string>;

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

Hosts expand(const std::string& list) { return expand_slurm_hostlist(list, "SLURM_JOB_NODELIST"); }

// The message of expand(list), or "" when it succeeds.
std::string hostlist_error(const std::string& list) {
  try {
    expand(list);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

RendezvousInfo parse(const Env& env) {
  return parse_rendezvous_env([&env](const char* k) -> const char* {
    auto it = env.find(k);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

std::string parse_error(const Env& env) {
  try {
    parse(env);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Rank `rank` of a 4-task srun step of job 4242 on node[07-08]: what srun sets, and nothing else.
Env srun_task(int rank) {
  return {{"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_NTASKS", "4"},
          {"SLURM_LOCALID", std::to_string(rank % 2)},
          {"SLURM_JOB_ID", "4242"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_STEP_NODELIST", "node[07-08]"},
          {"SLURM_JOB_NODELIST", "node[07-08]"},
          {"SLURM_NODELIST", "node[07-08]"}};
}

TEST(SlurmHostlistTest, PlainNamesAndLists) {
  EXPECT_EQ(expand("localhost"), Hosts{"localhost"});
  EXPECT_EQ(expand("n1,n2.cluster,gpu_3-ib"), (Hosts{"n1", "n2.cluster", "gpu_3-ib"}));
}

TEST(SlurmHostlistTest, RangesKeepTheLowEndsZeroPadding) {
  EXPECT_EQ(expand("node[01-03,07]"), (Hosts{"node01", "node02", "node03", "node07"}));
  EXPECT_EQ(expand("n[8-10]"), (Hosts{"n8", "n9", "n10"}));
  EXPECT_EQ(expand("n[08-10]"), (Hosts{"n08", "n09", "n10"}));
  EXPECT_EQ(expand("n[098-101]"), (Hosts{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand("n[0]"), Hosts{"n0"});
  EXPECT_EQ(expand("n[5,001]"), (Hosts{"n5", "n001"}));
}

TEST(SlurmHostlistTest, SeveralBracketGroups) {
  EXPECT_EQ(expand("node[01-03,07],gpu-a[1-2]"),
            (Hosts{"node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"}));
  // In one name: the product, leftmost group slowest; text between and after groups is kept.
  EXPECT_EQ(expand("r[1-2]n[08-09].ib"), (Hosts{"r1n08.ib", "r1n09.ib", "r2n08.ib", "r2n09.ib"}));
  EXPECT_EQ(expand("a,b[1-2],c"), (Hosts{"a", "b1", "b2", "c"}));
}

TEST(SlurmHostlistTest, MalformedListsNameTheVariableTheValueAndTheFix) {
  const auto m = hostlist_error("node[01-03");
  EXPECT_HAS(m,
             "SLURM_JOB_NODELIST='node[01-03' is not a valid Slurm host list: '[' without ']' "
             "at character 5");
  EXPECT_HAS(m, "set MASTER_ADDR to the host of rank 0");
  EXPECT_HAS(hostlist_error(""), "it is empty");
  EXPECT_HAS(hostlist_error("node01]"), "']' without '[' at character 7");
  EXPECT_HAS(hostlist_error("node[]"), "expected a number at character 6");
  EXPECT_HAS(hostlist_error("node[a-b]"), "expected a number at character 6");
  EXPECT_HAS(hostlist_error("node[1-]"), "expected the number that ends the range at character 8");
  EXPECT_HAS(hostlist_error("node[3-1]"), "range 3-1 runs backwards at character 6");
  EXPECT_HAS(hostlist_error("node[-1]"), "expected a number at character 6");
  EXPECT_HAS(hostlist_error("node[1-2:2]"), "unexpected ':' in brackets at character 9");
  EXPECT_HAS(hostlist_error("node[1[2]]"), "unexpected '[' in brackets at character 7");
  EXPECT_HAS(hostlist_error("a,,b"), "empty host name at character 3");
  EXPECT_HAS(hostlist_error("a,"), "empty host name at the end");
  EXPECT_HAS(hostlist_error("node 1"), "unexpected ' ' (names use letters");
  EXPECT_HAS(hostlist_error("n[1-99999999999999999999]"), "is too large");
  EXPECT_HAS(hostlist_error("n[0-2000000]"), "range 0-2000000 is too long");
  EXPECT_HAS(hostlist_error("n[0-1023]m[0-1023]x[0-1]"), "names more than 1048576 hosts");
}

TEST(SlurmPortTest, FormulaAndRange) {
  EXPECT_EQ(slurm_port(0, 0), 20480);
  EXPECT_EQ(slurm_port(1, 0), 20496);  // consecutive jobs 16 apart
  EXPECT_EQ(slurm_port(1, 1), 20497);  // a job's steps consecutive
  EXPECT_EQ(slurm_port(4242, 0), 20480 + (16 * 4242) % 8192);
  EXPECT_EQ(slurm_port(512, 0), 20480);  // the period: 512 jobs
  // Slurm's special step ids (batch 0xfffffffe, extern 0xffffffff) and large job ids stay in
  // range.
  std::set<int> seen;
  for (uint64_t job :
       {uint64_t{0}, uint64_t{7}, uint64_t{123456789}, uint64_t{1} << 40, ~uint64_t{0}}) {
    for (uint64_t step : {uint64_t{0}, uint64_t{15}, uint64_t{0xfffffffe}, uint64_t{0xffffffff}}) {
      const int p = slurm_port(job, step);
      EXPECT_GE(p, 20480);
      EXPECT_LE(p, 28671);
      seen.insert(p);
    }
  }
  EXPECT_GT(seen.size(), 10u);
  // 512 consecutive jobs, 16 steps each: all distinct.
  seen.clear();
  for (uint64_t job = 1000; job < 1512; ++job)
    for (uint64_t step = 0; step < 16; ++step) seen.insert(slurm_port(job, step));
  EXPECT_EQ(seen.size(), 8192u);
}

TEST(SlurmRendezvousTest, EveryRankDerivesTheSameAddressAndPort) {
  for (int rank = 0; rank < 4; ++rank) {
    const auto i = parse(srun_task(rank));
    EXPECT_EQ(i.source, "slurm");
    EXPECT_EQ(i.rank, rank);
    EXPECT_EQ(i.world_size, 4);
    EXPECT_EQ(i.master_addr, "node07");
    EXPECT_EQ(i.master_addr_from, "SLURM_STEP_NODELIST");
    EXPECT_EQ(i.master_port, slurm_port(4242, 0));
    EXPECT_EQ(i.master_port_from, "SLURM_JOB_ID and SLURM_STEP_ID");
  }
  auto env = srun_task(1);
  env["SLURM_STEP_ID"] = "3";  // another step of the same job: another port
  EXPECT_EQ(parse(env).master_port, slurm_port(4242, 3));
}

TEST(SlurmRendezvousTest, StepNodesThenJobNodesThenNodelist) {
  auto env = srun_task(0);
  env["SLURM_STEP_NODELIST"] = "gpu[3-4]";  // a step on part of the allocation
  env["SLURM_JOB_NODELIST"] = "cpu1,gpu[3-4]";
  EXPECT_EQ(parse(env).master_addr, "gpu3");
  env.erase("SLURM_STEP_NODELIST");
  EXPECT_EQ(parse(env).master_addr, "cpu1");
  EXPECT_EQ(parse(env).master_addr_from, "SLURM_JOB_NODELIST");
  env.erase("SLURM_JOB_NODELIST");
  env["SLURM_NODELIST"] = "old[5-6]";
  EXPECT_EQ(parse(env).master_addr, "old5");
  EXPECT_EQ(parse(env).master_addr_from, "SLURM_NODELIST");
}

TEST(SlurmRendezvousTest, ExplicitMasterAddrAndPortWin) {
  auto env = srun_task(2);
  env["MASTER_ADDR"] = "10.1.2.3";
  env["MASTER_PORT"] = "29600";
  env["SLURM_STEP_NODELIST"] = "broken[";  // not even read
  const auto i = parse(env);
  EXPECT_EQ(i.master_addr, "10.1.2.3");
  EXPECT_EQ(i.master_addr_from, "MASTER_ADDR");
  EXPECT_EQ(i.master_port, 29600);
  EXPECT_EQ(i.master_port_from, "MASTER_PORT");
  env.erase("MASTER_PORT");  // each is taken on its own
  EXPECT_EQ(parse(env).master_port, slurm_port(4242, 0));
}

TEST(SlurmRendezvousTest, OnlyForSeveralRanksStartedBySrun) {
  // One task: nothing to find, so a broken list is not an error.
  auto one = srun_task(0);
  one["SLURM_NTASKS"] = "1";
  one["SLURM_STEP_NODELIST"] = "broken[";
  EXPECT_EQ(parse(one).master_port, 29500);
  EXPECT_EQ(parse(one).master_addr_from, "default");
  // mpirun inside an allocation: Open MPI's ranks, so Slurm's node list does not name rank 0.
  auto mpi = srun_task(0);
  mpi.erase("SLURM_PROCID");
  mpi.erase("SLURM_NTASKS");
  mpi["OMPI_COMM_WORLD_RANK"] = "0";
  mpi["OMPI_COMM_WORLD_SIZE"] = "2";
  EXPECT_HAS(parse_error(mpi), "world size 2 (from openmpi) needs MASTER_ADDR");
}

TEST(SlurmRendezvousTest, BadVariablesAreNamedWithTheFix) {
  auto env = srun_task(0);
  env["SLURM_STEP_NODELIST"] = "node[01-03";
  auto m = parse_error(env);
  EXPECT_HAS(m, "SLURM_STEP_NODELIST='node[01-03' is not a valid Slurm host list");
  EXPECT_HAS(m, "set MASTER_ADDR");
  env = srun_task(0);
  for (const char* k : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})
    env.erase(k);
  m = parse_error(env);
  EXPECT_HAS(m, "none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set");
  EXPECT_HAS(m, "set MASTER_ADDR");
  env = srun_task(0);
  env["SLURM_JOB_ID"] = "12x";
  m = parse_error(env);
  EXPECT_HAS(m, "SLURM_JOB_ID='12x' is not a Slurm id");
  EXPECT_HAS(m, "set MASTER_PORT");
  env = srun_task(0);
  env["SLURM_STEP_ID"] = "-1";
  EXPECT_HAS(parse_error(env), "SLURM_STEP_ID='-1' is not a Slurm id");
  // No job id (not from a real srun): the default port, as for any launcher.
  env = srun_task(0);
  env.erase("SLURM_JOB_ID");
  EXPECT_EQ(parse(env).master_port, 29500);
}

TEST(SlurmRendezvousTest, AllocationEnvironmentIsNotATask) {
  // sbatch -n 2 sets SLURM_PROCID=0 and SLURM_NTASKS=2 in the script itself, without a step id:
  // rank 0 would wait for a rank 1 that nobody starts.
  auto env = srun_task(0);
  env["SLURM_NTASKS"] = "2";
  env.erase("SLURM_STEP_ID");
  env.erase("SLURM_STEP_NODELIST");
  auto m = parse_error(env);
  EXPECT_HAS(m, "SLURM_NTASKS=2 but SLURM_STEP_ID is not set");
  EXPECT_HAS(m, "Start one process per task with srun");
  // A salloc -n 2 shell: SLURM_NTASKS without SLURM_PROCID.
  env.erase("SLURM_PROCID");
  m = parse_error(env);
  EXPECT_HAS(m, "SLURM_NTASKS=2 but SLURM_PROCID is not set: this process runs in the allocation");
  EXPECT_HAS(m, "Start one process per task with srun");
  // One-task allocations (sbatch -n 1, salloc -n 1): not a launch, a single rank.
  env["SLURM_NTASKS"] = "1";
  EXPECT_EQ(parse(env).source, "none");
  env["SLURM_PROCID"] = "0";
  EXPECT_EQ(parse(env).source, "none");
  EXPECT_EQ(parse(env).world_size, 1);
}

// The process's own environment for one test: `vars` set, the launcher variables unset, all
// restored afterwards.
class ScopedEnv {
 public:
  explicit ScopedEnv(const Env& vars) {
    for (const char* k : {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                          "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "FSDP_TIMEOUT_S"})
      save(k), ::unsetenv(k);
    for (const auto& [k, v] : vars) save(k), ::setenv(k.c_str(), v.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved_)
      v ? ::setenv(k.c_str(), v->c_str(), 1) : ::unsetenv(k.c_str());
  }

 private:
  void save(const std::string& k) {
    if (saved_.count(k)) return;
    const char* v = std::getenv(k.c_str());
    saved_[k] = v ? std::optional<std::string>(v) : std::nullopt;
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

TEST(SlurmRendezvousTest, FailureMessageSaysTheAddressAndPortWereDerived) {
  // Rank 0 of 2 alone: it serves the store at the derived port and gives up waiting for rank 1.
  auto env = srun_task(0);
  env["SLURM_NTASKS"] = "2";
  env["SLURM_STEP_NODELIST"] = "localhost";
  ScopedEnv scoped(env);
  InitOptions options;
  options.timeout = std::chrono::milliseconds(1000);
  try {
    init_process_group(options);
    ADD_FAILURE() << "rendezvous succeeded without rank 1";
  } catch (const CommError& e) {
    const std::string m = e.what();
    EXPECT_HAS(m, "rank 0 of 2 at localhost:" + std::to_string(slurm_port(4242, 0)));
    EXPECT_HAS(m, "MASTER_ADDR was not set: localhost is the first host of SLURM_STEP_NODELIST.");
    EXPECT_HAS(m, "MASTER_PORT was not set: " + std::to_string(slurm_port(4242, 0)) +
                      " is derived from SLURM_JOB_ID and SLURM_STEP_ID.");
  }
}

}  // namespace
}  // namespace fsdp::detail
