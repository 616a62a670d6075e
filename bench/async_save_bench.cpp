#include "async_save_bench.h"

#include <fsdp/checkpoint.h>
#include <fsdp/checkpoint_async.h>
#include <fsdp/fsdp.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "comm/rank_agreement.h"
#include "stats.h"
#include "train/model_setup.h"

// A namespace of its own: fsdp-bench compiles its sources in unity batches.
namespace fsdp::bench::async_save {
namespace {

using Clock = std::chrono::steady_clock;
namespace ck = fsdp::checkpoint;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// fsdp-train's model and AdamW at the bench's sizes, and one timed training step on synthetic
// next-token batches (a function of the seed, the step and the rank).
class Job {
 public:
  Job(const TrainBenchOptions& o, const std::shared_ptr<Communicator>& comm) : o_(o), comm_(comm) {
    train::TrainConfig tc;
    tc.layers = o.layers, tc.heads = o.heads, tc.width = o.width, tc.seq = o.seq;
    tc.lr = o.lr, tc.seed = o.seed;
    model_ = train::build_model(tc, comm);
    opt_ = train::build_optimizer(tc, *model_);
  }
  // One step; returns its time in seconds.
  double step() {
    const auto t0 = Clock::now();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o_.seed * 1000003ULL + step_ * 4099ULL +
                                                        static_cast<uint64_t>(comm_->rank()));
    auto tokens = at::randint(0, 256, {o_.batch, o_.seq + 1}, gen, at::kLong);
    auto x = tokens.narrow(1, 0, o_.seq).contiguous(), y = tokens.narrow(1, 1, o_.seq).contiguous();
    auto logits = model_->gpt(x);
    torch::nn::functional::cross_entropy(logits.view({-1, 256}), y.reshape({-1})).backward();
    opt_->step();
    for (auto& g : opt_->param_groups())
      for (auto& p : g.params()) p.mutable_grad() = at::Tensor();
    ++step_;
    return seconds_since(t0);
  }
  ck::TrainState state() const {
    ck::TrainState s;
    s.step = static_cast<int64_t>(step_);
    s.data_position = s.step;
    return s;
  }
  const FSDPModule& root() const { return model_->root; }
  torch::optim::Optimizer* opt() const { return opt_.get(); }
  Communicator& shard_group() const { return model_->shard_group(); }
  int64_t params() const { return model_->parameter_count; }

