// fsdp-train's checkpoints during a run (docs/trainer.md, section 11): the saves of --save-every,
// synchronous (checkpoint::save) or with --async-save in the background (checkpoint::AsyncSaver),
// --keep-last retention once a save has committed, and the figures the summary prints.
// Thread-safety: the thread that trains; save() is a collective, like the saves it runs.
#pragma once

#include <fsdp/checkpoint_async.h>

#include <cstdint>
#include <memory>
#include <string>

#include "train/config.h"
#include "train/schedule.h"

namespace fsdp::train {

class RunCheckpoints {
 public:
  RunCheckpoints(const TrainConfig& cfg, const LrSchedule& schedule, int rank);

  // Checkpoint after `steps_taken` steps (the data order is a function of the step, so the step is
  // also the data position). Synchronous: returns once committed, then retention runs (rank 0).
  // --async-save: returns once this rank's bytes are staged (after waiting for the previous save,
  // whose failure it raises); retention runs on rank 0's background thread after the commit, so
  // that it can never remove the previous checkpoint before the new one is complete.
  void save(int64_t steps_taken, const FSDPModule& root, torch::optim::Optimizer* opt,
            Communicator& shard_group);
  // Waits for the save in flight (--async-save) and raises its failure; call before the run ends.
  void finish();

  // "  checkpoints   ..." for the summary, "" when no save ran.
  std::string summary_line() const;

 private:
  const TrainConfig& cfg_;
  const LrSchedule& schedule_;
  const int rank_;
  std::unique_ptr<checkpoint::AsyncSaver> saver_;  // --async-save
  int64_t saves_ = 0;
  double sync_s_ = 0, sync_max_s_ = 0;  // synchronous saves: time the step was held
};

}  // namespace fsdp::train
