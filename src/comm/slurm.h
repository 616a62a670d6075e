// Slurm's side of the rendezvous: for ranks started by srun (SLURM_PROCID/SLURM_NTASKS), the
// rendezvous address and port that every rank of the step computes alike when MASTER_ADDR and
// MASTER_PORT are not set, and the parser of Slurm's compressed host lists behind the address.
// Internal to src/comm; parse_rendezvous_env (rendezvous.cpp) is its one caller.
// Thread-safety: pure functions of their arguments and of the lookup they are given.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

// An environment lookup that returns nullptr for unset and for empty variables.
using EnvLookup = std::function<const char*(const char*)>;

// The rendezvous host and port derived from Slurm's variables, with the variables they came from
// (for messages).
struct SlurmHost {
  std::string host;
  std::string from;
};
struct SlurmPort {
  int port = 0;
  std::string from;
};

// The most hosts a host list may expand to: beyond any cluster, few enough to expand in memory.
constexpr size_t kMaxSlurmHosts = size_t{1} << 20;

// The hosts of a Slurm host list, in order: "node[01-03,07],gpu-a[1-2]" is node01 node02 node03
// node07 gpu-a1 gpu-a2. A range keeps the width of its low end ("[08-10]": 08 09 10; "[8-10]": 8 9
// 10). Several bracket groups in one name expand leftmost-slowest ("r[1-2]n[1-2]": r1n1 r1n2 r2n1
// r2n2). Names use letters, digits, '.', '-' and '_'. Throws fsdp::Error naming `variable`, the
// value, what is wrong at which character, and the fix (set MASTER_ADDR) for a malformed list or
// one of more than kMaxSlurmHosts hosts.
std::vector<std::string> expand_slurm_hostlist(const std::string& list,
                                               const std::string& variable);

// The port range of slurm_port: 20480..28671, far from the well-known ports (0..1023), below
// torchrun's default 29500 (and the 295xx ports people pick by hand) and below Linux's ephemeral
// ports (32768..60999), which outgoing connections take.
constexpr int kSlurmPortBase = 20480;
constexpr int kSlurmPortCount = 8192;
// Steps of one job that get ports of their own (srun ... & srun ... & in one allocation).
constexpr int kSlurmStepsPerJob = 16;

// MASTER_PORT for step `step_id` of job `job_id`:
//   kSlurmPortBase + (kSlurmStepsPerJob * job_id + step_id) mod kSlurmPortCount
// Consecutive jobs get ports 16 apart and the first 16 steps of a job get consecutive ports, so
// two jobs (or two steps) sharing a node collide only when their ids differ by a multiple of 512
// jobs (8192 job-and-step slots).
int slurm_port(uint64_t job_id, uint64_t step_id);

// The rank-0 host of an srun step: the first host of SLURM_STEP_NODELIST (the step's nodes; srun's
// block and cyclic distributions put task 0 on the first), else of SLURM_JOB_NODELIST, else of
// SLURM_NODELIST. Throws fsdp::Error when none is set or the list is malformed, naming the
// variable and the fix (set MASTER_ADDR).
SlurmHost slurm_master_addr(const EnvLookup& env);

// slurm_port of SLURM_JOB_ID and SLURM_STEP_ID (0 when unset); nullopt without SLURM_JOB_ID.
// Throws fsdp::Error naming the variable when either is not a non-negative integer.
std::optional<SlurmPort> slurm_master_port(const EnvLookup& env);

// Whether this process is a task started by srun: SLURM_PROCID and SLURM_STEP_ID are set (srun
// sets both for every task). Throws fsdp::Error when it is not but the allocation has several
// tasks (SLURM_NTASKS > 1): in a salloc shell (no SLURM_PROCID) or a batch script (sbatch sets
// SLURM_PROCID=0 there, but no SLURM_STEP_ID) rank 0 would wait for ranks nobody starts. A process
// of a one-task allocation that is not a task is not launched by Slurm (a single rank).
bool is_slurm_task(const EnvLookup& env);

}  // namespace fsdp::detail
