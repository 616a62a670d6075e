#include <fsdp/models/mlp.h>
#include <torch/torch.h>

namespace fsdp::models {

MLPStackImpl::MLPStackImpl(int64_t width, int64_t depth) {
  FSDP_CHECK(width > 0 && depth > 0, "MLPStack: width and depth must be positive, got ", width,
             " and ", depth);
  auto list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < depth; ++i) {
    layers.emplace_back(torch::nn::Linear(width, width));
    list->push_back(layers.back().ptr());
  }
}

torch::Tensor MLPStackImpl::forward(const torch::Tensor& x) {
  auto h = x;
  for (auto& l : layers) h = torch::tanh(l(h));
  return h;
}

}  // namespace fsdp::models
