// The autograd hooks fsdp-cpp installs, each a one-line adapter that enters the root of its
// binding (core/binding.h) with one call: the AccumulateGrad pre and post hooks of every trainable
// parameter, the tensor hook on every output of a sharded module's forward, and the input-side
// node of each call ([Note: the post-backward guarantee], [Note: inputs modified in place]). A
// hook whose model is gone does nothing.
// Thread-safety: hooks run on the engine's threads (the thread that called backward, on CPU); the
// root's entry points serialise them.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

#include "compat/autograd.h"

namespace fsdp::detail {

struct Binding;

// At fully_shard: the guard's entries and the moved-gradient markers of the group's parameters,
// and the AccumulateGrad hooks of its trainable ones.
void attach_param_hooks(const std::shared_ptr<Binding>& b);
// After a forward call: the pre-backward hook on one output (its node recorded by the group).
void attach_output_hook(const at::Tensor& out, const std::weak_ptr<Binding>& b);
// A forward call's tensor input `x` (requiring grad, grad mode on): what forward receives, through
// a new input-side node (a custom Function for a view).
at::Tensor hand_input(const at::Tensor& x, const std::weak_ptr<Binding>& b);

}  // namespace fsdp::detail
