// What a Work holds, and the registry of broken groups its waits consult.
//
// Broken groups: once a collective of a world (or of a lane split from it) has failed, the group
// is broken: Gloo cannot abort, so every collective still queued or in flight would wait out its
// own full timeout, one after the other (an exit took 2-5x the limit). Later waits fail at once
// instead, and a broken communicator's process group is left undestroyed (its worker threads
// would be joined mid-collective); the process is expected to exit. Keyed by the world's store,
// which the world and all its lanes share.
#pragma once

#include <fsdp/communicator.h>

#include <functional>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "util/mutex.h"

namespace fsdp {
namespace detail {
class LaneLoss;
}

struct Work::Impl {
  std::vector<Work> before;  // waited first (Work::then)
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::function<void()> finish;  // local post-processing, run once on the waiting thread
  std::shared_ptr<const Work::Digests> digests;  // with_digests, kept by then()
  std::string what;      // "all_gather of 4096 bytes on 'world' (rank 0 of 2)"
  std::string op, lane;  // for the timeline
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<CommStats> stats;
  int64_t issued_us = 0;
  std::shared_ptr<const std::vector<PeerInfo>> peers;
  int rank = 0;
  const c10d::Store* group = nullptr;  // the world's store: identifies the world and its lanes
  // For a timeout's census (timeout_census.h): the world's store, and this communicator's name
  // and size (its ranks report under the name).
  c10::intrusive_ptr<c10d::Store> store;
  int size = 1;
  detail::Mutex mu;
  bool done FSDP_GUARDED_BY(mu) = false;
  std::string error FSDP_GUARDED_BY(mu);  // set by a failed wait; every later wait rethrows it
  // A lossy communicator's collective (lane_loss.h): a failure marks `loss` and runs `stand_in`
  // instead of throwing; once `loss` is marked, waiting runs `stand_in` at once.
  std::shared_ptr<detail::LaneLoss> loss;
  std::function<void()> stand_in;
};

namespace detail {
// Why `group` is broken (the first failure's message), or empty while it is not.
std::string broken_reason(const c10d::Store* group);
// Keeps a broken communicator's process group for the life of the process, never destroyed (and
// reachable: a released pointer would be reported as leaked by LeakSanitizer).
void keep_undestroyed(c10::intrusive_ptr<c10d::ProcessGroup> pg);
}  // namespace detail

}  // namespace fsdp
