// CollectiveStream: the CUDA stream a communicator's collectives run on, so that all-gathers and
// reduce-scatters (each on its own lane, fsdp.ag / fsdp.rs) overlap the computation on the
// caller's stream. Compiled in only where LibTorch has NCCL (USE_C10D_NCCL, FSDP_CUDA=ON); on CPU
// tensors, or in a CPU-only build, enter() does nothing.
//
// [Note: collective streams]
// A collective on CUDA tensors is issued inside `auto scope = stream.enter({tensors...})`:
//  - ordering in: the side stream first waits for an event recorded on the caller's current
//    stream, so the collective reads what the computation wrote before the call (the copy into
//    the all-gather's send buffer, the gradients given to a reduce-scatter);
//  - the side stream is the current stream while the scope lives: ProcessGroupNCCL orders its own
//    NCCL stream after the current one, so the collective runs after that wait and not on the
//    computation's stream;
//  - memory: each tensor's block is recorded on the side stream (the caching allocator's
//    recordStream), so freeing it on the computation's stream (a reshard, a dropped send buffer)
//    does not hand the memory to another allocation before the side stream is done with it;
//  - ordering out: Work::wait() on an NCCL work makes the caller's current stream wait for the
//    collective (no host wait), so what runs after the wait on that stream sees its result.
// What the GPU run checks (nothing runs on a GPU in this repository's CI): losses equal to the CPU
// run's within tolerance, the trace showing all-gathers overlapping the forward and reduce-scatters
// the backward on separate streams, and no use-after-free under compute-sanitizer.
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <memory>

namespace fsdp::detail {

class CollectiveStream {
 public:
  CollectiveStream();
  ~CollectiveStream();
  CollectiveStream(const CollectiveStream&) = delete;
  CollectiveStream& operator=(const CollectiveStream&) = delete;

  // While alive, the side stream is current (CUDA tensors only). Restores the caller's stream.
  class Scope {
   public:
    Scope() = default;
    Scope(Scope&&) noexcept;
    ~Scope();

   private:
    friend class CollectiveStream;
    struct State;
    std::unique_ptr<State> state_;
  };
  // Enters the side stream for a collective on `tensors` (the first defined one's device decides;
  // CPU tensors: an empty scope).
  Scope enter(std::initializer_list<at::Tensor> tensors);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp::detail
