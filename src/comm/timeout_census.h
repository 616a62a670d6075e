// Who did not arrive at a collective that timed out. A hung rank (stopped by SIGSTOP, a debugger,
// a swapped-out host, a kernel stuck in I/O) keeps its connections open, so a timeout alone names
// nobody. After a timeout each rank reports on the store that it is waiting in a collective of
// the communicator (census_of), and how its wait ended, and waits a short grace for the others'
// reports: the ranks that did not report are the ones that never reached a collective of it.
// Peers on this host are also named by their process state (stopped, traced, in uninterruptible
// sleep). A rank whose wait times out closes its connections, so a peer still waiting sees "closed
// by peer" before its own limit: the reports' `timed_out` tells it that the closing was a
// timeout, not an exit.
// Internal to src/comm. Thread-safety: census_of may run on any thread; it blocks at most `grace`.
#pragma once

#include <fsdp/communicator.h>

#include <chrono>
#include <string>
#include <vector>

namespace fsdp::detail {

struct Census {
  bool complete = false;       // the store answered
  std::vector<int> absent;     // ranks of the communicator that did not report within the grace
  std::vector<int> timed_out;  // ranks (not this one) that reported their own wait timing out
};

// This rank (`rank` of `size`) reports under "fsdp/census/<key>/" whether its own wait timed out
// (`timed_out`) or failed otherwise (a connection closed), and reads the others' reports for up to
// `grace`; a rank whose wait did not time out stops after a second if no peer reported a timeout
// by then (`absent` is then partial, and `timed_out` empty). A store that does not answer within
// `grace` (its server, rank 0 in a hand-launched job, may be the hung rank) gives complete = false.
Census census_of(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int rank,
                 int size, std::chrono::milliseconds grace, bool timed_out);

// The grace after a timeout of `timeout`: long enough for the other ranks to time out too.
std::chrono::milliseconds census_grace(std::chrono::milliseconds timeout);

// What a process of this host is doing when it is not running normally: "stopped (SIGSTOP or
// Ctrl-Z: state T)", "stopped by a debugger (state t)", "in uninterruptible sleep (state D: disk
// or network file system I/O)"; "" for a running or sleeping process, or one not on this host.
std::string process_state(int64_t pid);

}  // namespace fsdp::detail
