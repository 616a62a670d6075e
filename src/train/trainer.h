// The training run of one rank of fsdp-train, in run order: set-up (threads, model, optimizer,
// data splits), resume (load the checkpoint, then open the run directory's outputs), the loop
// (step over --grad-accum micro-batches / evaluate / log / save), and finish (closing sample,
// plot, summary). docs/trainer.md specifies what it computes.
// Thread-safety: one call per process, from the main thread.
#pragma once

#include <memory>

#include "train/data.h"
#include "train/resume.h"

namespace fsdp {
class Communicator;
}

namespace fsdp::train {

// REQUIRES: plan from plan_run(); plan.cfg validated (validate_world(world size) too); corpus
// loaded with plan.cfg.seq and vocab; comm null exactly when plan.cfg.no_shard. Returns the
// process exit code: 0, or 128 + signal when stopped by SIGINT/SIGTERM (all ranks stop after the
// same step). Throws fsdp::Error.
int run_training(const RunPlan& plan, const Corpus& corpus,
                 const std::shared_ptr<Communicator>& comm);

}  // namespace fsdp::train
