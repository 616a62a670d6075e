// Lane loss: the replicate lanes of an elastic job (fsdp/elastic.h) may lose a peer replica in the
// middle of a step. Their collectives must then neither stop the rank nor leave it waiting: the
// rest of the step still has to run, so that the ranks of this replica issue the same collectives
// on their own lanes, and the step is thrown away at its commit (ElasticReplicas::commit).
//
// Once a collective of a lossy communicator (or of a lane of it) has failed, the communicator is
// lost: that collective and every later one complete at once with a stand-in result, as if every
// peer were a copy of this rank (an all-gather repeats this rank's input, a sum multiplies it by
// the size, an average and a broadcast leave it as it is). The stand-in keeps the library's own
// cross-replica checks consistent (every row agrees), and its numbers are never used: the step is
// redone over the new membership.
//
// A lossy collective runs on private copies of the tensors it writes and copies the result back
// only at a successful wait on the waiting thread: a collective abandoned after the loss may still
// be finishing on the backend's thread, and must write into nothing the training uses.
// Internal to src/comm and src/elastic. Thread-safety: LaneLoss may be marked and read from any
// thread.
#pragma once

#include <fsdp/communicator.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "util/mutex.h"

namespace fsdp::detail {

class LaneLoss {
 public:
  void mark(const std::string& why);
  bool lost() const { return lost_.load(std::memory_order_acquire); }
  std::string reason() const;

 private:
  std::atomic<bool> lost_{false};
  mutable Mutex mu_;
  std::string reason_ FSDP_GUARDED_BY(mu_);
};

// A Work that completes with `inner`, then runs `copy_back`; when `inner` fails, or `loss` is
// already marked by the time it is waited for, marks `loss` and runs `stand_in` instead, and
// succeeds. `stand_in` and `copy_back` run once, on the waiting thread.
Work tolerate(Work inner, std::shared_ptr<LaneLoss> loss, std::function<void()> stand_in,
              std::function<void()> copy_back);
// A Work complete at once, after `stand_in` ran: a collective of a lost communicator.
Work stood_in(std::function<void()> stand_in);

}  // namespace fsdp::detail
