// Process-wide signal setup of the library (init_process_group): SIGPIPE ignored, and an
// interruptible rendezvous. Internal to src/comm. Thread-safety: call from the main thread.
#pragma once

#include <signal.h>

namespace fsdp::detail {

// Ignores SIGPIPE unless the program installed its own handler: a write to a dead peer's socket
// then fails with EPIPE and Gloo throws (an error naming the peer) instead of the kernel killing
// this rank without a word.
void ignore_sigpipe();

// While alive: SIGINT, SIGTERM and SIGHUP print one line and end the process by that signal (exit
// status 128 + signal: 130 for Ctrl-C), since a rendezvous holds nothing to save and its waits
// (TCP connects, store reads) do not poll a stop flag. The previous handlers come back on
// destruction. An ignored signal stays ignored. `enabled` false: does nothing.
class ExitOnSignal {
 public:
  explicit ExitOnSignal(bool enabled);
  ~ExitOnSignal();
  ExitOnSignal(const ExitOnSignal&) = delete;
  ExitOnSignal& operator=(const ExitOnSignal&) = delete;

 private:
  bool enabled_;
  struct sigaction old_[3];
};

}  // namespace fsdp::detail
