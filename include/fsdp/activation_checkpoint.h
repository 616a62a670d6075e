// Activation checkpointing for C++ (LibTorch has no torch::utils::checkpoint): a block's forward
// runs without recording its activations; backward runs it again, with the same random numbers,
// and differentiates the recomputation. See docs/design.md, [Note: activation checkpointing].
//
// Two entry points:
//  - RuntimeOptions::activation_checkpointing on a fully_shard call (ShardOptions::runtime): every
//    forward of that module is checkpointed (Sharded::operator() and Sharded::call route it). The
//    recomputation runs after the group's pre-backward hook has gathered the parameters again, and
//    the gradients of the parameters flow into their accumulators through the outer backward, so
//    the post-backward guarantee and the audit see an ordinary backward.
//  - checkpoint_activations(fn, inputs, params) for code that is not sharded.
//
// Thread-safety: as the module; the recomputation runs on the thread that runs backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace fsdp {

// A function of tensors to tensors that checkpointing may run twice.
using TensorFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs fn(inputs) without keeping its activations and returns its outputs; backward recomputes
// fn on detached copies of `inputs` (the CPU random state restored to what it was at the first
// run) and passes gradients to `inputs` and to `params`, the tensors fn reads that need gradients
// (e.g. a module's parameters(): fn must use these same tensors). fn must be deterministic given
// the random state and its inputs; inputs changed in place before backward are an error.
// Without grad mode, or when nothing needs a gradient, fn simply runs once.
std::vector<at::Tensor> checkpoint_activations(const TensorFunction& fn,
                                               const std::vector<at::Tensor>& inputs,
                                               const std::vector<at::Tensor>& params);

}  // namespace fsdp
