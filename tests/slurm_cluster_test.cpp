// fsdp-train under a real one-node Slurm cluster that this test starts itself: munged (a generated
// key), slurmctld and slurmd as its children, with a private slurm.conf, ports, state and logs
// under a temporary directory (proctrack/linuxproc, task/none: no cgroups). With no MASTER_ADDR or
// MASTER_PORT anywhere, `srun -n 2 fsdp-train` and an `sbatch --wait` script running it with srun
// must train on 2 ranks (both write their checkpoint shards) with the losses of the same run under
// the local launcher, fsdp-run. Afterwards no process the test started may be left.
// Needs root and the Debian packages slurmctld, slurmd, slurm-client and munge
// (scripts/setup.sh --test); skipped, saying which, without them or when a daemon cannot start.
// The parser and the port formula on their own: tests/slurm_test.cpp.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "train/metrics.h"

namespace fsdp::testing {
namespace {

using Clock = std::chrono::steady_clock;
using Env = std::map<std::string, std::string>;
using namespace std::chrono_literals;

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string tail(const std::string& s, size_t n = 3000) {
  return s.size() <= n ? s : "..." + s.substr(s.size() - n);
}

void write_file(const std::string& path, const std::string& text, mode_t mode = 0644) {
  std::ofstream(path) << text;
  ::chmod(path.c_str(), mode);
}

// `name` in PATH, /usr/sbin or /sbin (daemons live in sbin, not always in a test's PATH).
std::string find_program(const std::string& name) {
  std::string dirs = std::getenv("PATH") ? std::getenv("PATH") : "";
  dirs += ":/usr/sbin:/sbin:/usr/bin";
  std::stringstream ss(dirs);
  for (std::string d; std::getline(ss, d, ':');)
    if (!d.empty() && ::access((d + "/" + name).c_str(), X_OK) == 0) return d + "/" + name;
  return "";
}

// The pids whose environment holds SLURM_CONF=conf. Everything the test starts has it: the
// daemons and client commands from the test, the job's tasks from srun, and slurmstepd (which
// slurmd starts with a clean environment but for SLURM_CONF) from slurmd. The configuration lies
// in the test's own temporary directory: no other process has that value.
std::vector<pid_t> processes_of(const std::string& conf) {
  const std::string want = "SLURM_CONF=" + conf;
  std::vector<pid_t> out;
  DIR* proc = ::opendir("/proc");
  if (!proc) return out;
  while (dirent* e = ::readdir(proc)) {
    const pid_t pid = std::atoi(e->d_name);
    if (pid <= 0 || pid == ::getpid()) continue;
    std::stringstream env(slurp("/proc/" + std::string(e->d_name) + "/environ"));
    for (std::string var; std::getline(env, var, '\0');) {
      if (var == want) {
        out.push_back(pid);
        break;
      }
    }
  }
  ::closedir(proc);
  return out;
}

// A daemon run in the foreground as a child of the test, in its own process group, its output
// in `log`.
struct Daemon {
  std::string name, log;
  pid_t pid = -1;
  int status = -1;  // exit status once reaped

  void start(const std::vector<std::string>& argv, const Env& env) {
    name = argv[0].substr(argv[0].find_last_of('/') + 1);
    pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, 0);
      // A test killed before its teardown (a ctest timeout) takes its daemons with it.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
  }
  bool running() {
    if (pid <= 0 || status != -1) return false;
    int st = 0;
    if (::waitpid(pid, &st, WNOHANG) != pid) return true;
    status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return false;
  }
  // SIGTERM, then SIGKILL to the group after `grace`. Returns whether it exited on SIGTERM.
  bool stop(std::chrono::seconds grace) {
    if (!running()) return true;
    ::kill(pid, SIGTERM);
    for (const auto deadline = Clock::now() + grace; Clock::now() < deadline;) {
      if (!running()) return true;
      std::this_thread::sleep_for(50ms);
    }
    ::kill(-pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    status = 128 + SIGKILL;
    return false;
  }
  std::string why_down() {
    return name + " exited with status " + std::to_string(status) + ":\n" + tail(slurp(log));
  }
};

// The cluster: one node, "localhost", with CPUs for two tasks.
class Cluster {
 public:
  enum class Up { kYes, kCannotStart, kNotIdle };

