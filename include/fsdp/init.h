// Rendezvous: turns launcher variables (torchrun, Open MPI, Slurm, fsdp-run) into a Communicator.
// Thread-safety: call from one thread; the returned Communicator follows communicator.h.
#pragma once

#include <fsdp/communicator.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace fsdp {

struct RendezvousInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Where master_addr and master_port came from: "MASTER_ADDR"/"MASTER_PORT", the Slurm variables
  // they were derived from for ranks started by srun (e.g. "SLURM_JOB_NODELIST", "SLURM_JOB_ID"),
  // or "default".
  std::string master_addr_from = "default";
  std::string master_port_from = "default";
  std::string source = "none";  // "torchrun", "openmpi", "slurm" or "none" (single rank)
  // torchrun's elastic agent already serves a TCPStore at MASTER_ADDR:MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True): every rank connects to it as a client, under the key
  // prefix "/worker/attempt_<restart_count>" like PyTorch's env:// rendezvous.
  bool agent_store = false;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT: the attempt of a --max_restarts job
  // TORCHELASTIC_RUN_ID is set: torchrun's elastic agent started this process (it is our parent)
  bool elastic_agent = false;
};

// Reads the rendezvous from an environment lookup (getenv by default). Throws fsdp::Error naming
// the variable for non-numbers, rank >= world size, a missing MASTER_ADDR when world size > 1, ...
// Ranks started by srun (world size > 1) need neither MASTER_ADDR nor MASTER_PORT: unset, they are
// the first host of the step's node list (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST, else
// SLURM_NODELIST) and 20480 + (16 * SLURM_JOB_ID + SLURM_STEP_ID) mod 8192; explicit values win.
RendezvousInfo parse_rendezvous_env(
    const std::function<const char*(const char*)>& getenv_fn = nullptr);

struct InitOptions {
  // Collective and rendezvous timeout; FSDP_TIMEOUT_S overrides the default when not set here.
  std::optional<std::chrono::milliseconds> timeout;
  std::string backend = "auto";  // "gloo", "nccl" (LibTorch with CUDA only), or "auto"
  // While the rendezvous waits, SIGINT/SIGTERM/SIGHUP end the process at once (the shell sees
  // 128 + signal, 130 for Ctrl-C) whatever handler the program installed; the program's handlers
  // are restored afterwards. false leaves the signals alone.
  bool exit_on_signal_during_rendezvous = true;
  // Under torchrun: when its elastic agent (this process's parent, which serves the store) exits,
  // say so on stderr and stop this rank as a SIGTERM would, instead of training on as an orphan
  // (exit after 30 s if it is still alive). false leaves the rank alone.
  bool stop_when_launcher_exits = true;
};

// Connects this process to its peers: a TCPStore at MASTER_ADDR:MASTER_PORT (served by rank 0, or
// under torchrun by its agent), then a process group. A single rank when no launcher variables are
// set.
// Process setup: SIGPIPE is ignored (unless the program set a handler), so that a write to a dead
// peer's socket fails with an error naming it instead of killing this rank silently.
// Network: each rank advertises the address of its interface named by FSDP_SOCKET_IFNAME (or
// GLOO_SOCKET_IFNAME), else of the interface that routes to MASTER_ADDR (127.0.0.1 when MASTER_ADDR
// is loopback), never the hostname's address (Debian maps it to 127.0.1.1).
std::shared_ptr<Communicator> init_process_group(const InitOptions& options = {});

// The timeout in effect: options, else FSDP_TIMEOUT_S, else 300 s.
std::chrono::milliseconds resolve_timeout(const std::optional<std::chrono::milliseconds>& t);

}  // namespace fsdp
