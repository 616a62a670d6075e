// Models as LibTorch users write them, for the adoption tests: a CNN with BatchNorm2d (buffers)
// and a two-input model. Each is written as a user would write it unsharded; the lines that
// fully_shard needs are marked "// fsdp:".
#pragma once

#include <fsdp/fsdp.h>
#include <torch/torch.h>

namespace fsdp::testing {

// conv -> BatchNorm2d -> relu.
struct ConvBlockImpl : torch::nn::Module {
  ConvBlockImpl(int64_t in, int64_t out) {
    conv =
        register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(out));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(bn(conv(x))); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(ConvBlock);

// (B, 2, 6, 6) -> (B, 3): two conv blocks, a BatchNorm1d-free linear head.
struct CnnImpl : torch::nn::Module {
  CnnImpl() {
    block1 = register_module("block1", ConvBlock(2, 5));
    block2 = register_module("block2", ConvBlock(5, 4));
    head = register_module("head", torch::nn::Linear(4 * 6 * 6, 3));
    to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(block2(block1(x)).flatten(1)); }
  fsdp::Sharded<ConvBlock> block1{nullptr};  // fsdp: was ConvBlock
  fsdp::Sharded<ConvBlock> block2{nullptr};  // fsdp: was ConvBlock
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Cnn);

// The CNN's input batch of `rank` at `step`: (4, 2, 6, 6) fp64, and its target (4, 3).
inline std::pair<torch::Tensor, torch::Tensor> cnn_batch(int rank, int step) {
  torch::manual_seed(1000 + 17 * step + rank);
  // Each rank's batch has its own mean, so BatchNorm statistics differ across ranks.
  auto x = torch::randn({4, 2, 6, 6}, torch::kDouble) + 0.5 * rank;
  return {x, torch::randn({4, 3}, torch::kDouble)};
}

// Mixes two inputs of different widths: forward(x, y).
struct TwoInputBlockImpl : torch::nn::Module {
  TwoInputBlockImpl() {
    a = register_module("a", torch::nn::Linear(5, 6));
    b = register_module("b", torch::nn::Linear(3, 6));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    return torch::tanh(a(x)) * b(y);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoInputBlock);

struct TwoInputNetImpl : torch::nn::Module {
  TwoInputNetImpl() {
    mix = register_module("mix", TwoInputBlock());
    out = register_module("out", torch::nn::Linear(6, 2));
    to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    return out(mix(x, y) + y.sum(1, /*keepdim=*/true));
  }
  fsdp::Sharded<TwoInputBlock> mix{nullptr};  // fsdp: was TwoInputBlock
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(TwoInputNet);

inline torch::optim::AdamWOptions adoption_adamw() {
  return torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
}

}  // namespace fsdp::testing
