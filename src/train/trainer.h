// The training run of one rank of fsdp-train: builds the GPT (sharded with fully_shard, or plain
// for
// --no-shard), AdamW with the warmup+cosine schedule, runs the steps on this rank's slice of each
// global batch, and on rank 0 writes RUN_DIR/{config.json,metrics.csv,loss.svg}, shows progress and
// prints the closing summary with a generated sample. docs/trainer.md specifies what it computes.
// Thread-safety: one call per process, from the main thread.
#pragma once

#include <memory>

#include "train/config.h"
#include "train/data.h"

namespace fsdp {
class Communicator;
}

namespace fsdp::train {

// REQUIRES: cfg validated (cfg.validate(), cfg.validate_world(world size)); corpus loaded with
// cfg.seq; comm null exactly when cfg.no_shard. Returns the process exit code: 0, or 128 + signal
// when stopped by SIGINT/SIGTERM (all ranks stop after the same step). Throws fsdp::Error.
int run_training(TrainConfig cfg, const Corpus& corpus, const std::shared_ptr<Communicator>& comm);

}  // namespace fsdp::train
