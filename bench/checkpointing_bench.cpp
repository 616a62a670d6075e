#include "checkpointing_bench.h"

#include <fsdp/fsdp.h>
#include <fsdp/memory.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include "stats.h"
#include "train/model_setup.h"

namespace fsdp::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Variant {
  double held_after_forward_mb = 0;  // largest over steps and ranks
  double step_peak_rss_mb = 0;       // above the RSS before the step; largest over ranks
  double step_s_median = 0;
  std::vector<double> losses;  // rank 0's
};

std::pair<at::Tensor, at::Tensor> batch_of(const TrainBenchOptions& o, int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(
      o.seed * 1000003ULL + static_cast<uint64_t>(step) * 4099ULL + static_cast<uint64_t>(rank));
  auto tokens = at::randint(0, 256, {o.batch, o.seq + 1}, gen, at::kLong);
  return {tokens.narrow(1, 0, o.seq).contiguous(), tokens.narrow(1, 1, o.seq).contiguous()};
}

double max_over_ranks(Communicator& comm, double v) {
  auto all = at::empty({comm.size()}, at::kDouble);
  comm.all_gather(all, at::full({1}, v, at::kDouble)).wait();
  return all.max().item<double>();
}

Variant run_variant(const TrainBenchOptions& o, Communicator& comm,
                    const std::shared_ptr<Communicator>& shared, bool checkpoint) {
  train::TrainConfig tc;
  tc.layers = o.layers, tc.heads = o.heads, tc.width = o.width, tc.seq = o.seq;
  tc.lr = o.lr, tc.seed = o.seed, tc.activation_checkpointing = checkpoint;
  auto m = train::build_model(tc, shared);
  auto opt = train::build_optimizer(tc, *m);
  Variant v;
  std::vector<double> times;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    auto [x, y] = batch_of(o, s, comm.rank());
    memory::trim();
    comm.barrier().wait();
    const double rss0 = memory::current_rss_mb();
    memory::reset_peak_rss();
    const double heap0 = memory::heap_in_use_mb();
    const auto t0 = Clock::now();
    auto loss = m->gpt(x, y);
    const double held = memory::heap_in_use_mb() - heap0;
    loss.backward();
    opt->step();
    for (auto& g : opt->param_groups())
      for (auto& p : g.params()) p.mutable_grad() = at::Tensor();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    v.losses.push_back(loss.item<double>());
    if (s < o.warmup) continue;
    times.push_back(dt);
    v.held_after_forward_mb = std::max(v.held_after_forward_mb, held);
    v.step_peak_rss_mb = std::max(v.step_peak_rss_mb, memory::peak_rss_mb() - rss0);
  }
  std::sort(times.begin(), times.end());
  v.step_s_median = max_over_ranks(comm, times[times.size() / 2]);
  v.held_after_forward_mb = max_over_ranks(comm, v.held_after_forward_mb);
  v.step_peak_rss_mb = max_over_ranks(comm, v.step_peak_rss_mb);
  return v;
}

}  // namespace

int run_checkpointing_bench(const TrainBenchOptions& o) {
  FSDP_CHECK(o.steps > 0, "--steps ", o.steps, ": the bench needs at least one timed step");
  at::set_num_threads(o.threads);
  auto comm = init_process_group();
  Variant plain = run_variant(o, *comm, comm, false);
  Variant ckpt = run_variant(o, *comm, comm, true);
  if (comm->rank() != 0) return 0;
  auto line = [&](const Variant& v, bool on) {
    nlohmann::ordered_json j;
    j["activation_checkpointing"] = on;
    j["world"] = comm->size();
    j["held_after_forward_mb"] = round_to(v.held_after_forward_mb, 10);
    j["step_peak_rss_mb"] = round_to(v.step_peak_rss_mb, 10);
    j["step_s_median"] = round_to(v.step_s_median, 1e4);
    j["loss"] = v.losses.back();
    j["layers"] = o.layers, j["width"] = o.width, j["seq"] = o.seq, j["batch"] = o.batch;
    return j.dump();
  };
  std::cout << line(plain, false) << "\n" << line(ckpt, true) << "\n";
  const bool equal = plain.losses == ckpt.losses;
  nlohmann::ordered_json s;
  s["activation_memory_saved_mb"] =
      round_to(plain.held_after_forward_mb - ckpt.held_after_forward_mb, 10);
  s["held_ratio"] = round_to(ckpt.held_after_forward_mb / plain.held_after_forward_mb, 1e3);
  s["peak_rss_saved_mb"] = round_to(plain.step_peak_rss_mb - ckpt.step_peak_rss_mb, 10);
  s["step_time_ratio"] = round_to(ckpt.step_s_median / plain.step_s_median, 1e3);
  s["losses_bitwise_equal"] = equal;
  std::cout << s.dump() << std::endl;
  if (!equal) std::cerr << "WARNING: the checkpointed run's losses differ from the plain run's\n";
  return equal ? 0 : 1;
}

}  // namespace fsdp::bench
