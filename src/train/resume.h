// Where a run continues from, and which checkpoints it keeps: fsdp-train's side of checkpoints.
//
// find_resume_point() picks the checkpoint that `--resume` names (docs/trainer.md, "Resuming"):
//  - RUN_DIR/step_K: exactly that checkpoint; a damaged one is an error, never a fallback;
//  - RUN_DIR: its newest complete checkpoint; every newer step directory that is incomplete or
//    damaged is reported (name and reason) in `skipped` before the fallback is used;
//  - "auto": like RUN_DIR = --run-dir when that holds step directories, and each candidate's
//    files are also read whole against their checksums, so that a checkpoint damaged inside is
//    skipped (reported in `skipped`) for the previous complete one; nothing (start afresh) when
//    it holds no step directories.
// A checkpoint is complete when its index.json parses and every rank file it lists exists with the
// recorded size (checksums are verified by the load itself). Reads only; writes nothing.
// remove_old_checkpoints() implements --keep-last. Torch-free.
// Thread-safety: reentrant; the file system is shared, so call from one rank (rank 0) at a time.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "train/config.h"
#include "train/schedule.h"

namespace fsdp::train {

struct ResumePoint {
  std::string checkpoint;            // the step directory to load
  int64_t step = 0;                  // optimizer steps it holds
  std::vector<std::string> skipped;  // "DIR/step_K is damaged (reason)", newest first
  nlohmann::json settings;           // the run's settings (TrainConfig::to_json keys)
  nlohmann::json schedule;           // the schedule state (lr-restart-*), or null
  std::string hf_config;             // a Llama's transformers config.json, or empty
};

// Throws fsdp::Error naming the directory and what is wrong with it.
void check_checkpoint(const std::string& step_dir);

// Step directories (step_<digits>) under run_dir, newest first; empty when run_dir is absent.
std::vector<std::string> step_dirs(const std::string& run_dir);

// nullopt: --resume auto and run_dir has no step directories (a fresh start). Throws fsdp::Error
// naming the directory and every skipped checkpoint when there is nothing to resume from.
std::optional<ResumePoint> find_resume_point(const std::string& resume, const std::string& run_dir);

// A failed load's message (`what`, an fsdp::Error's) with, unless --resume is "auto", how to fall
// back to the previous complete checkpoint instead.
std::string with_fallback_hint(const std::string& what, const std::string& resume,
                               const std::string& run_dir);

// The run directory of a --resume value (RUN_DIR or RUN_DIR/step_K); run_dir for "auto".
std::string resume_run_dir(const std::string& resume, const std::string& run_dir);

// Removes the step directories of run_dir older than its `keep` newest complete checkpoints (also
// incomplete or damaged ones among them). Returns the removed directories. keep = 0: none.
std::vector<std::string> remove_old_checkpoints(const std::string& run_dir, int64_t keep);

// What a run does before training: its resolved settings, the checkpoint it continues from (none
// for a fresh start) and its learning-rate schedule.
struct RunPlan {
  TrainConfig cfg;
  std::optional<ResumePoint> from;
  LrSchedule schedule;
};

// Without --resume (or --resume auto with nothing to resume): the given settings. With one: the
// checkpoint's settings, overridden by the keys given explicitly that resumable_keys() allows;
// another explicit value for any other key is an error naming every such key, the checkpoint
// and the fix. A changed --steps or --min-lr-ratio continues the schedule (LrSchedule::extended).
// Reads only. Throws fsdp::Error.
RunPlan plan_run(const TrainConfig& given);

// The checkpoint's "extra" object that plan_run reads back: the settings and the schedule state.
nlohmann::json checkpoint_extra(const TrainConfig& cfg, const LrSchedule& schedule);

}  // namespace fsdp::train
