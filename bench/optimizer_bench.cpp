#include "optimizer_bench.h"

#include <fsdp/fsdp.h>
#include <fsdp/optim.h>
#include <torch/torch.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>

#include "compat/optim.h"
#include "stats.h"
#include "sweeps.h"
#include "train/model_setup.h"

namespace fsdp::bench {
namespace {

using Clock = std::chrono::steady_clock;

// One copy of the shards, in the trainer's two parameter groups, and its optimizer.
struct Contender {
  std::string name;
  std::vector<at::Tensor> params;  // decay group, then no-decay group
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::vector<double> round_ms;  // per round: the median step of this rank
};

// Fixed random gradients for the shards, shared read-only by every copy.
void give_grads(const std::vector<at::Tensor>& shards, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto p : shards) p.mutable_grad() = at::randn(p.sizes(), gen) * 1e-3;
}

// Copies of `shards` that are tensors of their own, with the shards' gradients.
std::vector<at::Tensor> copies(const std::vector<at::Tensor>& shards) {
  std::vector<at::Tensor> out;
  for (const auto& p : shards) {
    out.push_back(p.detach().clone());
    out.back().mutable_grad() = p.grad();
  }
  return out;
}

// fsdp-train's AdamW (src/train/model_setup.cpp), or SGD with momentum 0.9 and weight decay on
// the first group, fused (fsdp::optim) or LibTorch's.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        const std::vector<at::Tensor>& params,
                                                        size_t n_decay, bool fused, double lr) {
  std::vector<at::Tensor> decay(params.begin(), params.begin() + n_decay);
  std::vector<at::Tensor> no_decay(params.begin() + n_decay, params.end());
  std::vector<torch::optim::OptimizerParamGroup> g;
  if (kind == "adamw") {
    auto opts = [&](double wd) {
      return std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(wd));
    };
    g.emplace_back(decay, opts(0.1));
    g.emplace_back(no_decay, opts(0.0));
    if (fused) return std::make_unique<fsdp::optim::AdamW>(std::move(g), *opts(0.0));
    return std::make_unique<torch::optim::AdamW>(std::move(g), *opts(0.0));
  }
  auto opts = [&](double wd) {
    return std::make_unique<torch::optim::SGDOptions>(
        torch::optim::SGDOptions(lr).momentum(0.9).weight_decay(wd));
  };
  g.emplace_back(decay, opts(1e-4));
  g.emplace_back(no_decay, opts(0.0));
  if (fused) return std::make_unique<fsdp::optim::SGD>(std::move(g), *opts(0.0));
  return std::make_unique<torch::optim::SGD>(std::move(g), *opts(0.0));
}

// The state tensors of p in `opt`: AdamW's moments or SGD's momentum buffer.
std::vector<at::Tensor> state_tensors(torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto it = opt.state().find(compat::optim_state_key(p));
  if (it == opt.state().end()) return {};
  if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get()))
    return {a->exp_avg(), a->exp_avg_sq()};
  return {static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer()};
}

// Whether a and b hold the same bits in every parameter and state tensor; the largest difference.
bool same_bits(Contender& a, Contender& b, double* max_diff) {
  bool same = true;
  auto cmp = [&](const at::Tensor& x, const at::Tensor& y) {
    auto cx = x.contiguous(), cy = y.contiguous();
    if (std::memcmp(cx.data_ptr(), cy.data_ptr(), cx.numel() * cx.element_size()) == 0) return;
    same = false;
    *max_diff = std::max(*max_diff, (cx - cy).abs().max().item<double>());
  };
  for (size_t i = 0; i < a.params.size(); ++i) {
    cmp(a.params[i], b.params[i]);
    auto sa = state_tensors(*a.opt, a.params[i]), sb = state_tensors(*b.opt, b.params[i]);
    if (sa.size() != sb.size()) return false;
    for (size_t k = 0; k < sa.size(); ++k) cmp(sa[k], sb[k]);
  }
  return same;
}

