// The launcher that started this rank, watched: under torchrun the elastic agent is the ranks'
// parent and serves their store; when it is killed (kill -9 of torchrun) nothing is left to
// restart the ranks or to stop them, and they trained on as orphans, without a word. The watch
// notices the parent's exit (this process is re-parented), says so on stderr, and stops the rank
// as a SIGTERM would (a program's own SIGTERM handler runs: fsdp-train stops after the step, on
// every rank); a rank still alive 30 s later exits.
// fsdp-run needs no watch: its ranks get SIGKILL when it dies (PR_SET_PDEATHSIG). Ranks started by
// hand are not watched: their parent is a shell, which may exit while they run (nohup).
// Internal to src/comm. Thread-safety: call from the thread that runs init_process_group.
#pragma once

#include <fsdp/init.h>

#include <string>

namespace fsdp::detail {

// Starts the watch once per process when `info` says an elastic agent started this rank (the
// TORCHELASTIC_RUN_ID variable torchrun sets); later calls do nothing.
void watch_launcher(const RendezvousInfo& info);

// The message a rank prints when its launcher (`launcher`, e.g. "torchrun's elastic agent (pid
// 41, python3)") has exited.
std::string launcher_gone_message(int rank, int64_t pid, const std::string& launcher);

}  // namespace fsdp::detail
