// fsdp-run: launches N local ranks of a program with the torchrun variables, prefixes their output
// with the rank, and stops every rank when one fails or when fsdp-run is interrupted.
// With --replicas R, the ranks form R replicas (HSDP jobs that survive the loss of a replica): a
// coordinator process runs first, each replica is its own rendezvous, and a failing rank stops only
// its replica, which is relaunched while the job's restart budget lasts.
//
// Deliberately free of torch headers: it builds in about a second and never starts an OpenMP pool
// (a process that forks after multi-threaded OpenMP work hangs its children, so ranks are started
// with fork+exec from this small process).
//
// Design:
//  - each rank (and the coordinator) runs in its own process group (so a terminal's Ctrl-C reaches
//    only fsdp-run, which then stops the ranks in order) with PR_SET_PDEATHSIG, so a killed
//    fsdp-run leaves no orphans;
//  - stdout and stderr of each child are pipes read by one poll() loop; complete lines are written
//    with one write() each so lines of different ranks never interleave;
//  - signals (SIGCHLD, SIGINT, SIGTERM, SIGHUP) are turned into bytes on a self-pipe and handled
//    in the same loop; so are the timers (grace periods, restart delays, the coordinator's start);
//  - the ranks of one launch form a replica (plain mode: one replica of N ranks whose failure
//    stops the job); a replica runs, stops, waits to restart, finishes or is lost;
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
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <utility>
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

Clock::time_point after_seconds(double s) {
  return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

// True when a TCP connection to 127.0.0.1:port is accepted within 100 ms.
bool can_connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  if (!ok && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof err;
    ok = ::poll(&p, 1, 100) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 &&
         err == 0;
  }
  ::close(fd);
  return ok;
}

// One output stream (stdout or stderr) of one child: bytes in, prefixed complete lines out.
struct Stream {
  int fd = -1;     // read end of the pipe; -1 once closed
  int out_fd = 1;  // where prefixed lines go (1 or 2)
  std::string prefix;
  std::string pending;

  // Emits every complete line; a partial line waits for its end unless `flush` or it grew large
  // (a progress bar that never prints '\n' must not buffer without bound).
  void emit(bool flush) {
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

  void close_fd() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }

  // Reads what is there; at end of file, flushes the partial line and closes.
  void read_some() {
    char buf[65536];
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
      emit(true);
      close_fd();
      return;
    }
    pending.append(buf, static_cast<size_t>(n));
    emit(false);
  }
};

// One child process: a rank or the coordinator.
struct Proc {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
};

// What a child runs: `argv` with `env` set (overwriting), and OMP_NUM_THREADS=1 unless set when
// `one_omp_thread`.
struct SpawnSpec {
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;
  bool one_omp_thread = false;
};

// In the forked child: becomes the program, or writes exec's errno to `status_fd` and exits 127.
[[noreturn]] void exec_child(const SpawnSpec& spec, pid_t parent, int out_fd, int err_fd,
                             int status_fd) {
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
  ::dup2(out_fd, 1);
  ::dup2(err_fd, 2);
  for (const auto& [key, value] : spec.env) ::setenv(key.c_str(), value.c_str(), 1);
  // Like torchrun: one OpenMP thread per rank unless the user chose otherwise.
  if (spec.one_omp_thread) ::setenv("OMP_NUM_THREADS", "1", 0);
  std::vector<char*> argv;
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  const int e = errno;
  (void)!::write(status_fd, &e, sizeof e);
  ::_exit(127);
}

// Starts one child whose stdout and stderr feed `out` and `err`. Returns exec's errno (0 when the
// program started): exec failure is reported through a close-on-exec pipe so the launcher can
// stop with a clear message instead of N ranks printing the same error.
int spawn(const SpawnSpec& spec, Proc& proc, Stream& out, Stream& err) {
  int o[2], e[2], status_pipe[2];
  if (::pipe2(o, O_CLOEXEC) || ::pipe2(e, O_CLOEXEC) || ::pipe2(status_pipe, O_CLOEXEC))
    die(std::string("pipe(): ") + std::strerror(errno));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) die(std::string("fork(): ") + std::strerror(errno));
  if (pid == 0) exec_child(spec, parent, o[1], e[1], status_pipe[1]);
  ::setpgid(pid, pid);  // also here, so the group exists before we might signal it
  ::close(o[1]);
  ::close(e[1]);
  ::close(status_pipe[1]);
  int exec_errno = 0;
  ssize_t got;
  do {
    got = ::read(status_pipe[0], &exec_errno, sizeof exec_errno);
  } while (got < 0 && errno == EINTR);
  ::close(status_pipe[0]);
  proc.pid = pid;
  proc.running = true;
  out.fd = o[0];
  out.out_fd = 1;
  err.fd = e[0];
  err.out_fd = 2;
  return got == sizeof exec_errno ? exec_errno : 0;
}

