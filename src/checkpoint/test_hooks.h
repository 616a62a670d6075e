// Test-only seams of the checkpoint code; not part of the public API (include/fsdp/).
// Thread-safety: set from the thread that saves, before the save.
#pragma once

#include <optional>

namespace fsdp::checkpoint::test_hooks {

// Simulates a crash between files: the next save() in this process lets ranks 0..n-1 write their
// files, then throws fsdp::Error before the index is written. Every rank must set it (each rank
// decides from its own setting), as Checkpoint.InterruptedSaveLeavesPreviousLoadable does.
void fail_next_save_after_files(int n);

// save()'s side: the setting, cleared as it is read; nullopt when none was set.
std::optional<int> take_fail_after_files();

}  // namespace fsdp::checkpoint::test_hooks