 private:
  const TrainBenchOptions& o_;
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<train::TrainModel> model_;
  std::unique_ptr<torch::optim::AdamW> opt_;
  uint64_t step_ = 0;
};

struct Round {
  std::vector<double> base_s;        // steps with no save near them
  std::vector<double> sync_after_s;  // the steps right after the synchronous save
  double sync_s = 0;                 // checkpoint::save
  double blocked_s = 0;              // save_async
  std::vector<double> overlap_s;     // steps that began while the background write ran
  std::vector<double> after_s;       // steps after save_async whose start found the write done
  double write_s = 0;                // the background write
  double next_wait_s = 0;            // a second save_async right after one: its wait
};

// The largest of every rank's `v` (one all-reduce).
double max_over_ranks(Communicator& c, double v) {
  auto all = at::zeros({c.size()}, at::kDouble);
  all[c.rank()] = v;
  c.all_reduce(all, ReduceOp::kSum).wait();
  return all.max().item<double>();
}

// The previous round's synchronous save: how many steps the next round's saves need.
double last_sync_s_ = 0.5;

Round run_round(Job& job, ck::AsyncSaver& saver, Communicator& world, const std::string& dir,
                int base_steps) {
  Round r;
  for (int i = 0; i < base_steps; ++i) r.base_s.push_back(job.step());
  // Enough steps after each save to cover the write (it takes about a synchronous save, more at
  // low priority), agreed over ranks so that all take the same number of steps; from the previous
  // round's synchronous save (the first round: a save's worth of steps as a guess).
  const double step = median(r.base_s);
  const int after = static_cast<int>(
      max_over_ranks(world, std::min(60.0, std::ceil(3 * last_sync_s_ / step) + 2)));
  world.barrier().wait();
  auto t0 = Clock::now();
  ck::save(dir + "/sync", job.root(), job.opt(), job.state(), job.shard_group());
  r.sync_s = seconds_since(t0);
  last_sync_s_ = r.sync_s;
  for (int i = 0; i < after; ++i) r.sync_after_s.push_back(job.step());
  world.barrier().wait();
  saver.save_async(dir + "/async", job.root(), job.opt(), job.state());
  r.blocked_s = saver.stats().last_blocked_s;
  for (int i = 0; i < after; ++i) {
    const bool running = !saver.done();
    (running ? r.overlap_s : r.after_s).push_back(job.step());
  }
  saver.wait();
  r.write_s = saver.stats().last_write_s;
  // Back to back: the second save waits for the first.
  saver.save_async(dir + "/async", job.root(), job.opt(), job.state());
  job.step();
  saver.save_async(dir + "/async2", job.root(), job.opt(), job.state());
  r.next_wait_s = saver.stats().last_waited_s;
  saver.wait();
  return r;
}

nlohmann::ordered_json round_json(const Round& r, int index) {
  nlohmann::ordered_json j;
  j["round"] = index;
  j["step_ms"] = round_to(1e3 * median(r.base_s), 100);
  j["after_sync_step_ms"] = round_to(1e3 * median(r.sync_after_s), 100);
  j["sync_save_ms"] = round_to(1e3 * r.sync_s, 100);
  j["async_blocking_ms"] = round_to(1e3 * r.blocked_s, 100);
  j["write_ms"] = round_to(1e3 * r.write_s, 100);
  j["overlap_steps"] = r.overlap_s.size();
  j["overlap_step_ms"] = round_to(1e3 * median(r.overlap_s), 100);
  j["next_save_wait_ms"] = round_to(1e3 * r.next_wait_s, 100);
  return j;
}

nlohmann::ordered_json summary_json(const std::vector<Round>& rounds,
                                    const AsyncSaveBenchOptions& o, int world, int64_t params,
                                    uint64_t staging_bytes) {
  std::vector<double> base, sync, blocked, overlap, write, wait, ratios, base_ratios;
  for (const auto& r : rounds) {
    base.insert(base.end(), r.base_s.begin(), r.base_s.end());
    overlap.insert(overlap.end(), r.overlap_s.begin(), r.overlap_s.end());
    sync.push_back(r.sync_s);
    blocked.push_back(r.blocked_s);
    write.push_back(r.write_s);
    wait.push_back(r.next_wait_s);
    // Paired within the round (the machine's load drifts between rounds more than within one),
    // against the same steps after the synchronous save: the first steps after either save share
    // what a save leaves behind (caches that held the checkpoint's bytes).
    if (!r.overlap_s.empty()) {
      const std::vector<double> same(
          r.sync_after_s.begin(),
          r.sync_after_s.begin() +
              static_cast<std::ptrdiff_t>(std::min(r.overlap_s.size(), r.sync_after_s.size())));
      ratios.push_back(median(r.overlap_s) / median(same));
      base_ratios.push_back(median(r.overlap_s) / median(r.base_s));
    }
  }
  const double step = median(base), blocking = median(blocked), sync_s = median(sync);
  const double slowdown = ratios.empty() ? 0.0 : median(ratios) - 1;
  nlohmann::ordered_json s;
  s["preset"] = o.train.preset;
  s["world"] = world;
  s["params"] = params;
  s["checkpoint_mb_per_rank"] = round_to(static_cast<double>(staging_bytes) / (1 << 20), 10);
  s["writer"] = o.low_priority ? "low priority" : "normal priority";
  s["rounds"] = rounds.size();
  s["step_ms"] = round_to(1e3 * step, 100);
  s["sync_save_ms"] = round_to(1e3 * sync_s, 100);
  s["async_blocking_ms"] = round_to(1e3 * blocking, 100);
  s["blocking_over_step"] = round_to(blocking / step, 1e3);
  s["blocking_over_sync"] = round_to(blocking / sync_s, 1e3);
  s["write_ms"] = round_to(1e3 * median(write), 100);
  s["overlap_steps"] = overlap.size();
  s["overlap_step_ms"] = round_to(1e3 * median(overlap), 100);
  s["overlap_slowdown"] = round_to(slowdown, 1e3);  // the median of the rounds' ratios, - 1
  if (!ratios.empty()) {
    s["overlap_slowdown_min"] = round_to(*std::min_element(ratios.begin(), ratios.end()) - 1, 1e3);
    s["overlap_slowdown_max"] = round_to(*std::max_element(ratios.begin(), ratios.end()) - 1, 1e3);
    // Against the steps far from any save instead.
    s["overlap_over_baseline"] = round_to(median(base_ratios) - 1, 1e3);
  }
  s["next_save_wait_ms"] = round_to(1e3 * median(wait), 100);
  s["targets_met"] = blocking <= step && blocking <= 0.1 * sync_s && slowdown <= 0.05;
  return s;
}

}  // namespace
}  // namespace fsdp::bench::async_save

namespace fsdp::bench {

int run_async_save_bench(const AsyncSaveBenchOptions& o) {
  using namespace async_save;
  FSDP_CHECK(o.rounds > 0 && o.train.steps > 0, "--async-save needs --rounds and --steps >= 1");
  at::set_num_threads(o.train.threads);
  auto world = init_process_group();
  std::string dir = o.save_dir;
  if (dir.empty())
    dir = (std::filesystem::temp_directory_path() /
           ("fsdp-bench-async-" + std::to_string(::getpid())))
              .string();
  dir = detail::broadcast_string(*world, dir);  // rank 0's
  Job job(o.train, world);
  for (int i = 0; i < o.train.warmup; ++i) job.step();
  ck::AsyncSaveOptions so;
  so.low_priority = o.low_priority;
  ck::AsyncSaver saver(so);
  std::vector<Round> rounds;
  for (int i = 0; i < o.rounds; ++i) {
    rounds.push_back(run_round(job, saver, *world, dir, o.train.steps));
    if (world->rank() == 0) std::cout << round_json(rounds.back(), i).dump() << std::endl;
    world->barrier().wait();  // every save of the round is complete: keep the newest of each
    if (world->rank() == 0)
      for (const char* sub : {"/sync", "/async", "/async2"}) ck::keep_last(dir + sub, 1);
  }
  world->barrier().wait();
  if (world->rank() != 0) return 0;
  const auto s = summary_json(rounds, o, world->size(), job.params(), saver.stats().staging_bytes);
  std::cout << s.dump() << std::endl;
  std::error_code ec;
  if (o.save_dir.empty()) std::filesystem::remove_all(dir, ec);
  return 0;
}

}  // namespace fsdp::bench
