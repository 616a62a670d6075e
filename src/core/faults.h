// Faults a test injects into the backward pass to show that a check catches them: each one is a
// mutation made at run time (the fix reverted, in effect). Nothing in the library sets them; only
// the tests do, inside a rank, through inject(). Off unless a test turned one on.
// Thread-safety: set before training starts; read on the backward thread.
#pragma once

#include <chrono>

namespace fsdp::detail::faults {

struct Faults {
  // Issue every reduction at the first pre-backward hook, before its gradients are final (what
  // an input-side trigger does for a tied weight): the audit must report Final.
  bool issue_early = false;
  // A rank other than 0 of the gather lane swaps the first two backward all-gathers: the
  // agreement check must name them.
  bool gather_order = false;
  // Every rank but 0 of the reduce lane issues each reduction this late, like a rank that falls
  // behind (the bounded waits' tests).
  std::chrono::milliseconds slow_reduce{0};
};

// The faults in force in this process.
const Faults& active();
// Turns `f` on for the rest of this process (a test's rank).
void inject(const Faults& f);

}  // namespace fsdp::detail::faults
