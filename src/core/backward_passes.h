// BackwardPasses: the backwards running through one root, one BackwardPass per autograd
// GraphTask, and the one entry of every backward hook into them.
//
// Lifecycle of a pass: created at the first output hook of a GraphTask (which also queues the
// engine's final callback), fed every later hook of that task, finalised by the final callback;
// dropped unfinished at the next forward when the backward threw (the engine skips final
// callbacks then).
//
// Thread-safety: hooks run on the engine's threads (the thread that called backward on CPU).
// Each entry point below takes mutex() once; nothing reached from it takes it again (mutex() is
// an EntryMutex: a nested lock throws). The Context's forward entry points take the same mutex,
// since a forward may run inside a backward (activation checkpointing recomputes there).
#pragma once

#include <map>
#include <memory>

#include "util/mutex.h"

namespace torch::autograd {
struct Node;
}
namespace fsdp::detail {

class BackwardPass;
class Context;
class Group;

class BackwardPasses {
 public:
  explicit BackwardPasses(Context& ctx);
  ~BackwardPasses();
  BackwardPasses(const BackwardPasses&) = delete;
  BackwardPasses& operator=(const BackwardPasses&) = delete;

  // ---- the hooks' entry points, in the order they arrive ----
  // Tensor hook on an output of g's forward; `node` is the output's grad_fn.
  void on_output_hook(Group& g, const torch::autograd::Node* node) FSDP_EXCLUDES(mu_);
  void on_grad_ready(Group& g, size_t param) FSDP_EXCLUDES(mu_);  // AccumulateGrad post hook
  void on_input_backward(Group& g) FSDP_EXCLUDES(mu_);            // the input-side node of one call

  // ---- for the Context's forward entry points ----
  EntryMutex& mutex() FSDP_RETURN_CAPABILITY(mu_) { return mu_; }
  // Drops the passes of backwards that threw; true if there were any.
  bool drop_unfinished() FSDP_REQUIRES(mu_);

 private:
  BackwardPass* current() FSDP_REQUIRES(mu_);         // of the running GraphTask; null outside one
  void finalize(const void* key) FSDP_EXCLUDES(mu_);  // the engine's final callback
  void claim(const void* key, const Group& g) FSDP_REQUIRES(mu_);

  Context& ctx_;
  EntryMutex mu_{"the backward bookkeeping's mutex"};
  std::map<const void*, std::unique_ptr<BackwardPass>> passes_ FSDP_GUARDED_BY(mu_);  // by task
};

}  // namespace fsdp::detail
