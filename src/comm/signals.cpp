#include "signals.h"

#include <unistd.h>

#include <cstring>

namespace fsdp::detail {
namespace {

constexpr int kSignals[3] = {SIGINT, SIGTERM, SIGHUP};

void exit_by_signal(int sig) {
  // Async-signal-safe only: write, signal, raise.
  static const char kMsg[] = "fsdp: interrupted during the rendezvous; exiting\n";
  (void)!::write(2, kMsg, sizeof kMsg - 1);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace

void ignore_sigpipe() {
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && !(old.sa_flags & SA_SIGINFO) &&
      old.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
}

ExitOnSignal::ExitOnSignal(bool enabled) : enabled_(enabled) {
  if (!enabled_) return;
  struct sigaction sa {};
  sa.sa_handler = exit_by_signal;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < 3; ++i) {
    ::sigaction(kSignals[i], nullptr, &old_[i]);
    // An ignored signal stays ignored (nohup, a shell's background job).
    if (!(old_[i].sa_flags & SA_SIGINFO) && old_[i].sa_handler == SIG_IGN) continue;
    ::sigaction(kSignals[i], &sa, nullptr);
  }
}

ExitOnSignal::~ExitOnSignal() {
  if (!enabled_) return;
  for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
}

}  // namespace fsdp::detail
