// How fsdp::optim's fused steps (include/fsdp/optim.h) walk a parameter group: which parameters
// go together in one pass (runs), their state as views of flat buffers, and one pass split over
// the intra-op threads. Thread-safety: call from the thread that steps the optimizer.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace fsdp::optim::detail {

// One step of a parameter group: a run of parameters stepped in one fused pass, or one parameter
// stepped by LibTorch's own sequence of operations (fused == false). `params` index the group's
// parameters.
struct StepItem {
  std::vector<size_t> params;
  bool fused = false;
};

// The parameters of `params` that have a gradient, in order, as steps. A run holds consecutive
// parameters that the fused loops can take (contiguous CPU float or double, a dense contiguous
// gradient of the same dtype and shape) and that lie in one storage at increasing,
// non-overlapping offsets (fully_shard's flat shards); any other parameter is a step of its own,
// fused (a run of one) when the loops can take it.
std::vector<StepItem> plan_steps(const std::vector<at::Tensor>& params);

// Makes the tensors in `slots` (one per parameter of a run, each undefined or shaped as its
// parameter) views of one flat buffer, in order and in their parameters' dtype, unless they are
// such views already (of one storage, contiguous, at increasing offsets). Copies the values in;
// an undefined slot gets zeros.
void make_flat(const std::vector<at::Tensor>& params, const std::vector<at::Tensor*>& slots);

// Calls fn(k, begin, end) for stretches [begin, end) of element ranges of sizes numels[k] that
// together cover every element once, split into pieces of at least `grain` elements over the
// intra-op threads (at::parallel_for). fn must be safe to call concurrently on disjoint stretches.
void parallel_pass(const std::vector<int64_t>& numels,
                   const std::function<void(size_t, int64_t, int64_t)>& fn, int64_t grain = 32768);

// Bumps the version counters of `params`, as LibTorch's in-place updates do (autograd then
// refuses a backward through a graph that saved a parameter before the step).
void bump_versions(const std::vector<at::Tensor>& params);

}  // namespace fsdp::optim::detail
