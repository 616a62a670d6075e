// finalize_backward: the gradients that backwards without gradient sync accumulated, reduced
// outside any backward (FSDP2's FSDPModule.finalize_backward, as pipeline schedules call it after
// a step's last backward).
// Thread-safety: a collective; the training thread, at the same point on every rank.
#pragma once

namespace fsdp::detail {

class Context;

// Every group of `ctx` with trainable parameters and gradient sync on reduce-scatters what its
// parameters hold (zeros where they hold nothing; under HSDP, then all-reduces across replicas),
// in registration order on every rank, adds the result to the shards' gradients, and reshards if
// reshard_after_backward is set. The ranks first agree that they all finalize, reducing the same
// groups. Throws inside a forward or a backward.
void finalize_backward(Context& ctx);

}  // namespace fsdp::detail
