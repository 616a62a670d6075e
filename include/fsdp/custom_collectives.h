// FSDP2's custom collectives (set_custom_all_gather, set_custom_reduce_scatter): a group's
// all-gathers or reduce-scatters run through a collective of the user's (one on another transport,
// another algorithm) instead of the communicator's. Install the same kind on every rank of the
// group, between steps. Calls come on the thread that issues the group's collectives, in the same
// order on every rank (every rank issues the same collectives: [Note: calls that differ between
// ranks]); the group waits on the returned Work before it reads the output, and holds both
// tensors until then. Buffers come from fsdp-cpp's pool (FSDP2's allocate() has no counterpart).
// Issue, do not wait: a call must return without waiting on a collective. fsdp-cpp keeps
// collectives in flight on several communicators at once (a backward's reduce-scatters beside its
// all-gathers), and one rank blocked inside a call while a peer waits on a collective this rank
// has yet to issue never completes (the collective timeout then names the wait). Return a Work
// that completes when the output is final: in the simple case, that of the one collective issued.
// Thread-safety: as the group's other settings (the training thread).
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/communicator.h>

namespace fsdp {

class AllGather {
 public:
  virtual ~AllGather() = default;
  // output: group.size() * input.numel() elements, rank r's input at [r * n, (r + 1) * n);
  // input: this rank's flat shard (padded, in the gather's dtype). Both contiguous, flat. Return
  // a Work the group waits on (Work() for one already complete).
  virtual Work operator()(const at::Tensor& output, const at::Tensor& input,
                          Communicator& group) = 0;
};

class ReduceScatter {
 public:
  virtual ~ReduceScatter() = default;
  // input: group.size() * output.numel() elements, block r for rank r; output: this rank's
  // reduced block, which is input's own block r (in place). op: kAvg, or kSum where a gradient
  // divide factor divides afterwards. Return a Work the group waits on.
  virtual Work operator()(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                          Communicator& group) = 0;
};

}  // namespace fsdp
