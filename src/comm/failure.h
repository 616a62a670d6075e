// Failure messages of collectives: what happened (the peer closed the connection, the connection
// was reset, a real timeout), which rank it points at where that can be known, and what to check.
// Internal to src/comm. Thread-safety: pure functions (alive() probes processes).
#pragma once

#include <fsdp/communicator.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "timeout_census.h"

namespace fsdp::detail {

enum class FailureKind {
  kPeerClosed,  // the peer closed its socket: its process exited (or closed the group)
  kReset,       // connection reset / broken pipe: the peer process died mid-transfer
  kTimeout,     // the limit passed with every connection intact
  kOther,       // any other transport or backend error
};

// Classifies a backend (Gloo) error text.
FailureKind classify_failure(const std::string& cause);

// The ranks a failure points at: the peers on this host whose process no longer exists (exited =
// true); else the peers whose advertised address appears in `cause` ("[10.0.0.2]:4242"), one of
// which closed the connection. Never `self` (this rank's index among `peers`); the ranks named are
// the peers' own (world) ranks.
struct Suspects {
  std::vector<int> ranks;
  bool exited = false;  // confirmed: their processes are gone
};
Suspects suspect_ranks(const std::string& cause, const std::vector<PeerInfo>& peers, int self,
                       const std::function<bool(int64_t pid)>& alive);

// Whether a failure with this cause asks the other ranks (census_of) before it is described: a
// timeout, and a closed or reset connection while every peer process of this host is alive (a
// peer's own timeout closes its connections; a remote peer may have exited or timed out), unless
// the communicator knows no peers (an elastic lane: a loss there is absorbed, not described).
bool wants_census(const std::string& cause, const std::vector<PeerInfo>& peers, int self);

// The whole message for a failed wait of `what` ("all_gather of 8192 bytes on communicator
// 'world' (rank 0 of ranks 0..1)") after `elapsed_s`, with limit `timeout`. For a timeout,
// `census` (when given) says which ranks did not arrive, and `state` (process_state by default)
// what a peer process of this host is doing: they are named as a dead peer is. A closed
// connection while some peer reported its own timeout in the census, and no peer process of this
// host has exited, is described as that timeout.
std::string describe_failure(const std::string& what, const std::string& cause, double elapsed_s,
                             std::chrono::milliseconds timeout, const std::vector<PeerInfo>& peers,
                             int self, const std::function<bool(int64_t pid)>& alive = nullptr,
                             const Census* census = nullptr,
                             const std::function<std::string(int64_t pid)>& state = nullptr);

// "rank 3" or "ranks 1, 2" for failure messages.
std::string rank_list(const std::vector<int>& ranks);

// Whether a process of this host with this pid is running: false once it has exited, even while
// its parent has not reaped it yet (a zombie).
bool process_alive(int64_t pid);

// This host's name (gethostname), as PeerInfo::host holds it.
std::string this_host();

}  // namespace fsdp::detail
