// fsdp-train surviving faults, end to end with the real binary: --async-save writes the same
// checkpoints as synchronous saves and a job killed at random moments of its background saves
// resumes exactly; a checkpoint whose index disagrees with its directory is refused by name;
// --resume auto falls back over a checkpoint damaged inside, saying which; and the ranks of a
// torchrun whose agent is killed stop, saying so, instead of training on as orphans.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "train/metrics.h"

namespace fsdp::train {
namespace {

namespace fs = std::filesystem;
using fsdp::testing::ProcResult;
using Clock = std::chrono::steady_clock;

// Scratch run directories (and their .log siblings), removed after all tests.
std::vector<std::string>& scratch_dirs() {
  static std::vector<std::string> dirs;
  return dirs;
}

class RemoveScratch : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const auto& d : scratch_dirs()) {
      std::error_code ec;
      fs::remove_all(d, ec);
      fs::remove(d + ".log", ec);
    }
  }
};
const auto* const kRemoveScratch = ::testing::AddGlobalTestEnvironment(new RemoveScratch);

std::string scratch_dir(const std::string& name) {
  const std::string d =
      ::testing::TempDir() + "fsdp_resilience_" + std::to_string(::getpid()) + "_" + name;
  fs::remove_all(d);
  scratch_dirs().push_back(d);
  return d;
}

// A small model (two blocks of width 64), one thread per rank so that runs repeat bitwise.
std::vector<std::string> small(const std::string& run_dir, int steps) {
  return {fsdp::testing::bin_dir() + "/fsdp-train",
          "--threads",
          "1",
          "--layers",
          "2",
          "--heads",
          "2",
          "--width",
          "64",
          "--seq",
          "16",
          "--batch",
          "6",
          "--steps",
          std::to_string(steps),
          "--warmup",
          "2",
          "--lr",
          "1e-2",
          "--sample-tokens",
          "0",
          "--eval-every",
          "0",
          "--quiet",
          "--run-dir",
          run_dir};
}

std::vector<std::string> with(std::vector<std::string> argv, const std::vector<std::string>& more) {
  argv.insert(argv.end(), more.begin(), more.end());
  return argv;
}

ProcResult run(const std::vector<std::string>& argv) {
  return fsdp::testing::run_process(argv, std::chrono::seconds(120));
}

std::vector<double> losses(const std::string& run_dir) {
  std::vector<double> out;
  for (const auto& r : read_metrics(run_dir + "/metrics.csv")) out.push_back(r.loss);
  return out;
}

std::string read_all(const std::string& path) {
  std::stringstream ss;
  ss << std::ifstream(path, std::ios::binary).rdbuf();
  return ss.str();
}

size_t metrics_rows(const std::string& run_dir) {
  std::ifstream in(run_dir + "/metrics.csv");
  size_t rows = 0;
  for (std::string line; std::getline(in, line);) ++rows;
  return rows > 0 ? rows - 1 : 0;  // the header
}

// Starts argv with stdout and stderr to `log`, in a process group of its own.
pid_t spawn_logged(const std::vector<std::string>& argv_s, const std::string& log) {
  std::vector<char*> argv;
  for (const auto& a : argv_s) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], &fa, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  return rc == 0 ? pid : -1;
}

// The processes named `comm` whose parent is `parent`.
std::vector<pid_t> children_named(pid_t parent, const std::string& comm) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    const auto open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent && stat.substr(open + 1, close - open - 1) == comm)
      out.push_back(static_cast<pid_t>(std::stoi(name)));
  }
  return out;
}

// ---- --async-save ----

