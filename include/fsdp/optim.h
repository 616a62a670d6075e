// Fused optimizer steps on flat shards: fsdp::optim::AdamW and fsdp::optim::SGD.
//
// Drop-in replacements for torch::optim::AdamW and torch::optim::SGD: they derive from them, so
// the options (AdamWOptions, SGDOptions, per parameter group), the state (AdamWParamState: step,
// exp_avg, exp_avg_sq, max_exp_avg_sq; SGDParamState: momentum_buffer), save/load (torch::save,
// torch::load) and fsdp::checkpoint are LibTorch's, and code holding a torch::optim::AdamW& or
// Optimizer& keeps working. Only step() differs: LibTorch's runs about nine tensor operations per
// parameter, one after another, each a pass over memory (several with a temporary); these run
// each *run* of parameters in one vectorised pass, split over the intra-op threads
// (at::parallel_for, at::get_num_threads()).
//
// A run is a sequence of consecutive parameters of one parameter group that lie in one storage at
// increasing, non-overlapping offsets (found through the tensor API: storage identity, storage
// offset, contiguity), each a contiguous CPU float or double tensor with a dense gradient of its
// own dtype and shape. fully_shard keeps a group's shards in one flat storage (docs/design.md,
// [Note: parameter storage]), so a group's shards in one optimizer parameter group form one run.
// The state of a run's parameters lives in one flat buffer per state tensor (exp_avg, ...): each
// parameter's state tensor is a view of its region. State that arrives otherwise (created by
// LibTorch, torch::load, fsdp::checkpoint::load) is copied into such a buffer at the next step.
// Any other parameter (CUDA, bf16, non-contiguous, sparse gradient) is stepped alone by
// LibTorch's own sequence of operations.
//
// Numerics: LibTorch's operations in its order and precision, with its roundings: its
// `add_(x, alpha)` and `addcmul_` are fused multiply-adds on CPUs with FMA, and the square root is
// ATen's own (MKL's vsSqrt in PyPI's LibTorch, which is not correctly rounded). On a CPU with FMA
// (x86-64 since 2013) the results are bitwise equal to torch::optim::AdamW / SGD on LibTorch 2.15
// and 1.13 (tests/optim_test.cpp, 100 steps). Without FMA hardware LibTorch rounds those two
// operations twice; the results then differ by about one ulp per step.
//
// Thread-safety: as torch::optim: one thread steps an optimizer at a time.
#pragma once

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace fsdp::optim {

class AdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  // torch::optim::AdamW::step's update, fused per run (above). Throws fsdp::Error for a parameter
  // whose state lacks max_exp_avg_sq while its group has amsgrad on (state made with amsgrad
  // off), and as LibTorch for a sparse gradient.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

class SGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  // torch::optim::SGD::step's update (weight decay, momentum with dampening, Nesterov), fused
  // per run (above).
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace fsdp::optim
