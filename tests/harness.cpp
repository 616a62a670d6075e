#include "harness.h"

#include <ATen/Parallel.h>
#include <fcntl.h>
#include <fsdp/init.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "util/free_port.h"

extern char** environ;

namespace fsdp::testing {
namespace {

using Clock = std::chrono::steady_clock;

int decode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string tail(const std::string& s, size_t n = 6000) {
  return s.size() <= n ? s : "..." + s.substr(s.size() - n);
}

std::string current_test_filter() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

// Index of this run_ranks call within the current test (a test may call it more than once).
int next_call_index() {
  static std::string test;
  static int index = 0;
  std::string now = current_test_filter();
  if (now != test) {
    test = now;
    index = 0;
  }
  return index++;
}

}  // namespace

std::shared_ptr<Communicator> Rank::world() {
  if (!world_) world_ = fsdp::init_process_group();
  return world_;
}

ScopedTransport::ScopedTransport(const std::string& transport) {
  if (transport.empty()) return;
  set_ = true;
  if (const char* v = std::getenv("FSDP_TRANSPORT")) before_ = v;
  ::setenv("FSDP_TRANSPORT", transport.c_str(), 1);
}

ScopedTransport::~ScopedTransport() {
  if (!set_) return;
  before_ ? ::setenv("FSDP_TRANSPORT", before_->c_str(), 1) : ::unsetenv("FSDP_TRANSPORT");
}

std::shared_ptr<Communicator> Rank::lane_over(const std::string& transport) {
  auto w = world();
  ScopedTransport scoped(transport);
  return w->split("over-" + transport);
}

bool in_rank_process() { return std::getenv("FSDP_TEST_RANK") != nullptr; }

std::string test_scratch_dir(const char* env, const std::string& prefix) {
  if (const char* d = std::getenv(env)) return d;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "_" + info->name();
  for (char& c : name) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  const std::filesystem::path d =
      std::filesystem::temp_directory_path() / (prefix + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d.string();
}

int free_port() { return detail::free_loopback_port(); }

std::string bin_dir() { return FSDP_BIN_DIR; }

bool has_torchrun() { return ::access(FSDP_TORCHRUN, X_OK) == 0; }

std::vector<std::string> torchrun_command(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {FSDP_TORCHRUN};
  if (FSDP_TORCHRUN_1_13) argv.insert(argv.end(), {"--redirects", "1", "--tee", "1"});
  for (const auto& a : args)
    argv.push_back(FSDP_TORCHRUN_1_13 && a == "--no-python" ? "--no_python" : a);
  return argv;
}

RunResult run_ranks(int world_size, const std::function<void(Rank&)>& body,
                    const RunOptions& options) {
  const int call = next_call_index();
  RunResult result;
  if (in_rank_process()) {
    if (std::atoi(std::getenv("FSDP_TEST_CALL")) != call) return result;
    at::set_num_threads(1);
    Rank r;
    r.rank = std::atoi(std::getenv("FSDP_TEST_RANK"));
    r.size = world_size;
    body(r);
    return result;
  }

  const int port = free_port();
  char dir_tmpl[] = "/tmp/fsdp-test-XXXXXX";
  std::string dir = ::mkdtemp(dir_tmpl);
  const std::string filter = "--gtest_filter=" + current_test_filter();
  std::vector<pid_t> pids(world_size);
  for (int k = 0; k < world_size; ++k) {
    std::string out = dir + "/rank" + std::to_string(k) + ".log";
    pid_t pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, 0);
      int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::setenv("FSDP_TEST_RANK", std::to_string(k).c_str(), 1);
      ::setenv("FSDP_TEST_CALL", std::to_string(call).c_str(), 1);
      ::setenv("RANK", std::to_string(k).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(k).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("FSDP_TIMEOUT_S", std::to_string(options.collective_timeout_s).c_str(), 1);
      ::setenv("OMP_NUM_THREADS", "1", 1);
      for (auto& [key, value] : options.env) ::setenv(key.c_str(), value.c_str(), 1);
      const char* argv[] = {"/proc/self/exe", filter.c_str(), nullptr};
      ::execv("/proc/self/exe", const_cast<char**>(argv));
      ::_exit(127);
    }
    pids[k] = pid;
  }

  result.exit_codes.assign(world_size, -1);
  int alive = world_size;
  auto deadline = Clock::now() + options.timeout;
  std::optional<Clock::time_point> failed_at;
  while (alive > 0) {
    for (int k = 0; k < world_size; ++k) {
      if (result.exit_codes[k] != -1) continue;
      int status = 0;
      if (::waitpid(pids[k], &status, WNOHANG) == pids[k]) {
        result.exit_codes[k] = decode_status(status);
        --alive;
        if (result.exit_codes[k] != 0 && !failed_at) failed_at = Clock::now();
      }
    }
    if (alive == 0) break;
    bool give_up = Clock::now() > deadline;
    // One rank failed: give the others a moment to report their own error, then stop them.
    bool failed_long_ago = failed_at && Clock::now() - *failed_at > std::chrono::seconds(5);
    if (give_up || failed_long_ago) {
      result.timed_out = give_up;
      for (int k = 0; k < world_size; ++k)
        if (result.exit_codes[k] == -1) ::kill(-pids[k], SIGKILL), ::kill(pids[k], SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int k = 0; k < world_size; ++k) {
    std::string path = dir + "/rank" + std::to_string(k) + ".log";
    result.output.push_back(read_file(path));
    ::unlink(path.c_str());
  }
  ::rmdir(dir.c_str());

  if (std::getenv("FSDP_TEST_VERBOSE"))
    for (int k = 0; k < world_size; ++k)
      std::cout << "----- rank " << k << " output -----\n" << result.output[k];
  if (!options.expect_failure) {
    EXPECT_FALSE(result.timed_out)
        << "ranks did not finish within " << options.timeout.count() << " s";
    for (int k = 0; k < world_size; ++k) {
      EXPECT_EQ(result.exit_codes[k], 0)
          << "rank " << k << " of " << world_size << " failed; its output:\n"
          << tail(result.output[k]);
    }
  }
  return result;
}

ProcResult run_process(const std::vector<std::string>& argv, std::chrono::seconds timeout,
                       const std::map<std::string, std::string>& env) {
  ProcResult r;
  int fds[2];
  if (::pipe(fds) != 0) return r;
  auto start = Clock::now();
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    ::close(fds[1]);
    for (auto& [key, value] : env) ::setenv(key.c_str(), value.c_str(), 1);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  auto deadline = start + timeout;
  char buf[4096];
  bool open = true;
  while (open) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      ::kill(-pid, SIGKILL);
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 200))) > 0) {
      ssize_t n = ::read(fds[0], buf, sizeof buf);
      if (n <= 0)
        open = false;
      else
        r.output.append(buf, n);
    }
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.exit_code = decode_status(status);
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return r;
}

}  // namespace fsdp::testing
