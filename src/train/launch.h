// Process plumbing of fsdp-train: starting its own local ranks through fsdp-run, the default run
// directory, the thread count per rank, and a clean stop on SIGINT/SIGTERM. Free of torch headers.
// Thread-safety: call from the main thread; stop_requested() is async-signal-safe to poll anywhere.
#pragma once

#include <string>
#include <vector>

namespace fsdp::train {

// The binary of this process (/proc/self/exe).
std::string self_exe_path();

// Replaces this process with `fsdp-run -n nproc -- <this binary> args...` (fsdp-run found next to
// this binary). Sets FSDP_TRAIN_TTY=1 when stdout is a terminal (see progress.h). Throws
// fsdp::Error naming the path when fsdp-run is missing or cannot be executed.
[[noreturn]] void exec_local_ranks(int nproc, const std::vector<std::string>& args);

// "runs/<YYYYmmdd-HHMMSS>" (local time), with "-2", "-3", ... appended when it already exists.
std::string default_run_dir();

// Ranks on this machine: LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE or SLURM_NTASKS_PER_NODE,
// else world_size.
int local_ranks(int world_size);

// Intra-op threads per rank: `requested` when positive, else max(1, cores / local ranks), with the
// local rank count from LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE or SLURM_NTASKS_PER_NODE.
int threads_per_rank(int requested, int world_size);

// First SIGINT/SIGTERM/SIGHUP: sets a flag that the training loop polls (all ranks agree on it
// through the per-step all-reduce, then stop after the same step). A second one: default action.
void install_stop_handlers();
bool stop_requested();
int stop_signal();  // the first signal received, 0 if none

}  // namespace fsdp::train
