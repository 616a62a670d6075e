// Building the process group (Gloo's full-mesh connect) under the rendezvous's one deadline, and a
// failure message that names the ranks which did not connect. Internal to src/comm.
// Thread-safety: call from one thread (connect_mesh runs the construction on a helper thread).
#pragma once

#include <fsdp/init.h>

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

namespace fsdp::detail {

// The store key under which Gloo's full-mesh connect publishes rank `rank`'s pair addresses
// (device 0), relative to the store passed to the process group.
std::string mesh_address_key(int rank);

// The ranks in 0..world_size-1 for which `key(rank)` is not in `store`. Throws what the store
// throws (an unreachable store).
std::vector<int> ranks_without_key(c10d::Store& store, int world_size,
                                   const std::function<std::string(int)>& key);

// The message for a connect stage that failed: `cause` is Gloo's error, or the deadline.
// `unpublished`: the ranks that never published their connection addresses (they reached the store
// but stalled or died before connecting); empty: all did, and a connection itself failed.
std::string mesh_connect_error(const RendezvousInfo& info, std::chrono::milliseconds timeout,
                               const std::vector<PeerInfo>& peers,
                               const std::vector<int>& unpublished, std::string cause);

// Constructs the process group over `store` (the rendezvous store under the "fsdp" prefix) and
// waits for it until `deadline`, but at least min(timeout, 2 s): every rank's connects are bounded
// by the timeout inside Gloo, and the whole stage by the deadline. On failure or when the deadline
// passes, reads which ranks published their addresses and throws CommError naming the others. A
// construction still running at the deadline is left to Gloo's own timeout on its thread.
c10::intrusive_ptr<c10d::ProcessGroup> connect_mesh(
    const c10::intrusive_ptr<c10d::Store>& store, const RendezvousInfo& info,
    std::chrono::milliseconds timeout, std::chrono::steady_clock::time_point deadline,
    const std::string& backend, const std::string& bind_host, const std::vector<PeerInfo>& peers);

}  // namespace fsdp::detail
