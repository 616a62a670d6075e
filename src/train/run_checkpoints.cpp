#include "train/run_checkpoints.h"

#include <fsdp/checkpoint.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "train/resume.h"

namespace fsdp::train {

RunCheckpoints::RunCheckpoints(const TrainConfig& cfg, const LrSchedule& schedule, int rank)
    : cfg_(cfg), schedule_(schedule), rank_(rank) {
  if (!cfg.async_save) return;
  saver_ = std::make_unique<checkpoint::AsyncSaver>();
  if (rank == 0 && cfg.keep_last > 0) {
    const std::string run_dir = cfg.run_dir;
    const int64_t keep = cfg.keep_last;
    saver_->set_on_commit(
        [run_dir, keep](const std::string&) { remove_old_checkpoints(run_dir, keep); });
  }
}

void RunCheckpoints::save(int64_t steps_taken, const FSDPModule& root, torch::optim::Optimizer* opt,
                          Communicator& shard_group) {
  checkpoint::TrainState state;
  state.step = steps_taken;
  state.data_position = steps_taken;
  state.extra = checkpoint_extra(cfg_, schedule_);
  ++saves_;
  if (saver_) {
    saver_->save_async(cfg_.run_dir, root, opt, state);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  checkpoint::save(cfg_.run_dir, root, opt, state, shard_group);
  if (rank_ == 0) remove_old_checkpoints(cfg_.run_dir, cfg_.keep_last);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  sync_s_ += s;
  sync_max_s_ = std::max(sync_max_s_, s);
}

void RunCheckpoints::finish() {
  if (saver_) saver_->wait();
}

std::string RunCheckpoints::summary_line() const {
  if (saves_ == 0) return {};
  char buf[400];
  if (!saver_) {
    std::snprintf(buf, sizeof buf,
                  "  checkpoints   %lld saved, each holding the step %.0f ms on average (at most "
                  "%.0f ms; rank 0)\n",
                  static_cast<long long>(saves_), 1e3 * sync_s_ / saves_, 1e3 * sync_max_s_);
    return buf;
  }
  const auto& s = saver_->stats();
  std::snprintf(
      buf, sizeof buf,
      "  checkpoints   %lld saved asynchronously (rank 0): the step held %.1f ms per save "
      "on average (%.1f ms waiting for the previous save), written in the background in "
      "%.0f ms on average; %.0f MiB of staging\n",
      static_cast<long long>(s.saves), 1e3 * s.blocked_s / std::max<int64_t>(1, s.saves),
      1e3 * s.waited_s / std::max<int64_t>(1, s.saves),
      1e3 * s.write_s / std::max<int64_t>(1, s.committed),
      static_cast<double>(s.staging_bytes) / (1 << 20));
  return buf;
}

}  // namespace fsdp::train
