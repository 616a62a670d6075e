#include "moe_bench.h"

#include <fsdp/fsdp.h>
#include <fsdp/models/moe.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

namespace fsdp::bench {
namespace {

struct MoEVariant {
  std::vector<double> step_s;                    // per round
  double bytes = 0, collectives = 0, calls = 0;  // per step, averaged over rounds
};

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One step on rank-specific tokens; `i` numbers the batches.
void step(fsdp::Sharded<models::MoEGPT>& model, torch::optim::Optimizer& opt, int rank,
          const MoEBenchOptions& o, int64_t i) {
  torch::manual_seed(1000 * i + rank);
  auto seq = torch::randint(256, {1, o.tokens + 1}, torch::kLong);
  model(seq.narrow(1, 0, o.tokens), seq.narrow(1, 1, o.tokens)).backward();
  opt.step();
  opt.zero_grad();
}

}  // namespace

int run_moe_bench(const MoEBenchOptions& o) {
  auto world = init_process_group();
  models::MoEConfig cfg;
  cfg.experts = o.experts;
  cfg.top_k = o.top_k;
  cfg.tokens = o.tokens;
  cfg.layers = o.layers;
  cfg.width = o.width;
  torch::manual_seed(0);
  fsdp::Sharded<models::MoEGPT> model(cfg);
  auto root = models::shard_moe_gpt(model, world);
  torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-3));
  // Routed (an expert no rank's tokens chose is not reduce-scattered), routed reducing every
  // expert (set_reduce_scatter_unused_params: zeros for the unchosen ones), every expert called.
  constexpr int kVariants = 3;
  MoEVariant v[kVariants];
  int64_t i = 0;
  for (int round = 0; round < o.rounds; ++round)
    for (int variant = 0; variant < kVariants; ++variant) {
      model->set_force_all(variant == 2);
      root.set_reduce_scatter_unused_params(variant == 1);
      for (int w = 0; w < o.warmup; ++w) step(model, opt, world->rank(), o, i++);
      world->barrier().wait();
      world->reset_stats();
      const int64_t calls = model->expert_calls();
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < o.steps; ++s) step(model, opt, world->rank(), o, i++);
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const auto st = world->total_stats();
      MoEVariant& f = v[variant];
      f.step_s.push_back(dt / o.steps);
      f.bytes += static_cast<double>(st.bytes_sent) / o.steps / o.rounds;
      f.collectives += static_cast<double>(st.collectives) / o.steps / o.rounds;
      f.calls += static_cast<double>(model->expert_calls() - calls) / o.steps / o.rounds;
    }
  if (world->rank() != 0) return 0;
  const char* names[kVariants] = {"moe-routed", "moe-routed-reducing-unused", "moe-every-expert"};
  for (int variant = 0; variant < kVariants; ++variant) {
    const MoEVariant& f = v[variant];
    nlohmann::json j;
    j["mode"] = names[variant];
    j["world"] = world->size();
    j["step_s_median"] = median_of(f.step_s);
    j["step_s_min"] = *std::min_element(f.step_s.begin(), f.step_s.end());
    j["step_s_max"] = *std::max_element(f.step_s.begin(), f.step_s.end());
    j["bytes_sent_per_step"] = static_cast<int64_t>(f.bytes);
    j["collectives_per_step"] = f.collectives;
    j["expert_calls_per_step"] = f.calls;
    j["experts_total"] = o.experts * o.layers;
    j["top_k"] = o.top_k;
    j["tokens"] = o.tokens;
    std::cout << j.dump() << std::endl;
  }
  nlohmann::json s;
  s["summary"] = "moe";
  s["routed_over_forced_step"] = median_of(v[0].step_s) / median_of(v[2].step_s);
  s["routed_over_forced_bytes"] = v[0].bytes / v[2].bytes;
  s["routed_over_reducing_unused_step"] = median_of(v[0].step_s) / median_of(v[1].step_s);
  s["routed_over_reducing_unused_bytes"] = v[0].bytes / v[1].bytes;
  std::cout << s.dump() << std::endl;
  return 0;
}

}  // namespace fsdp::bench
