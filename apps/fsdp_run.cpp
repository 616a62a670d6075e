// fsdp-run: launches N local ranks of a program with the torchrun variables, prefixes their output
// with the rank, and stops every rank when one fails or when fsdp-run is interrupted.
//
// Deliberately free of torch headers: it builds in about a second and never starts an OpenMP pool
// (a process that forks after multi-threaded OpenMP work hangs its children, so ranks are started
// with fork+exec from this small process).
//
// Design:
//  - each rank runs in its own process group (so a terminal's Ctrl-C reaches only fsdp-run, which
//    then stops the ranks in order) with PR_SET_PDEATHSIG, so a killed fsdp-run leaves no orphans;
//  - stdout and stderr of each rank are pipes read by one poll() loop; complete lines are written
//    with one write() each so lines of different ranks never interleave;
//  - signals (SIGCHLD, SIGINT, SIGTERM, SIGHUP) are turned into bytes on a self-pipe and handled
//    in the same loop;
//  - no files, and a fresh free port on every launch: a crashed run leaves nothing behind.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "util/free_port.h"

namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  (void)!::write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

[[noreturn]] void die(const std::string& msg, int code = 2) {
  std::fprintf(stderr, "fsdp-run: %s\n", msg.c_str());
  std::exit(code);
}

// Writes all of `s` to `fd`, retrying on EINTR; a closed reader (EPIPE) is ignored.
void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

// A free TCP port on the loopback interface, below the ephemeral range (util/free_port.h).
int free_port() {
  const int port = fsdp::detail::free_loopback_port();
  if (port == 0)
    die(std::string("cannot find a free port on 127.0.0.1: ") + std::strerror(errno) +
        "; pass one with --master-port");
  return port;
}

int decode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + ::strsignal(sig) + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

// One output stream (stdout or stderr) of one rank: bytes in, prefixed complete lines out.
struct Stream {
  int fd = -1;     // read end of the pipe; -1 once closed
  int out_fd = 1;  // where prefixed lines go (1 or 2)
  std::string pending;

  // Emits every complete line; a partial line waits for its end unless `flush` or it grew large
  // (a progress bar that never prints '\n' must not buffer without bound).
  void emit(const std::string& prefix, bool flush) {
    size_t start = 0;
    std::string out;
    for (size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1) {
      out += prefix;
      out.append(pending, start, nl + 1 - start);
    }
    pending.erase(0, start);
    if (!pending.empty() && (flush || pending.size() >= 64 * 1024)) {
      out += prefix + pending + "\n";
      pending.clear();
    }
    if (!out.empty()) write_all(out_fd, out);
  }
};

struct RankProc {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Stream streams[2];
};

struct Options {
  int nproc = 1;
  int master_port = 0;
  double grace_s = 5.0;
  std::vector<std::string> command;
};

