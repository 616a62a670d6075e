// Multi-rank test harness: runs a test body on N ranks as N real processes talking c10d over
// loopback.
//
// Why processes, not threads: a rank must own its autograd engine state, its OpenMP pool and its
// process-wide LibTorch settings, exactly as a user's rank does; a hang or crash must fail only the
// test. The parent re-executes the test binary (fork+exec: forking a process that already ran
// multi-threaded OpenMP work hangs the child) with --gtest_filter naming the current test and the
// torchrun variables set; in the child, run_ranks() runs the body for that rank. The parent waits
// with a per-test timeout, kills every rank when one fails or the time is up, and reports each
// rank's exit status and output.
//
// FSDP_TEST_VERBOSE=1 prints every rank's output after the run.
// Thread-safety: call from the gtest main thread.
#pragma once

#include <fsdp/communicator.h>
#include <fsdp/error.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace fsdp::testing {

struct Rank {
  int rank = 0;
  int size = 1;
  // The rank's communicator over loopback; created on first use (rendezvous is collective).
  std::shared_ptr<Communicator> world();
  std::shared_ptr<Communicator> world_;
  // A new lane of the world whose transport is `transport` (FSDP_TRANSPORT while it is built):
  // "shm", "tcp" or "collective". Collective over the ranks, like Communicator::split.
  std::shared_ptr<Communicator> lane_over(const std::string& transport);
};

// FSDP_TRANSPORT set to `transport` for the communicators built in its scope (split, subgroup,
// init_mesh; lanes keep their communicator's), restored after; "" leaves it as it is.
class ScopedTransport {
 public:
  explicit ScopedTransport(const std::string& transport);
  ~ScopedTransport();
  ScopedTransport(const ScopedTransport&) = delete;
  ScopedTransport& operator=(const ScopedTransport&) = delete;

 private:
  bool set_ = false;
  std::optional<std::string> before_;
};

struct RunOptions {
  std::chrono::seconds timeout{120};       // the whole multi-rank run
  double collective_timeout_s = 60;        // FSDP_TIMEOUT_S inside the ranks
  std::map<std::string, std::string> env;  // extra environment for the ranks
  bool expect_failure = false;             // a rank is expected to exit non-zero
};

struct RunResult {
  std::vector<int> exit_codes;      // per rank: exit status, or 128 + signal
  std::vector<std::string> output;  // per rank: stdout + stderr
  bool timed_out = false;
};

// In the parent: spawns `world_size` ranks running this test and fails the test (gtest) unless
// all exit 0 (or, with expect_failure, returns the result for the caller to assert on).
// In a rank: runs body(rank) and returns; gtest assertions inside the body fail the rank.
RunResult run_ranks(int world_size, const std::function<void(Rank&)>& body,
                    const RunOptions& options = {});

// True inside a rank process spawned by run_ranks.
bool in_rank_process();

// A directory for the current test that its rank processes share. In a rank process: the value of
// the environment variable `env` (pass the directory to the ranks with RunOptions::env[env]).
// Otherwise: made fresh and empty under the system's temporary directory, named `prefix`, the
// test's suite and name, and the process id.
std::string test_scratch_dir(const char* env, const std::string& prefix);

// Runs `prog args...` to completion with a timeout; returns exit code (128+sig when killed) and
// the combined output.
struct ProcResult {
  int exit_code = -1;
  std::string output;
  bool timed_out = false;
  double seconds = 0;
};
ProcResult run_process(const std::vector<std::string>& argv, std::chrono::seconds timeout,
                       const std::map<std::string, std::string>& env = {});

// The directory holding the built programs (build/bin).
std::string bin_dir();

// A free TCP port on loopback, below the ephemeral range (util/free_port.h; the program under
// test binds it right after); 0 when none could be had.
int free_port();

// torchrun of the torch the build uses (the venv's, or Debian's python3-torch), as users type it,
// followed by `args`. Debian's torchrun 1.13 on Python 3.11 crashes before starting its workers
// unless its output is redirected (torch's bug, gone in 2.x): there it gets --redirects 1 --tee 1,
// as the README says, and 2.x's --no-python is spelled --no_python. has_torchrun() is false where
// that torch is not installed.
bool has_torchrun();
std::vector<std::string> torchrun_command(const std::vector<std::string>& args);

// Runs `fn` and expects an fsdp::Error whose message contains every one of `parts`.
template <class F>
void expect_error(F&& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing '" << *parts.begin() << "'";
  } catch (const fsdp::Error& e) {
    std::string msg = e.what();
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nmissing: " << p;
  }
}

// Built with ASan and UBSan (FSDP_SANITIZE, `make sanitize`). Resident-set sizes mean nothing
// there: ASan's shadow memory and the freed blocks it quarantines are resident too, so tests that
// bound them skip (kRssUnderSanitizer says why).
#ifdef FSDP_SANITIZE
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
inline constexpr const char* kRssUnderSanitizer =
    "resident-set sizes are not this program's memory under AddressSanitizer (its shadow memory "
    "and quarantine of freed blocks are resident too)";

}  // namespace fsdp::testing