// The same run with synchronous and with asynchronous saves: the same losses and the same
// checkpoint files, byte for byte; --keep-last 2 with --async-save keeps the newest two (retention
// runs after each commit); the summary reports the saves.
TEST(TrainResilience, AsyncSaveWritesTheSameCheckpointsAsSynchronousSaves) {
  const auto sync_dir = scratch_dir("sync");
  auto r = run(with(small(sync_dir, 8), {"--nproc", "2", "--save-every", "2"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoints   5 saved, each holding the step"), std::string::npos)
      << r.output;
  const auto async_dir = scratch_dir("async");
  r = run(with(small(async_dir, 8),
               {"--nproc", "2", "--save-every", "2", "--async-save", "--keep-last", "2"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoints   5 saved asynchronously (rank 0): the step held"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(losses(async_dir), losses(sync_dir));
  std::vector<std::string> kept;
  for (const auto& e : fs::directory_iterator(async_dir))
    if (e.path().filename().string().rfind("step_", 0) == 0)
      kept.push_back(e.path().filename().string());
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(kept, (std::vector<std::string>{"step_00000006", "step_00000008"}));
  for (const auto& step : kept)
    for (const char* f : {"rank0.safetensors", "rank1.safetensors"})
      EXPECT_EQ(read_all(async_dir + "/" + step + "/" + f),
                read_all(sync_dir + "/" + step + "/" + f))
          << step << "/" << f;
  // --async-save without checkpoints is refused before any rank starts.
  r = run(with(small(scratch_dir("async_alone"), 2), {"--async-save"}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--async-save writes the checkpoints of --save-every"), std::string::npos)
      << r.output;
}

// A job with a background save after every step is killed at random moments (kill -9 of fsdp-run,
// whose ranks then die at once; or of one rank, after which the other stops), then restarted with
// the same command line (--resume auto): it continues from the newest complete checkpoint, and the
// losses equal an uninterrupted run's. Trials draw the moment; every outcome must resume exactly.
TEST(TrainResilience, AsyncSaveKilledAtRandomMomentsResumesExactly) {
  const int steps = 40;
  const auto ref = scratch_dir("kill_ref");
  auto r = run(with(small(ref, steps), {"--nproc", "2"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto want = losses(ref);
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 4; ++trial) {
    const auto dir = scratch_dir("kill" + std::to_string(trial));
    const auto argv = with(small(dir, steps), {"--nproc", "2", "--save-every", "1", "--async-save",
                                               "--resume", "auto"});
    const pid_t pid = spawn_logged(argv, dir + ".log");
    ASSERT_GT(pid, 0);
    // After a random number of recorded steps and a random fraction of a step, kill.
    const size_t after = 3 + rng() % 20;
    const auto deadline = Clock::now() + std::chrono::seconds(90);
    while (metrics_rows(dir) < after && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
    const bool whole_job = trial % 2 == 0;
    const auto ranks = children_named(pid, "fsdp-train");
    if (whole_job || ranks.empty()) {
      ::kill(pid, SIGKILL);  // fsdp-run: its ranks die with it (PR_SET_PDEATHSIG)
    } else {
      ::kill(ranks[rng() % ranks.size()], SIGKILL);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::kill(-pid, SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the ranks' exit
    r = run(argv);
    ASSERT_EQ(r.exit_code, 0) << "trial " << trial << ":\n" << r.output;
    EXPECT_NE(r.output.find("resuming from " + dir + "/step_"), std::string::npos) << r.output;
    EXPECT_EQ(losses(dir), want) << "trial " << trial << ", killed after step " << after;
  }
}

// ---- checkpoints that must not be loaded as they stand ----

// The reproduction: --steps 3 --save-every 1, then "step": 3 edited to 2 in
// step_00000003/index.json. Named, it is refused (by the index's own checksum; with that field
// removed too, as an edit meant, by the step its directory is named for); as the run directory's
// newest, it is reported and skipped, and the run continues from step 2 with the uninterrupted
// run's losses.
TEST(TrainResilience, AnIndexWhoseStepDisagreesWithItsDirectoryIsRefused) {
  const auto dir = scratch_dir("index_step");
  auto r = run(with(small(dir, 3), {"--nproc", "2", "--save-every", "1"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto want = losses(dir);
  const std::string index = dir + "/step_00000003/index.json";
  std::string text = read_all(index);
  const auto at = text.find("\"step\": 3");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, 9, "\"step\": 2");
  std::ofstream(index, std::ios::trunc) << text;
  r = run({fsdp::testing::bin_dir() + "/fsdp-train", "--resume", dir + "/step_00000003"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("does not match its checksum"), std::string::npos) << r.output;
  const auto line = text.find("\"index_xxh64\"");
  ASSERT_NE(line, std::string::npos) << text;
  text.erase(text.rfind('\n', line) + 1, text.find('\n', line) - text.rfind('\n', line));
  std::ofstream(index, std::ios::trunc) << text;
  r = run({fsdp::testing::bin_dir() + "/fsdp-train", "--resume", dir + "/step_00000003"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("index.json says step 2, but the directory is named for step 3"),
            std::string::npos)
      << r.output;
  r = run({fsdp::testing::bin_dir() + "/fsdp-train", "--resume", dir});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("skipping " + dir + "/step_00000003 is damaged"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("resuming from " + dir + "/step_00000002 at step 2"), std::string::npos)
      << r.output;
  EXPECT_EQ(losses(dir), want);
}

// A newest checkpoint damaged inside (one flipped byte: sizes and the index are intact, so only
// the checksums see it): --resume RUN stops at the load, saying how to fall back; --resume auto
// reads each candidate against its checksums, skips it by name and reason, and continues from the
// previous one with the uninterrupted run's losses.
TEST(TrainResilience, ResumeAutoFallsBackOverACheckpointDamagedInside) {
  const auto dir = scratch_dir("flipped");
  auto r = run(with(small(dir, 6), {"--nproc", "2", "--save-every", "2"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto want = losses(dir);
  const std::string victim = dir + "/step_00000006/rank1.safetensors";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-100, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    f.seekp(-100, std::ios::end);
    c = static_cast<char>(c ^ 0x40);
    f.write(&c, 1);
  }
  r = run({fsdp::testing::bin_dir() + "/fsdp-train", "--resume", dir});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("rank1.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--resume auto --run-dir " + dir + " reads every checkpoint"),
            std::string::npos)
      << r.output;
  r = run({fsdp::testing::bin_dir() + "/fsdp-train", "--resume", "auto", "--run-dir", dir});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto skip =
      r.output.find("skipping " + dir + "/step_00000006 is damaged: safetensors file '" + victim +
                    "': checksum mismatch");
  const auto resume = r.output.find("resuming from " + dir + "/step_00000004 at step 4");
  ASSERT_NE(skip, std::string::npos) << r.output;
  ASSERT_NE(resume, std::string::npos) << r.output;
  EXPECT_LT(skip, resume);
  EXPECT_EQ(losses(dir), want);
}

// ---- the launcher killed ----

// kill -9 of torchrun (its elastic agent: the ranks' parent and their store's server) while two
// fsdp-train ranks train: both notice, say so, and stop (as on SIGTERM: after the same step,
// exit status 143) within seconds, instead of training on as orphans. This test process is the
// subreaper that inherits them, so it can wait for them.
TEST(TrainResilience, KilledTorchrunLeavesNoOrphans) {
  ASSERT_TRUE(fsdp::testing::has_torchrun())
      << fsdp::testing::torchrun_command({})[0]
      << " is missing: `make test` installs it (scripts/setup.sh)";
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  const auto dir = scratch_dir("orphans");
  const int port = fsdp::testing::free_port();
  ASSERT_GT(port, 0);
  auto argv =
      fsdp::testing::torchrun_command({"--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                                       "--master_port", std::to_string(port), "--no-python"});
  for (const auto& a : small(dir, 1000000)) argv.push_back(a);
  const pid_t torchrun = spawn_logged(argv, dir + ".log");
  ASSERT_GT(torchrun, 0);
  std::vector<pid_t> ranks;
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (Clock::now() < deadline && (metrics_rows(dir) < 3 || ranks.size() < 2)) {
    ranks = children_named(torchrun, "fsdp-train");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(ranks.size(), 2u) << read_all(dir + ".log");
  ASSERT_GE(metrics_rows(dir), 3u) << read_all(dir + ".log");
  ::kill(torchrun, SIGKILL);
  const auto killed = Clock::now();
  ::waitpid(torchrun, nullptr, 0);
  for (pid_t rank : ranks) {
    int status = 0;
    pid_t got = 0;
    while ((got = ::waitpid(rank, &status, WNOHANG)) == 0 &&
           Clock::now() - killed < std::chrono::seconds(30))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (got != rank) ::kill(rank, SIGKILL);
    ASSERT_EQ(got, rank) << "rank pid " << rank << " still trains 30 s after torchrun's death:\n"
                         << read_all(dir + ".log");
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM)
        << "status " << status << "\n"
        << read_all(dir + ".log");
  }
  const double took = std::chrono::duration<double>(Clock::now() - killed).count();
  EXPECT_LT(took, 10.0);
  const std::string log = read_all(dir + ".log");
  for (int rank : {0, 1})
    EXPECT_NE(log.find("fsdp: rank " + std::to_string(rank) + " (pid "), std::string::npos) << log;
  EXPECT_NE(log.find("the launcher that started it, torchrun's elastic agent (pid " +
                     std::to_string(torchrun)),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("training on as an orphan"), std::string::npos) << log;
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);
}

}  // namespace
}  // namespace fsdp::train
