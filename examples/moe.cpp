// A mixture-of-experts GPT in which each rank calls only the experts its tokens are routed to.
// Every expert is a sharded group of its own (fsdp::models::MoEGPT); a rank skips the experts
// that got none of its tokens, and fsdp-cpp still issues the same collectives on every rank
// (docs/design.md, [Note: calls that differ between ranks]).
//
//   build/bin/fsdp-run -n 2 build/bin/fsdp-moe                train, the loss per step
//   build/bin/fsdp-run -n 2 build/bin/fsdp-moe --check        then compare with the unsharded
//                                                             model on rank 0 (exit 1 if > 1e-5)
//   build/bin/fsdp-run -n 2 build/bin/fsdp-moe --force-all    every expert called on every rank
// Options: --experts E (16) --top-k K (2) --layers L (2) --width C (64) --tokens T per rank (4)
//          --steps S (10). Step time and bytes against --force-all: fsdp-bench --moe.
#include <fsdp/fsdp.h>
#include <fsdp/models/moe.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

namespace {

using fsdp::models::MoEConfig;
using fsdp::models::MoEGPT;

struct Options {
  MoEConfig model;
  int64_t steps = 10;
  bool check = false, force_all = false;
};

Options parse(int argc, char** argv) {
  Options o;
  o.model.width = 64;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> int64_t {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return std::stoll(argv[++i]);
    };
    if (a == "--experts")
      o.model.experts = value();
    else if (a == "--top-k")
      o.model.top_k = value();
    else if (a == "--layers")
      o.model.layers = value();
    else if (a == "--width")
      o.model.width = value();
    else if (a == "--tokens")
      o.model.tokens = value();
    else if (a == "--steps")
      o.steps = value();
    else if (a == "--check")
      o.check = true;
    else if (a == "--force-all")
      o.force_all = true;
    else
      throw std::runtime_error("unknown option " + a + " (see examples/moe.cpp)");
  }
  o.model.validate();
  return o;
}

// Rank r's tokens for `step`: the same on every run.
std::pair<torch::Tensor, torch::Tensor> batch(const Options& o, int rank, int64_t step) {
  torch::manual_seed(1000 * step + rank);
  auto seq = torch::randint(o.model.vocab_size, {1, o.model.tokens + 1}, torch::kLong);
  return {seq.narrow(1, 0, o.model.tokens), seq.narrow(1, 1, o.model.tokens)};
}

torch::optim::AdamW optimizer(std::vector<torch::Tensor> params) {
  return torch::optim::AdamW(std::move(params), torch::optim::AdamWOptions(1e-3));
}

// The unsharded model on one process, every rank's batch in turn: the mean of the ranks' losses,
// as the sharded run computes it. Returns the loss per step.
std::vector<double> reference_losses(const Options& o, int world) {
  torch::manual_seed(0);
  MoEGPT model(o.model);
  auto opt = optimizer(model->parameters());
  std::vector<double> losses;
  for (int64_t step = 0; step < o.steps; ++step) {
    torch::Tensor total = torch::zeros({});
    for (int r = 0; r < world; ++r) {
      auto [x, y] = batch(o, r, step);
      total = total + model->forward(x, y) / world;
    }
    total.backward();  // an expert no rank's tokens chose keeps no gradient: AdamW skips it
    opt.step();
    opt.zero_grad();
    losses.push_back(total.item<double>());
  }
  return losses;
}

int train(const Options& o, const std::shared_ptr<fsdp::Communicator>& world) {
  torch::manual_seed(0);  // the same initial model on every rank
  fsdp::Sharded<MoEGPT> model(o.model);
  auto root = fsdp::models::shard_moe_gpt(model, world);
  model->set_force_all(o.force_all);
  auto opt = optimizer(root.parameters());
  std::vector<double> losses;
  for (int64_t i = 0; i < o.steps; ++i) {
    auto [x, y] = batch(o, world->rank(), i);
    auto loss = model(x, y);
    loss.backward();
    opt.step();
    opt.zero_grad();
    auto mean = loss.detach().clone();
    world->all_reduce(mean, fsdp::ReduceOp::kSum).wait();
    losses.push_back(mean.item<double>() / world->size());
    if (world->rank() == 0)
      std::cout << "step " << i << " loss " << losses.back() << " (expert calls on rank 0 so far "
                << model->expert_calls() << ")" << std::endl;
  }
  if (!o.check || world->rank() != 0) return 0;
  const auto want = reference_losses(o, world->size());
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(losses[i] - want[i]));
  std::cout << "check: largest |loss - unsharded loss| over " << want.size() << " steps: " << worst
            << (worst <= 1e-5 ? " (within 1e-5)" : " (MORE THAN 1e-5)") << std::endl;
  return worst <= 1e-5 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  auto world = fsdp::init_process_group();
  return train(o, world);
} catch (const std::exception& e) {
  std::cerr << "fsdp-moe: " << e.what() << std::endl;
  return 1;
}