// Starts one rank; returns its pid. Exec failure is reported through a close-on-exec pipe so the
// launcher can stop with a clear message instead of N ranks printing the same error.
pid_t spawn_rank(const Options& opt, int rank, int port, RankProc& rp, std::string* exec_error) {
  int out[2], err[2], status_pipe[2];
  if (::pipe2(out, O_CLOEXEC) || ::pipe2(err, O_CLOEXEC) || ::pipe2(status_pipe, O_CLOEXEC))
    die(std::string("pipe(): ") + std::strerror(errno));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) die(std::string("fork(): ") + std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);
    // Die with the launcher, even if it is SIGKILLed.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(128 + SIGKILL);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) ::signal(sig, SIG_DFL);
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    const std::string r = std::to_string(rank), n = std::to_string(opt.nproc);
    ::setenv("RANK", r.c_str(), 1);
    ::setenv("LOCAL_RANK", r.c_str(), 1);
    ::setenv("GROUP_RANK", "0", 1);
    ::setenv("WORLD_SIZE", n.c_str(), 1);
    ::setenv("LOCAL_WORLD_SIZE", n.c_str(), 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    // Like torchrun: one OpenMP thread per rank unless the user chose otherwise.
    if (opt.nproc > 1) ::setenv("OMP_NUM_THREADS", "1", 0);
    std::vector<char*> argv;
    for (const auto& a : opt.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    const int e = errno;
    (void)!::write(status_pipe[1], &e, sizeof e);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here, so the group exists before we might signal it
  ::close(out[1]);
  ::close(err[1]);
  ::close(status_pipe[1]);
  int e = 0;
  ssize_t got;
  do {
    got = ::read(status_pipe[0], &e, sizeof e);
  } while (got < 0 && errno == EINTR);
  ::close(status_pipe[0]);
  if (got == sizeof e) {
    *exec_error = "cannot execute '" + opt.command[0] + "': " + std::strerror(e) +
                  (e == ENOENT ? " (give a path, or put the program on PATH)" : "");
  }
  rp.rank = rank;
  rp.pid = pid;
  rp.running = true;
  rp.streams[0].fd = out[0];
  rp.streams[0].out_fd = 1;
  rp.streams[1].fd = err[0];
  rp.streams[1].out_fd = 2;
  return pid;
}

class Launcher {
 public:
  explicit Launcher(Options opt) : opt_(std::move(opt)) {}

  int run() {
    install_signal_handlers();
    const int port = opt_.master_port > 0 ? opt_.master_port : free_port();
    ranks_.resize(opt_.nproc);
    for (int k = 0; k < opt_.nproc; ++k) {
      std::string exec_error;
      spawn_rank(opt_, k, port, ranks_[k], &exec_error);
      if (!exec_error.empty()) {
        std::fprintf(stderr, "fsdp-run: %s\n", exec_error.c_str());
        fail(127);
        break;
      }
    }
    loop();
    return exit_code_;
  }

 private:
  void install_signal_handlers() {
    if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
      die(std::string("pipe(): ") + std::strerror(errno));
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
  }

  // Starts stopping every running rank: SIGTERM to its process group now, SIGKILL after the grace
  // period (see loop()). The first reason wins the exit code.
  void fail(int code) {
    if (stopping_) return;
    stopping_ = true;
    exit_code_ = code;
    kill_deadline_ =
        Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(opt_.grace_s * 1000));
    signal_all(SIGTERM);
  }

  void signal_all(int sig) {
    for (auto& r : ranks_)
      if (r.running) ::kill(-r.pid, sig);
  }

  void on_launcher_signal(int sig) {
    if (sig == SIGCHLD) return reap();
    if (stopping_) {
      // A second Ctrl-C: do not wait for the grace period.
      signal_all(SIGKILL);
      return;
    }
    std::fprintf(stderr, "fsdp-run: received signal %d (%s), stopping all ranks\n", sig,
                 ::strsignal(sig));
    fail(128 + sig);
  }

  void reap() {
    for (auto& r : ranks_) {
      if (!r.running) continue;
      siginfo_t info{};
      // Peek without reaping: while the rank is a zombie its pid (= its process group id) cannot be
      // reused, so leftovers of its group can be killed safely before it is reaped.
      if (::waitid(P_PID, r.pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0)
        continue;
      ::kill(-r.pid, SIGKILL);
      int status = 0;
      ::waitpid(r.pid, &status, 0);
      r.running = false;
      r.status = status;
      const int code = decode_status(status);
      if (code != 0 && !stopping_) {
        std::fprintf(stderr, "fsdp-run: rank %d %s; stopping the other ranks\n", r.rank,
                     describe_status(status).c_str());
        fail(code);
      }
    }
  }

  bool any_running() const {
    for (const auto& r : ranks_)
      if (r.running) return true;
    return false;
  }

  void loop() {
    std::optional<Clock::time_point> drain_deadline;
    for (;;) {
      const bool running = any_running();
      if (!running && !drain_deadline) {
        // Every rank is gone; give leftover writers a moment, then stop reading.
        drain_deadline = Clock::now() + std::chrono::seconds(1);
      }
      std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
      std::vector<Stream*> owners{nullptr};
      for (auto& r : ranks_)
        for (auto& s : r.streams)
          if (s.fd >= 0) {
            fds.push_back({s.fd, POLLIN, 0});
            owners.push_back(&s);
          }
      if (!running && fds.size() == 1) break;
      if (drain_deadline && Clock::now() >= *drain_deadline) break;

      int timeout_ms = 1000;
      auto shorten = [&](Clock::time_point t) {
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
        timeout_ms = std::max<int>(0, std::min<int64_t>(timeout_ms, ms + 1));
      };
      if (stopping_ && running && !killed_) shorten(kill_deadline_);
      if (drain_deadline) shorten(*drain_deadline);
      const int n = ::poll(fds.data(), fds.size(), timeout_ms);
      if (n < 0 && errno != EINTR) die(std::string("poll(): ") + std::strerror(errno));

      if (n > 0 && (fds[0].revents & POLLIN)) {
        unsigned char sigs[64];
        ssize_t got = ::read(g_signal_pipe[0], sigs, sizeof sigs);
        for (ssize_t i = 0; i < got; ++i) on_launcher_signal(sigs[i]);
      }
      for (size_t i = 1; n > 0 && i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        read_stream(*owners[i]);
      }
      reap();  // also catches exits whose SIGCHLD coalesced with another
      if (stopping_ && !killed_ && any_running() && Clock::now() >= kill_deadline_) {
        std::fprintf(stderr,
                     "fsdp-run: ranks still running %.1f s after SIGTERM; sending SIGKILL\n",
                     opt_.grace_s);
        signal_all(SIGKILL);
        killed_ = true;
      }
    }
    // Flush partial last lines of streams still open (held by leftovers we stopped reading).
    for (auto& r : ranks_)
      for (auto& s : r.streams) {
        s.emit(prefix(r.rank), true);
        if (s.fd >= 0) ::close(s.fd);
        s.fd = -1;
      }
  }

  std::string prefix(int rank) const { return "[rank " + std::to_string(rank) + "] "; }

  void read_stream(Stream& s) {
    char buf[65536];
    ssize_t n = ::read(s.fd, buf, sizeof buf);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    const int rank = rank_of(s);
    if (n <= 0) {
      s.emit(prefix(rank), true);
      ::close(s.fd);
      s.fd = -1;
      return;
    }
    s.pending.append(buf, static_cast<size_t>(n));
    s.emit(prefix(rank), false);
  }

  int rank_of(const Stream& s) const {
    for (const auto& r : ranks_)
      if (&r.streams[0] == &s || &r.streams[1] == &s) return r.rank;
    return -1;
  }

  Options opt_;
  std::vector<RankProc> ranks_;
  bool stopping_ = false;
  bool killed_ = false;
  int exit_code_ = 0;
  Clock::time_point kill_deadline_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp-run: runs PROG on N local ranks (processes) with the torchrun variables RANK, "
      "LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free "
      "port unless --master-port is given); OMP_NUM_THREADS=1 unless already set.\n"
      "Every line a rank prints is prefixed with '[rank k] ' (stdout to stdout, stderr to stderr). "
      "When a rank exits non-zero or dies by a signal, the other ranks get SIGTERM, then SIGKILL "
      "after the grace period, and fsdp-run exits with that rank's status (128+signal for a "
      "signal). Ctrl-C (SIGINT) or SIGTERM stops all ranks the same way (a second Ctrl-C kills "
      "at once) and exits with 128+signal.\n\n"
      "Usage: fsdp-run -n N [--master-port P] [--] PROG [ARGS...]\n"
      "Example: fsdp-run -n 2 -- build/bin/fsdp-bench --comm"};
  Options opt;
  app.add_option("-n,--nproc,--nproc-per-node", opt.nproc, "number of ranks to start")
      ->required()
      ->check(CLI::Range(1, 1024));
  app.add_option("--master-port", opt.master_port,
                 "TCP port for rank 0's rendezvous store (default: a free port)")
      ->check(CLI::Range(1, 65535));
  app.add_option("--grace-period", opt.grace_s,
                 "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->default_val(5.0)
      ->check(CLI::Range(0.0, 3600.0));
  app.prefix_command();  // everything from PROG on belongs to PROG
  app.footer("PROG and its arguments follow the options; '--' before PROG is optional.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  opt.command = app.remaining();
  if (!opt.command.empty() && opt.command.front() == "--") opt.command.erase(opt.command.begin());
  if (opt.command.empty()) die("no program given; usage: fsdp-run -n N [--] PROG [ARGS...]");
  return Launcher(std::move(opt)).run();
}
