// Test-only seams of the checkpoint code; not part of the public API (include/fsdp/).
// Thread-safety: set from the thread that saves, before the save; save() and save_async() take
// them on that thread (take()), so a background write never reads them.
#pragma once

#include <chrono>
#include <optional>

namespace fsdp::checkpoint::test_hooks {

// Simulates a crash between files: the next save() in this process lets ranks 0..n-1 write their
// files, then throws fsdp::Error before the index is written. Every rank must set it (each rank
// decides from its own setting), as Checkpoint.InterruptedSaveLeavesPreviousLoadable does.
void fail_next_save_after_files(int n);

// Points of a save's commit (commit_files) at which kill_next_save_at() ends the process.
enum class SavePoint {
  kBeforeFiles,  // the step directory is prepared; no rank file written yet
  kFileInPlace,  // this rank's file is renamed into place; the other ranks' may not be
  kBeforeIndex,  // every rank file is in place; the index is not written (rank 0 decides)
  kAfterCommit,  // the index is in place: the checkpoint is complete
};
// The next save (save() or save_async()) in this process raises SIGKILL on itself at `point`, on
// whichever thread commits: a crash at that moment, for the crash tests. Set it on the ranks that
// are to die.
void kill_next_save_at(SavePoint point);

// The next save_async() in this process waits `delay` on its background thread before it writes,
// so that a test can change the model, or start another save, while the write is still to come.
void delay_next_async_write(std::chrono::milliseconds delay);

// The hooks of one save, taken (cleared) by the thread that starts it.
struct Taken {
  std::optional<int> fail_after_files;
  std::optional<SavePoint> kill_at;
  std::chrono::milliseconds delay{0};
};
Taken take();

}  // namespace fsdp::checkpoint::test_hooks