// Reaps `p` if it has exited; true then. Its process group is killed first: while the child is a
// zombie its pid (= its process group id) cannot be reused, so leftovers of its group can be killed
// safely before it is reaped.
bool reap_one(Proc& p) {
  if (!p.running) return false;
  siginfo_t info{};
  if (::waitid(P_PID, p.pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0)
    return false;
  ::kill(-p.pid, SIGKILL);
  int status = 0;
  ::waitpid(p.pid, &status, 0);
  p.running = false;
  p.status = status;
  return true;
}

// Stopping processes: SIGTERM when it starts, SIGKILL at `deadline` (the grace period).
struct Stop {
  bool active = false;
  bool killed = false;
  Clock::time_point deadline;
};

struct Options {
  int nproc = 1;
  int master_port = 0;
  double grace_s = 5.0;
  int replicas = 1;
  bool elastic = false;  // replicas mode (--replicas R, R > 1 or with a restart option)
  int max_restarts = 0;
  double restart_delay_s = 1.0;
  std::vector<std::string> command;
};

// kPending: not launched yet (the coordinator is starting); kStopping: a rank failed (or the job
// stops) and the others are being stopped; kWaiting: its restart delay runs.
enum class State { kPending, kRunning, kStopping, kWaiting, kFinished, kLost };

struct Replica {
  int id = 0;
  int restart = 0;         // FSDP_REPLICA_RESTART of the current launch
  int restart_number = 0;  // which of the job's --max-restarts the next launch uses
  int port = 0;            // MASTER_PORT of the current launch
  State state = State::kPending;
  std::vector<Proc> ranks;
  Stop stop;
  Clock::time_point restart_at;
};

// The coordinator program: FSDP_COORDINATOR_BIN, else fsdp-coordinator next to this executable.
std::string coordinator_path() {
  if (const char* p = std::getenv("FSDP_COORDINATOR_BIN"); p && *p) return p;
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return "fsdp-coordinator";
  std::string dir(self, static_cast<size_t>(n));
  return dir.substr(0, dir.rfind('/') + 1) + "fsdp-coordinator";
}

// Seconds to wait for the coordinator to accept connections (FSDP_COORDINATOR_TIMEOUT_S, 30).
double coordinator_timeout_s() {
  const char* v = std::getenv("FSDP_COORDINATOR_TIMEOUT_S");
  const double s = v ? std::strtod(v, nullptr) : 0;
  return s > 0 ? s : 30.0;
}

class Launcher {
 public:
  explicit Launcher(Options opt) : opt_(std::move(opt)), size_(opt_.nproc / opt_.replicas) {
    replicas_.resize(opt_.replicas);
    for (int r = 0; r < opt_.replicas; ++r) replicas_[r].id = r;
  }

  int run() {
    install_signal_handlers();
    if (opt_.elastic)
      start_coordinator();
    else
      launch_all();
    loop();
    return exit_code();
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

  // ---- starting ----

  // Spawns `spec` with output prefixed by `prefix`; exec's errno (0: started).
  int spawn_child(const SpawnSpec& spec, Proc& proc, const std::string& prefix) {
    streams_.emplace_back();
    streams_.back().prefix = prefix;
    streams_.emplace_back();
    streams_.back().prefix = prefix;
    return spawn(spec, proc, streams_[streams_.size() - 2], streams_.back());
  }

  void start_coordinator() {
    coord_bin_ = coordinator_path();
    coord_port_ = fsdp::detail::free_loopback_port();
    if (coord_port_ == 0)
      die(std::string("cannot find a free port on 127.0.0.1 for the coordinator: ") +
          std::strerror(errno));
    SpawnSpec spec{{coord_bin_, "--port", std::to_string(coord_port_)}, {}, false};
    coord_deadline_ = after_seconds(coordinator_timeout_s());
    if (const int e = spawn_child(spec, coord_, "[coordinator] ")) {
      std::fprintf(stderr,
                   "fsdp-run: cannot execute the coordinator '%s': %s (build fsdp-coordinator "
                   "next to fsdp-run, or set FSDP_COORDINATOR_BIN to its path)\n",
                   coord_bin_.c_str(), std::strerror(e));
      fail_job(127);
    }
  }

  // Once the coordinator accepts connections, launches the replicas; stops the job when it does
  // not within its time.
  void await_coordinator() {
    if (!opt_.elastic || coord_ready_ || stopping_ || !coord_.running) return;
    if (Clock::now() < next_probe_) return;
    next_probe_ = Clock::now() + std::chrono::milliseconds(20);
    if (can_connect(coord_port_)) {
      coord_ready_ = true;
      launch_all();
    } else if (Clock::now() >= coord_deadline_) {
      std::fprintf(stderr,
                   "fsdp-run: the coordinator '%s' did not accept connections on 127.0.0.1:%d "
                   "within %g s; stopping it\n",
                   coord_bin_.c_str(), coord_port_, coordinator_timeout_s());
      fail_job(1);
    }
  }

  void launch_all() {
    for (auto& rep : replicas_) {
      if (stopping_) return;
      launch(rep);
    }
  }

  // A MASTER_PORT for a launch of `self`: free, and not one a running replica or the coordinator
  // uses (the ranks bind it later). 0 when none could be found.
  int replica_port(const Replica& self) const {
    if (!opt_.elastic) return opt_.master_port > 0 ? opt_.master_port : free_port();
    for (int attempt = 0; attempt < 16; ++attempt) {
      const int port = fsdp::detail::free_loopback_port();
      if (port == 0) return 0;
      bool taken = port == coord_port_;
      for (const auto& rep : replicas_)
        taken |= &rep != &self && rep.port == port && any_running(rep);
      if (!taken) return port;
    }
    return 0;
  }

  SpawnSpec rank_spec(const Replica& rep, int k) const {
    const std::string r = std::to_string(k), n = std::to_string(size_);
    SpawnSpec spec{opt_.command,
                   {{"RANK", r},
                    {"LOCAL_RANK", r},
                    {"GROUP_RANK", "0"},
                    {"WORLD_SIZE", n},
                    {"LOCAL_WORLD_SIZE", n},
                    {"MASTER_ADDR", "127.0.0.1"},
                    {"MASTER_PORT", std::to_string(rep.port)}},
                   opt_.nproc > 1};
    if (opt_.elastic) {
      spec.env.insert(spec.env.end(),
                      {{"FSDP_ELASTIC_COORDINATOR", "127.0.0.1:" + std::to_string(coord_port_)},
                       {"FSDP_REPLICA_ID", std::to_string(rep.id)},
                       {"FSDP_MIN_REPLICAS", std::to_string(opt_.replicas)},
                       {"FSDP_REPLICA_RESTART", std::to_string(rep.restart)}});
    }
    return spec;
  }

  std::string rank_prefix(const Replica& rep, int k) const {
    if (!opt_.elastic) return "[rank " + std::to_string(k) + "] ";
    return "[replica " + std::to_string(rep.id) + " rank " + std::to_string(k) + "] ";
  }

  // Starts the replica's ranks; an exec failure (or no free port) stops the job.
  void launch(Replica& rep) {
    rep.port = replica_port(rep);
    if (rep.port == 0) {
      std::fprintf(stderr, "fsdp-run: cannot find a free port on 127.0.0.1 for replica %d: %s\n",
                   rep.id, std::strerror(errno));
      return fail_job(1);
    }
    rep.state = State::kRunning;
    rep.stop = Stop{};
    rep.ranks.assign(size_, Proc{});
    for (int k = 0; k < size_; ++k) {
      rep.ranks[k].rank = k;
      if (const int e = spawn_child(rank_spec(rep, k), rep.ranks[k], rank_prefix(rep, k))) {
        std::fprintf(stderr, "fsdp-run: cannot execute '%s': %s%s\n", opt_.command[0].c_str(),
                     std::strerror(e),
                     e == ENOENT ? " (give a path, or put the program on PATH)" : "");
        return fail_job(127);
      }
    }
  }

  // ---- stopping ----

  static void start_stop(Stop& stop, double grace_s) {
    stop.active = true;
    stop.killed = false;
    stop.deadline = after_seconds(grace_s);
  }

  static bool any_running(const Replica& rep) {
    for (const auto& p : rep.ranks)
      if (p.running) return true;
    return false;
  }

  static void signal_ranks(const Replica& rep, int sig) {
    for (const auto& p : rep.ranks)
      if (p.running) ::kill(-p.pid, sig);
  }

  void stop_replica(Replica& rep) {
    rep.state = State::kStopping;
    start_stop(rep.stop, opt_.grace_s);
    signal_ranks(rep, SIGTERM);
  }

  // Starts stopping the whole job: every running replica now, the coordinator once they are gone
  // (tick()). The first reason wins the exit code.
  void fail_job(int code) {
    if (stopping_) return;
    stopping_ = true;
    job_code_ = code;
    for (auto& rep : replicas_)
      if (rep.state == State::kRunning) stop_replica(rep);
  }

  // A second Ctrl-C: no grace period.
  void kill_everything() {
    for (auto& rep : replicas_) {
      signal_ranks(rep, SIGKILL);
      rep.stop.killed = true;
    }
    if (coord_.running) ::kill(-coord_.pid, SIGKILL);
    coord_stop_.killed = true;
  }

  // SIGKILL for whatever outlived its grace period.
  void escalate() {
    const auto now = Clock::now();
    for (auto& rep : replicas_) {
      if (!rep.stop.active || rep.stop.killed || now < rep.stop.deadline || !any_running(rep))
        continue;
      if (opt_.elastic)
        std::fprintf(stderr,
                     "fsdp-run: replica %d's ranks still running %.1f s after SIGTERM; sending "
                     "SIGKILL\n",
                     rep.id, opt_.grace_s);
      else
        std::fprintf(stderr,
                     "fsdp-run: ranks still running %.1f s after SIGTERM; sending SIGKILL\n",
                     opt_.grace_s);
      signal_ranks(rep, SIGKILL);
      rep.stop.killed = true;
    }
    if (coord_stop_.active && !coord_stop_.killed && coord_.running &&
        now >= coord_stop_.deadline) {
      std::fprintf(stderr,
                   "fsdp-run: the coordinator is still running %.1f s after SIGTERM; sending "
                   "SIGKILL\n",
                   opt_.grace_s);
      ::kill(-coord_.pid, SIGKILL);
      coord_stop_.killed = true;
    }
  }

  // True while a replica has ranks running or waits to restart.
  bool replicas_active() const {
    for (const auto& rep : replicas_)
      if (rep.state == State::kWaiting || any_running(rep)) return true;
    return false;
  }

  // The coordinator outlives the replicas: it is stopped once none is running or waiting.
  void stop_coordinator_when_done() {
    if (!coord_.running || coord_stop_.active || replicas_active()) return;
    if (!coord_ready_ && !stopping_) return;  // still starting
    start_stop(coord_stop_, opt_.grace_s);
    ::kill(-coord_.pid, SIGTERM);
  }

  // ---- replica lifecycle ----

  int replicas_in(std::initializer_list<State> states) const {
    int n = 0;
    for (const auto& rep : replicas_)
      n += std::find(states.begin(), states.end(), rep.state) != states.end();
    return n;
  }

  void on_rank_exit(Replica& rep, const Proc& p) {
    const int code = decode_status(p.status);
    if (code == 0 || stopping_ || rep.state != State::kRunning) return;
    if (!opt_.elastic) {
      std::fprintf(stderr, "fsdp-run: rank %d %s; stopping the other ranks\n", p.rank,
                   describe_status(p.status).c_str());
      return fail_job(code);
    }
    if (first_failure_ < 0) first_failure_ = code;
    const std::string id = std::to_string(rep.id);
    std::string msg = "fsdp-run: replica " + id + " rank " + std::to_string(p.rank) + " " +
                      describe_status(p.status);
    if (size_ > 1) msg += "; stopping replica " + id + "'s other ranks";
    std::fprintf(stderr, "%s\n", msg.c_str());
    stop_replica(rep);
  }

  // All of the replica's ranks are reaped: it finished, or it failed and restarts or is lost.
  void settle(Replica& rep) {
    if (rep.state == State::kRunning) {
      rep.state = State::kFinished;
      return;
    }
    rep.stop = Stop{};
    if (stopping_) {
      rep.state = State::kLost;
    } else if (replicas_in({State::kFinished}) > 0) {
      // The training is done (a replica finished it): a relaunch would find nothing to join.
      rep.state = State::kLost;
      std::fprintf(stderr, "fsdp-run: replica %d is not restarted: replica %d finished the job\n",
                   rep.id, first_finished());
    } else if (restarts_used_ < opt_.max_restarts) {
      rep.state = State::kWaiting;
      rep.restart_number = ++restarts_used_;
      rep.restart_at = after_seconds(opt_.restart_delay_s);
    } else {
      rep.state = State::kLost;
      report_lost(rep);
    }
  }

  int first_finished() const {
    for (const auto& r : replicas_)
      if (r.state == State::kFinished) return r.id;
    return -1;
  }

  void report_lost(const Replica& rep) {
    const int live = replicas_in({State::kRunning, State::kStopping, State::kWaiting});
    std::fprintf(stderr,
                 "fsdp-run: replica %d stays down: no restarts left (--max-restarts %d); %d of %d "
                 "replicas still running\n",
                 rep.id, opt_.max_restarts, live, opt_.replicas);
    if (live == 0 && replicas_in({State::kFinished}) == 0)
      std::fprintf(stderr, "fsdp-run: every replica is down; exiting with status %d\n",
                   first_failure_);
  }

  void relaunch(Replica& rep) {
    ++rep.restart;
    std::fprintf(stderr, "fsdp-run: restarting replica %d (restart %d of %d)\n", rep.id,
                 rep.restart_number, opt_.max_restarts);
    launch(rep);
  }

  void advance(Replica& rep) {
    if (rep.state == State::kRunning || rep.state == State::kStopping) {
      if (!any_running(rep)) settle(rep);
    } else if (rep.state == State::kWaiting) {
      if (stopping_)
        rep.state = State::kLost;
      else if (Clock::now() >= rep.restart_at)
        relaunch(rep);
    }
  }

  // Everything the loop does besides I/O: timers and state changes.
  void tick() {
    await_coordinator();
    for (auto& rep : replicas_) advance(rep);
    escalate();
    stop_coordinator_when_done();
  }

  // ---- the loop ----

  void on_coordinator_exit() {
    if (stopping_ || coord_stop_.active || (coord_ready_ && !replicas_active())) return;
    const std::string what = describe_status(coord_.status);
    if (!coord_ready_)
      std::fprintf(stderr,
                   "fsdp-run: the coordinator '%s' %s before it accepted connections on "
                   "127.0.0.1:%d\n",
                   coord_bin_.c_str(), what.c_str(), coord_port_);
    else
      std::fprintf(stderr, "fsdp-run: the coordinator '%s' %s; stopping all replicas\n",
                   coord_bin_.c_str(), what.c_str());
    fail_job(1);
  }

  void reap() {
    for (auto& rep : replicas_)
      for (auto& p : rep.ranks)
        if (reap_one(p)) on_rank_exit(rep, p);
    if (reap_one(coord_)) on_coordinator_exit();
  }

  void on_launcher_signal(int sig) {
    if (sig == SIGCHLD) return reap();
    if (stopping_) return kill_everything();
    std::fprintf(stderr, "fsdp-run: received signal %d (%s), stopping all %s\n", sig,
                 ::strsignal(sig), opt_.elastic ? "replicas and the coordinator" : "ranks");
    fail_job(128 + sig);
  }

  bool active() const { return coord_.running || replicas_active(); }

  // Milliseconds until the next timer (at most 1 s).
  int poll_timeout(const std::optional<Clock::time_point>& drain) const {
    int timeout_ms = 1000;
    auto shorten = [&](Clock::time_point t) {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
      timeout_ms = std::max<int>(0, std::min<int64_t>(timeout_ms, ms + 1));
    };
    for (const auto& rep : replicas_) {
      if (rep.stop.active && !rep.stop.killed && any_running(rep)) shorten(rep.stop.deadline);
      if (rep.state == State::kWaiting) shorten(rep.restart_at);
    }
    if (coord_stop_.active && !coord_stop_.killed && coord_.running) shorten(coord_stop_.deadline);
    if (opt_.elastic && !coord_ready_ && !stopping_) shorten(next_probe_);
    if (drain) shorten(*drain);
    return timeout_ms;
  }

  void loop() {
    std::optional<Clock::time_point> drain_deadline;
    for (;;) {
      tick();
      const bool running = active();
      if (!running && !drain_deadline) {
        // Every child is gone; give leftover writers a moment, then stop reading.
        drain_deadline = Clock::now() + std::chrono::seconds(1);
      }
      std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
      std::vector<Stream*> owners{nullptr};
      for (auto& s : streams_)
        if (s.fd >= 0) {
          fds.push_back({s.fd, POLLIN, 0});
          owners.push_back(&s);
        }
      if (!running && fds.size() == 1) break;
      if (drain_deadline && Clock::now() >= *drain_deadline) break;

      const int n = ::poll(fds.data(), fds.size(), poll_timeout(drain_deadline));
      if (n < 0 && errno != EINTR) die(std::string("poll(): ") + std::strerror(errno));
      if (n > 0 && (fds[0].revents & POLLIN)) {
        unsigned char sigs[64];
        ssize_t got = ::read(g_signal_pipe[0], sigs, sizeof sigs);
        for (ssize_t i = 0; i < got; ++i) on_launcher_signal(sigs[i]);
      }
      for (size_t i = 1; n > 0 && i < fds.size(); ++i)
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) owners[i]->read_some();
      reap();  // also catches exits whose SIGCHLD coalesced with another
    }
    // Flush partial last lines of streams still open (held by leftovers we stopped reading).
    for (auto& s : streams_) {
      s.emit(true);
      s.close_fd();
    }
  }

  // Plain mode: 0, or the reason the job stopped. Replicas mode: the reason the job stopped, else
  // 0 when a replica finished, else the status of the first rank that failed.
  int exit_code() const {
    if (stopping_) return job_code_;
    if (!opt_.elastic || replicas_in({State::kFinished}) > 0) return 0;
    return first_failure_ > 0 ? first_failure_ : 1;
  }

  Options opt_;
  int size_;                    // ranks per replica
  std::deque<Stream> streams_;  // of every child ever started (stable addresses)
  std::vector<Replica> replicas_;
  Proc coord_;
  Stop coord_stop_;
  std::string coord_bin_;
  int coord_port_ = 0;
  bool coord_ready_ = false;
  Clock::time_point coord_deadline_;
  Clock::time_point next_probe_;  // of the coordinator's port, while it starts
  bool stopping_ = false;         // the whole job stops (a signal, plain mode's failing rank, ...)
  int job_code_ = 0;              // why, when stopping_
  int first_failure_ = -1;        // replicas mode: status of the first rank that failed
  int restarts_used_ = 0;
};

const char* kDescription =
    "fsdp-run: runs PROG on N local ranks (processes) with the torchrun variables RANK, "
    "LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free "
    "port unless --master-port is given); OMP_NUM_THREADS=1 unless already set.\n"
    "Every line a rank prints is prefixed with '[rank k] ' (stdout to stdout, stderr to stderr). "
    "When a rank exits non-zero or dies by a signal, the other ranks get SIGTERM, then SIGKILL "
    "after the grace period, and fsdp-run exits with that rank's status (128+signal for a "
    "signal). Ctrl-C (SIGINT) or SIGTERM stops all ranks the same way (a second Ctrl-C kills "
    "at once) and exits with 128+signal.\n\n"
    "Replicas (HSDP jobs that survive the loss of a replica): --replicas R splits the N ranks "
    "into R replicas of S = N/R ranks, each its own rendezvous: RANK and LOCAL_RANK are the index "
    "within the replica (0..S-1), WORLD_SIZE = LOCAL_WORLD_SIZE = S, GROUP_RANK=0, and "
    "MASTER_PORT is a fresh free port per replica and launch. First fsdp-run starts the "
    "coordinator, 'fsdp-coordinator --port P' (next to fsdp-run, or the program that "
    "FSDP_COORDINATOR_BIN names), and waits until it accepts connections on 127.0.0.1:P (at most "
    "30 s, or "
    "FSDP_COORDINATOR_TIMEOUT_S). Each rank also gets FSDP_ELASTIC_COORDINATOR=127.0.0.1:P, "
    "FSDP_REPLICA_ID (0..R-1), FSDP_MIN_REPLICAS=R and FSDP_REPLICA_RESTART (how many times its "
    "replica was relaunched). Lines are prefixed '[replica r rank k] ' and '[coordinator] '.\n"
    "Restart policy: when a rank fails, only the other ranks of its replica are stopped; the "
    "other replicas keep running. Then, while the job's restart budget lasts (--max-restarts M, "
    "shared by all replicas, like torchrun's), the replica is relaunched after --restart-delay "
    "seconds; otherwise it stays down. A replica whose ranks all exit 0 is finished and never "
    "relaunched, and once one has finished, no replica is relaunched. When no replica runs or "
    "waits to restart, the coordinator is stopped and "
    "fsdp-run exits 0 if at least one replica finished (the others were lost), otherwise with "
    "the status of the first rank that failed. The coordinator not starting stops the job with "
    "status 1 (127 when it cannot be executed), and so does its exit while replicas run; "
    "Ctrl-C or SIGTERM stops all replicas, then the coordinator, with 128+signal. "
    "--replicas 1 without --max-restarts or --restart-delay is the plain mode.\n\n"
    "Usage: fsdp-run -n N [--master-port P] [--] PROG [ARGS...]\n"
    "       fsdp-run -n N --replicas R [--max-restarts M] [--restart-delay S] [--] PROG [ARGS...]\n"
    "Example: fsdp-run -n 2 -- build/bin/fsdp-bench --comm";

// Checks the replicas options and sets opt.elastic; a usage error ends the program.
void check_replicas(Options& opt, bool replicas_given, bool restart_options_given) {
  if (!replicas_given) {
    if (restart_options_given) die("--max-restarts and --restart-delay need --replicas R");
    return;
  }
  if (opt.replicas < 1)
    die("--replicas must be at least 1 (got " + std::to_string(opt.replicas) + ")");
  if (opt.nproc % opt.replicas != 0)
    die("--replicas " + std::to_string(opt.replicas) + " does not divide -n " +
        std::to_string(opt.nproc) + ": every replica needs the same number of ranks");
  opt.elastic = opt.replicas > 1 || restart_options_given;
  if (opt.elastic && opt.master_port > 0)
    die("--master-port cannot be used with --replicas: each replica gets a fresh free "
        "MASTER_PORT at every launch");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{kDescription};
  Options opt;
  app.add_option("-n,--nproc,--nproc-per-node", opt.nproc, "number of ranks to start")
      ->required()
      ->check(CLI::Range(1, 1024));
  app.add_option("--master-port", opt.master_port,
                 "TCP port for rank 0's rendezvous store (default: a free port)")
      ->check(CLI::Range(1, 65535));
  app.add_option("--grace-period", opt.grace_s,
                 "seconds between SIGTERM and SIGKILL when stopping ranks (or the coordinator)")
      ->default_val(5.0)
      ->check(CLI::Range(0.0, 3600.0));
  auto* replicas = app.add_option("--replicas", opt.replicas,
                                  "split the ranks into R replicas that fail and restart apart");
  auto* restarts = app.add_option("--max-restarts", opt.max_restarts,
                                  "replica relaunches allowed over the whole job (default 0)")
                       ->check(CLI::Range(0, 1000000));
  auto* delay = app.add_option("--restart-delay", opt.restart_delay_s,
                               "seconds between a failed replica's end and its relaunch "
                               "(default 1)")
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
  check_replicas(opt, replicas->count() > 0, restarts->count() + delay->count() > 0);
  return Launcher(std::move(opt)).run();
}