  Cluster() {
    char tmpl[] = "/tmp/fsdp-slurm-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    // munged wants every directory above its socket searchable by all, its key private.
    ::chmod(dir_.c_str(), 0755);
    for (const char* d : {"munge", "run", "state", "spool", "log"})
      std::filesystem::create_directory(dir_ + "/" + d);
    ::chmod((dir_ + "/munge").c_str(), 0700);
    conf_ = dir_ + "/slurm.conf";
  }
  ~Cluster() {
    stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  const std::string& dir() const { return dir_; }
  // The environment of every Slurm client command (and so of the job's tasks).
  Env env() const { return {{"SLURM_CONF", conf_}}; }
  std::vector<pid_t> processes() const { return processes_of(conf_); }
  std::string logs() {
    std::string s;
    for (const char* f : {"munged.out", "slurmctld.log", "slurmd.log"})
      s += std::string("--- ") + f + ":\n" + tail(slurp(dir_ + "/log/" + f), 2000) + "\n";
    return s;
  }

  // Starts munged, slurmctld and slurmd and waits until the node is idle. `why` says what failed.
  Up start(std::string& why) {
    const std::string key = dir_ + "/munge/munge.key", sock = dir_ + "/run/munge.sock";
    auto r = run_process({find_program("mungekey"), "-c", "-k", key}, 30s);
    if (r.exit_code != 0) return why = "mungekey failed: " + r.output, Up::kCannotStart;
    munged_.log = dir_ + "/log/munged.out";
    munged_.start({find_program("munged"), "-F", "--key-file=" + key, "--socket=" + sock,
                   "--pid-file=" + dir_ + "/run/munged.pid", "--seed-file=" + dir_ + "/munge/seed",
                   "--log-file=" + dir_ + "/log/munged.log"},
                  env());
    if (!wait_for([&] { return ::access(sock.c_str(), F_OK) == 0; }, {&munged_}, 10s, why))
      return Up::kCannotStart;

    write_conf(sock);
    slurmctld_.log = dir_ + "/log/slurmctld.out";
    slurmctld_.start({find_program("slurmctld"), "-D", "-f", conf_}, env());
    slurmd_.log = dir_ + "/log/slurmd.out";
    slurmd_.start({find_program("slurmd"), "-D", "-f", conf_, "-N", "localhost"}, env());
    std::string state;
    auto idle = [&] {
      auto s = run_process({find_program("sinfo"), "-h", "-N", "-o", "%t"}, 10s, env());
      state = s.output;
      return s.exit_code == 0 && s.output == "idle\n";  // not "idle*": not responding
    };
    if (wait_for(idle, {&munged_, &slurmctld_, &slurmd_}, 30s, why)) return Up::kYes;
    if (!why.empty()) return Up::kCannotStart;  // a daemon exited
    why = "the node did not become idle within 30 s (sinfo: '" + state + "')\n" + logs();
    return Up::kNotIdle;
  }

  // Cancels what is left, stops the daemons (slurmd first), and kills any process the test
  // started that outlived them. Returns what had to be killed (empty: a clean shutdown).
  std::vector<std::string> stop() {
    std::vector<std::string> stray;
    if (stopped_) return stray;
    stopped_ = true;
    if (slurmctld_.running()) {
      auto q = run_process({find_program("squeue"), "-h", "-o", "%i"}, 10s, env());
      std::stringstream ids(q.output);
      for (std::string id; ids >> id;)
        run_process({find_program("scancel"), "--full", id}, 10s, env());
      std::string ignored;
      wait_for(
          [&] {
            auto s = run_process({find_program("squeue"), "-h", "-o", "%i"}, 10s, env());
            return s.exit_code != 0 || s.output.empty();
          },
          {}, 15s, ignored);
    }
    for (Daemon* d : {&slurmd_, &slurmctld_, &munged_})
      if (!d->stop(10s)) stray.push_back(d->name + " ignored SIGTERM for 10 s");
    std::this_thread::sleep_for(200ms);
    for (pid_t pid : processes_of(conf_)) {
      stray.push_back("pid " + std::to_string(pid) + " (" +
                      slurp("/proc/" + std::to_string(pid) + "/comm") + ")");
      ::kill(pid, SIGKILL);
    }
    return stray;
  }

 private:
  // Polls `ready` until true or `limit`; false with `why` naming the daemon when one exits.
  template <class F>
  bool wait_for(F ready, std::vector<Daemon*> daemons, std::chrono::seconds limit,
                std::string& why) {
    for (const auto deadline = Clock::now() + limit; Clock::now() < deadline;) {
      for (Daemon* d : daemons) {
        if (!d->running()) {
          why = d->why_down() + "\n" + logs();
          return false;
        }
      }
      if (ready()) return true;
      std::this_thread::sleep_for(200ms);
    }
    return false;
  }

  void write_conf(const std::string& munge_socket) {
    const int cpus = std::max(2, static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)));
    std::ostringstream c;
    c << "ClusterName=fsdptest\n"
      << "SlurmctldHost=localhost\n"
      << "SlurmctldPort=" << free_port() << "\n"
      << "SlurmdPort=" << free_port() << "\n"
      << "SlurmUser=root\nSlurmdUser=root\n"
      << "AuthType=auth/munge\nCredType=cred/munge\n"
      << "AuthInfo=socket=" << munge_socket << "\n"
      << "StateSaveLocation=" << dir_ << "/state\n"
      << "SlurmdSpoolDir=" << dir_ << "/spool\n"
      << "SlurmctldPidFile=" << dir_ << "/run/slurmctld.pid\n"
      << "SlurmdPidFile=" << dir_ << "/run/slurmd.pid\n"
      << "SlurmctldLogFile=" << dir_ << "/log/slurmctld.log\n"
      << "SlurmdLogFile=" << dir_
      << "/log/slurmd.log\n"
      // No cgroups: processes tracked through /proc, tasks not bound.
      << "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
      << "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
      << "MpiDefault=none\nSwitchType=switch/none\nMailProg=/bin/true\n"
      << "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
      << "JobCompType=jobcomp/none\nReturnToService=2\nSchedulerType=sched/builtin\n"
      << "MinJobAge=10\nKillWait=5\nInactiveLimit=0\n"
      // The node as configured here, whatever slurmd detects (CPUs, memory).
      << "SlurmdParameters=config_overrides\n"
      << "NodeName=localhost NodeAddr=127.0.0.1 CPUs=" << cpus << " State=UNKNOWN\n"
      << "PartitionName=test Nodes=localhost Default=YES MaxTime=10 State=UP\n";
    write_file(conf_, c.str());
  }

