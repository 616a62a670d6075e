// An MLP stack for tests and memory measurements: depth Linear(width, width) layers with tanh
// between, each layer its own fsdp::Sharded group.
#pragma once

#include <fsdp/fully_shard.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace fsdp::models {

class MLPStackImpl : public torch::nn::Module {
 public:
  MLPStackImpl(int64_t width, int64_t depth);
  torch::Tensor forward(const torch::Tensor& x);         // (B, width) -> (B, width)
  std::vector<fsdp::Sharded<torch::nn::Linear>> layers;  // registered as layers.0, layers.1, ...
};
TORCH_MODULE(MLPStack);

}  // namespace fsdp::models