// Times `steps` steps of c on every rank at once; appends this rank's median to c.round_ms.
void time_round(Contender& c, Communicator& comm, int steps) {
  std::vector<double> ms;
  comm.barrier().wait();
  for (int s = 0; s < steps; ++s) {
    const auto t0 = Clock::now();
    c.opt->step();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  c.round_ms.push_back(median(ms));
}

// Every rank's value of x: the largest.
double slowest(Communicator& comm, double x) {
  auto all = at::empty({comm.size()}, at::kDouble);
  comm.all_gather(all, at::full({1}, x, at::kDouble)).wait();
  return all.max().item<double>();
}

nlohmann::ordered_json bench_one(const std::string& kind, const std::vector<at::Tensor>& shards,
                                 size_t n_decay, const TrainBenchOptions& o, int rounds,
                                 Communicator& comm) {
  std::vector<Contender> cs(3);
  cs[0].name = "fused";
  cs[0].params = shards;
  cs[1].name = "fused-separate";
  cs[1].params = copies(shards);
  cs[2].name = "torch";
  cs[2].params = copies(shards);
  for (auto& c : cs) c.opt = make_optimizer(kind, c.params, n_decay, c.name != "torch", o.lr);
  for (auto& c : cs)
    for (int w = 0; w < o.warmup; ++w) c.opt->step();  // the state is made in the first
  bool bitwise = true;
  double max_diff = 0;
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < cs.size(); ++i) time_round(cs[(i + r) % cs.size()], comm, o.steps);
    bitwise = same_bits(cs[0], cs[2], &max_diff) && bitwise;
    bitwise = same_bits(cs[1], cs[2], &max_diff) && bitwise;
  }
  int64_t numel = 0;
  for (const auto& p : shards) numel += p.numel();
  nlohmann::ordered_json j;
  j["optimizer_step"] = kind;
  j["world"] = comm.size();
  j["threads"] = at::get_num_threads();
  j["params_per_rank"] = numel;
  j["tensors_per_rank"] = shards.size();
  auto put = [&](const std::string& key, const std::vector<double>& v, double scale) {
    j[key] = round_to(median(v), scale);
    j[key + "_range"] = {round_to(*std::min_element(v.begin(), v.end()), scale),
                         round_to(*std::max_element(v.begin(), v.end()), scale)};
  };
  std::map<std::string, std::vector<double>> per_round;  // the slowest rank's median, per round
  for (auto& c : cs) {
    for (double ms : c.round_ms) per_round[c.name].push_back(slowest(comm, ms));
    put(c.name + "_ms", per_round[c.name], 1e3);
  }
  // Ratios round by round (the contenders of a round ran back to back), then their median.
  for (const std::string other : {"fused", "fused-separate"}) {
    std::vector<double> ratio;
    for (int r = 0; r < rounds; ++r) ratio.push_back(per_round["torch"][r] / per_round[other][r]);
    put(other == "fused" ? "torch_over_fused" : "torch_over_fused_separate", ratio, 100);
  }
  // Any rank's difference fails the check.
  j["bitwise_equal"] = slowest(comm, bitwise ? 0.0 : 1.0) == 0.0;
  j["max_abs_diff"] = slowest(comm, max_diff);
  j["rounds"] = rounds;
  j["steps"] = o.steps;
  j["preset"] = o.preset;
  j["layers"] = o.layers;
  j["width"] = o.width;
  return j;
}

}  // namespace

int run_optimizer_bench(const TrainBenchOptions& o, int rounds) {
  at::set_num_threads(o.threads);
  auto comm = init_process_group();
  // The benchmark's GPT sharded as fsdp-train shards it, its shards in the trainer's groups.
  train::TrainConfig tc;
  tc.layers = o.layers, tc.heads = o.heads, tc.width = o.width, tc.seq = o.seq;
  tc.lr = o.lr, tc.seed = o.seed;
  auto m = train::build_model(tc, comm);
  std::vector<at::Tensor> shards = m->decay;
  shards.insert(shards.end(), m->no_decay.begin(), m->no_decay.end());
  give_grads(shards, o.seed + static_cast<uint64_t>(comm->rank()));
  const auto load_start = load_average();
  if (comm->rank() == 0)
    std::cerr << "fsdp-bench: optimizer step on the shards of GPT " << o.layers << "x" << o.width
              << " (" << m->parameter_count / 1e6 << " M parameters) over " << comm->size()
              << " rank(s), " << o.threads << " thread(s) per rank, " << o.warmup << "+" << o.steps
              << " steps x " << rounds << " rounds\n";
  bool ok = true;
  for (const char* kind : {"adamw", "sgd"}) {
    auto j = bench_one(kind, shards, m->decay.size(), o, rounds, *comm);
    ok = ok && j["bitwise_equal"].get<bool>();
    j["loadavg_start"] = load_start;
    j["loadavg_end"] = load_average();
    if (comm->rank() == 0) std::cout << j.dump() << std::endl;
  }
  if (!ok && comm->rank() == 0)
    std::cerr << "fsdp-bench: WARNING: the fused and LibTorch optimizers did not give the same "
                 "bits (include/fsdp/optim.h: bitwise on CPUs with FMA)\n";
  comm->barrier().wait();
  return 0;
}

}  // namespace fsdp::bench