  std::string dir_, conf_;
  Daemon munged_, slurmctld_, slurmd_;
  bool stopped_ = false;
};

// The run every launcher repeats: 2 ranks of a tiny model, a checkpoint at the end (each rank
// writes its own shard file), one intra-op thread per rank.
std::vector<std::string> tiny_run(const std::string& run_dir) {
  return {bin_dir() + "/fsdp-train",
          "--layers",
          "1",
          "--heads",
          "2",
          "--width",
          "32",
          "--seq",
          "16",
          "--batch",
          "6",
          "--steps",
          "8",
          "--warmup",
          "2",
          "--lr",
          "1e-2",
          "--sample-tokens",
          "16",
          "--threads",
          "1",
          "--save-every",
          "8",
          "--run-dir",
          run_dir};
}

std::string shell_words(const std::vector<std::string>& words) {
  std::string s;
  for (const auto& w : words) s += (s.empty() ? "'" : " '") + w + "'";
  return s;
}

// The line of `output` holding `key` ("" if none), for the log.
std::string line_with(const std::string& output, const std::string& key) {
  const size_t at = output.find(key);
  if (at == std::string::npos) return "";
  const size_t start = output.rfind('\n', at) + 1;  // npos + 1 == 0
  return output.substr(start, output.find('\n', at) - start);
}

std::vector<double> losses(const std::string& run_dir) {
  std::vector<double> out;
  for (const auto& r : train::read_metrics(run_dir + "/metrics.csv")) out.push_back(r.loss);
  return out;
}

// Both ranks wrote their shard of the last checkpoint, and the losses equal the reference's.
void expect_trained_like(const std::string& run_dir, const std::vector<double>& reference,
                         const std::string& output) {
  std::string missing;
  for (const char* f : {"rank0.safetensors", "rank1.safetensors", "index.json"})
    if (!std::filesystem::exists(run_dir + "/step_00000008/" + f)) missing += std::string(" ") + f;
  ASSERT_EQ(missing, "") << "missing in " << run_dir << "/step_00000008/\n" << output;
  std::vector<double> got;
  try {
    got = losses(run_dir);
  } catch (const std::exception& e) {
    FAIL() << e.what() << "\n" << output;
  }
  EXPECT_EQ(got, reference) << "losses differ from the fsdp-run reference\n" << output;
}

TEST(SlurmClusterTest, SrunAndSbatchTrainWithoutMasterAddrOrPort) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run slurmd and munged";
  std::string missing;
  for (const char* p : {"munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "sinfo",
                        "squeue", "scancel"})
    if (find_program(p).empty()) missing += std::string(missing.empty() ? "" : ", ") + p;
  if (!missing.empty())
    GTEST_SKIP() << "Slurm is not installed (missing " << missing
                 << "): scripts/setup.sh --test installs slurmctld slurmd slurm-client munge";
  // The launchers' variables must come from Slurm alone.
  for (const char* k : {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS"})
    ::unsetenv(k);

  const auto t0 = Clock::now();
  Cluster cluster;
  std::string why;
  const auto up = cluster.start(why);
  if (up == Cluster::Up::kCannotStart) GTEST_SKIP() << "Slurm cannot start here: " << why;
  ASSERT_EQ(up, Cluster::Up::kYes) << why;
  const double start_s = std::chrono::duration<double>(Clock::now() - t0).count();

  // The reference: the same run under the local launcher (fsdp-train starts fsdp-run).
  const std::string ref_dir = cluster.dir() + "/ref";
  auto args = tiny_run(ref_dir);
  args.insert(args.end(), {"--nproc", "2"});
  auto r = run_process(args, 120s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto reference = losses(ref_dir);
  ASSERT_EQ(reference.size(), 8u);
  std::printf("fsdp-run reference: %.1f s, losses %.8f .. %.8f\n", r.seconds, reference.front(),
              reference.back());

  // 1. srun -n 2: the tasks see SLURM_* only.
  const std::string srun_dir = cluster.dir() + "/srun";
  args = {find_program("srun"),   "-n", "2",        "-t", "2", "-l",
          "--kill-on-bad-exit=1", "-J", "fsdp-srun"};
  for (const auto& a : tiny_run(srun_dir)) args.push_back(a);
  r = run_process(args, 120s, cluster.env());
  ASSERT_FALSE(r.timed_out) << r.output << cluster.logs();
  EXPECT_EQ(r.exit_code, 0) << r.output << cluster.logs();
  EXPECT_NE(r.output.find("0: fsdp-train: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" on 2 ranks, 8 steps"), std::string::npos) << r.output;
  expect_trained_like(srun_dir, reference, r.output);
  std::printf("srun -n 2: %.1f s; %s\n", r.seconds, line_with(r.output, "final loss").c_str());

  // 2. sbatch --wait: a batch script that runs the same with srun.
  const std::string batch_dir = cluster.dir() + "/sbatch";
  const std::string script = cluster.dir() + "/job.sh";
  write_file(script,
             "#!/bin/sh\n"
             "echo \"batch job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, ntasks $SLURM_NTASKS, "
             "MASTER_ADDR='${MASTER_ADDR:-}' MASTER_PORT='${MASTER_PORT:-}'\"\n"
             "exec srun -l " +
                 shell_words(tiny_run(batch_dir)) + "\n",
             0755);
  const std::string out = cluster.dir() + "/batch.out";
  r = run_process({find_program("sbatch"), "--wait", "-n", "2", "-t", "2", "-J", "fsdp-sbatch",
                   "-o", out, script},
                  120s, cluster.env());
  const std::string batch_out = slurp(out);
  ASSERT_FALSE(r.timed_out) << r.output << batch_out << cluster.logs();
  EXPECT_EQ(r.exit_code, 0) << r.output << batch_out << cluster.logs();
  EXPECT_NE(batch_out.find("ntasks 2, MASTER_ADDR='' MASTER_PORT=''"), std::string::npos)
      << batch_out;
  EXPECT_NE(batch_out.find(" on 2 ranks, 8 steps"), std::string::npos) << batch_out;
  expect_trained_like(batch_dir, reference, r.output + batch_out);
  std::printf("sbatch --wait: %.1f s; %s; %s\n", r.seconds,
              line_with(batch_out, "batch job").c_str(),
              line_with(batch_out, "final loss").c_str());

  // The final sweep can see what the test started (else "nothing left" would prove nothing).
  EXPECT_GE(cluster.processes().size(), 3u)
      << "munged, slurmctld and slurmd not found by SLURM_CONF";
  const auto stray = cluster.stop();
  for (const auto& s : stray) ADD_FAILURE() << "left behind after the shutdown: " << s;
  std::printf("cluster up in %.1f s; whole test %.1f s\n", start_s,
              std::chrono::duration<double>(Clock::now() - t0).count());
}

}  // namespace
}  // namespace fsdp::testing
