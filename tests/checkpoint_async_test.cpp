// Asynchronous checkpoints (fsdp/checkpoint_async.h) through the multi-rank harness: the files
// equal a synchronous save's byte for byte, what is written is the model as it was at the call
// even while training goes on, the next save waits for the previous one (measured), a failure of
// the background write is raised on every rank by wait() or the next save, HSDP's replica 0 writes
// for all, and a crash at each point of a background save (a rank killed by SIGKILL) leaves the
// previous complete checkpoint the latest, loading bit for bit.
#include <fsdp/checkpoint.h>
#include <fsdp/checkpoint_async.h>
#include <fsdp/fsdp.h>
#include <fsdp/models/gpt.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "checkpoint/test_hooks.h"
#include "compat/optim.h"
#include "harness.h"
#include "tiny_gpt.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::checkpoint_async_test {
namespace {

namespace fs = std::filesystem;
namespace ck = fsdp::checkpoint;
namespace hooks = fsdp::checkpoint::test_hooks;
using models::GPT;
using namespace std::chrono_literals;

constexpr const char* kDirEnv = "FSDP_CKPT_ASYNC_TEST_DIR";

// A sharded tiny GPT with AdamW on this rank (over `mesh` when it has replicas), trained on data
// that depends on the rank and the step only, so that a later run repeats it exactly.
struct Trainee {
  Trainee(Rank& r, int replicas = 1)
      : model([] {
          torch::manual_seed(0);
          return fsdp::Sharded<GPT>(GPT(tiny_gpt()));
        }()) {
    if (replicas == 1) {
      root = models::shard_gpt(model, r.world());
    } else {
      mesh = init_mesh(r.world(), replicas);
      for (auto& b : model->blocks) fully_shard(b, mesh);
      root = fully_shard(model, mesh);
    }
    optim =
        std::make_unique<torch::optim::AdamW>(root.parameters(), torch::optim::AdamWOptions(1e-2));
  }
  void train(int rank, int from, int steps) {
    const auto cfg = tiny_gpt();
    for (int i = from; i < from + steps; ++i) {
      torch::manual_seed(100 * rank + i);
      auto x = torch::randint(0, cfg.vocab_size, {2, cfg.seq_len});
      auto y = torch::randint(0, cfg.vocab_size, {2, cfg.seq_len});
      model(x, y).backward();
      optim->step();
      optim->zero_grad();
    }
  }
  // Every shard and every optimizer-state tensor of this rank, copied.
  std::vector<torch::Tensor> snapshot() const {
    std::vector<torch::Tensor> out;
    for (auto& s : root.shards()) out.push_back(s.shard.detach().clone());
    for (auto& p : optim->param_groups())
      for (auto& t : p.params()) {
        auto it = optim->state().find(compat::optim_state_key(t));
        if (it == optim->state().end()) continue;
        auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
        out.push_back(st.exp_avg().clone());
        out.push_back(st.exp_avg_sq().clone());
      }
    return out;
  }
  fsdp::Sharded<GPT> model;
  DeviceMesh mesh;
  FSDPModule root;
  std::unique_ptr<torch::optim::AdamW> optim;
};

void expect_same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i;
}

std::string test_dir() { return test_scratch_dir(kDirEnv, "fsdp_async_"); }

RunOptions with_dir(const std::string& dir) {
  RunOptions o;
  o.env[kDirEnv] = dir;
  o.timeout = std::chrono::seconds(120);
  o.collective_timeout_s = 30;
  return o;
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

ck::TrainState at_step(int64_t step) {
  ck::TrainState s;
  s.step = step;
  s.data_position = step;
  return s;
}

// The same state saved synchronously and asynchronously: the same bytes in every file.
TEST(CheckpointAsync, FilesEqualASynchronousSaveByteForByte) {
  const std::string dir = test_dir();
  run_ranks(
      3,
      [&](Rank& r) {
        Trainee t(r);
        t.train(r.rank, 0, 2);
        ck::save(dir + "/sync", t.root, t.optim.get(), at_step(2), *r.world());
        ck::AsyncSaver saver;
        const auto ckpt = saver.save_async(dir + "/async", t.root, t.optim.get(), at_step(2));
        EXPECT_EQ(ckpt, dir + "/async/step_00000002");
        saver.wait();
        EXPECT_EQ(saver.stats().saves, 1);
        EXPECT_EQ(saver.stats().committed, 1);
        EXPECT_GT(saver.stats().staging_bytes, 0u);
      },
      with_dir(dir));
  if (in_rank_process()) return;
  for (const char* f :
       {"index.json", "rank0.safetensors", "rank1.safetensors", "rank2.safetensors"}) {
    const auto a = bytes_of(dir + "/sync/step_00000002/" + f);
    ASSERT_FALSE(a.empty()) << f;
    EXPECT_EQ(a, bytes_of(dir + "/async/step_00000002/" + f)) << f << " differs";
  }
  fs::remove_all(dir);
}

// The background write starts only after the model has trained on (the delay hook): the
// checkpoint still holds the values at the call, parameters and AdamW state, bit for bit; and a
// second save started at once waits for the first, which the statistics show.
TEST(CheckpointAsync, WritesTheStateAtTheCallAndTheNextSaveWaitsForIt) {
  const std::string dir = test_dir();
  run_ranks(
      2,
      [&](Rank& r) {
        Trainee t(r);
        t.train(r.rank, 0, 1);
        const auto at_call = t.snapshot();
        ck::AsyncSaver saver;
        hooks::delay_next_async_write(800ms);
        saver.save_async(dir, t.root, t.optim.get(), at_step(1));
        EXPECT_TRUE(saver.in_flight());
        EXPECT_LT(saver.stats().last_blocked_s, 0.5);  // the copy, not the 800 ms write
        t.train(r.rank, 1, 2);  // changes every shard and moment in place meanwhile
        const auto later = t.snapshot();
        saver.save_async(dir, t.root, t.optim.get(), at_step(3));  // waits for step 1's
        EXPECT_GT(saver.stats().last_waited_s, 0.2) << "the second save did not wait";
        EXPECT_EQ(saver.stats().committed, 1);
        saver.wait();
        EXPECT_FALSE(saver.in_flight());
        EXPECT_EQ(saver.stats().committed, 2);

        Trainee fresh(r);
        EXPECT_EQ(ck::load(dir + "/step_00000001", fresh.root, fresh.optim.get(), *r.world()).step,
                  1);
        expect_same(fresh.snapshot(), at_call);
        EXPECT_EQ(ck::load(*ck::latest(dir), fresh.root, fresh.optim.get(), *r.world()).step, 3);
        expect_same(fresh.snapshot(), later);
      },
      with_dir(dir));
  if (!in_rank_process()) fs::remove_all(dir);
}

// A synchronous save of the step an asynchronous save is still writing (the delay hook holds the
// background write back) waits for that write, then writes its own state over it: the step
// directory holds the later save's values whole, and no temporary is left (without the wait the
// delayed background write lands after it, with the older values, or the two writes share their
// temporaries and commit a file that fails its checksums).
TEST(CheckpointAsync, ASynchronousSaveWaitsForTheBackgroundWriteOfItsStep) {
  const std::string dir = test_dir();
  run_ranks(
      2,
      [&](Rank& r) {
        Trainee t(r);
        t.train(r.rank, 0, 1);
        ck::AsyncSaver saver;
        hooks::delay_next_async_write(800ms);
        saver.save_async(dir, t.root, t.optim.get(), at_step(1));
        t.train(r.rank, 1, 1);
        const auto later = t.snapshot();
        const auto t0 = std::chrono::steady_clock::now();
        ck::save(dir, t.root, t.optim.get(), at_step(1), *r.world());
        EXPECT_GT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.3)
            << "the synchronous save did not wait for the background write";
        saver.wait();
        EXPECT_EQ(saver.stats().committed, 1);
        Trainee fresh(r);
        EXPECT_EQ(ck::load(dir + "/step_00000001", fresh.root, fresh.optim.get(), *r.world()).step,
                  1);
        expect_same(fresh.snapshot(), later);
        r.world()->barrier().wait();
        if (r.rank == 0)
          for (const auto& e : fs::directory_iterator(dir + "/step_00000001"))
            EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos)
                << e.path() << " was left behind";
      },
      with_dir(dir));
  if (!in_rank_process()) fs::remove_all(dir);
}

// A background write that fails (the test hook: files written, then an error before the index)
// is raised by wait() on every rank, naming the step and saying the previous checkpoint stands;
// the next save works. A failure nobody waited for is raised by the next save_async().
TEST(CheckpointAsync, ABackgroundFailureIsRaisedByWaitOrTheNextSaveOnEveryRank) {
  const std::string dir = test_dir();
  run_ranks(
      2,
      [&](Rank& r) {
        Trainee t(r);
        ck::AsyncSaver saver;
        saver.save_async(dir, t.root, t.optim.get(), at_step(1));
        saver.wait();
        t.train(r.rank, 0, 1);
        hooks::fail_next_save_after_files(1);
        saver.save_async(dir, t.root, t.optim.get(), at_step(2));  // returns: it fails later
        expect_error([&] { saver.wait(); },
                     {"asynchronous checkpoint save of '" + dir +
                          "/step_00000002' failed in the "
                          "background",
                      "interrupted by the test hook",
                      "the previous complete checkpoint is still the latest"});
        saver.wait();  // raised once
        EXPECT_EQ(*ck::latest(dir, [](const std::string&) {}), dir + "/step_00000001");
        saver.save_async(dir, t.root, t.optim.get(), at_step(2));
        saver.wait();
        EXPECT_EQ(*ck::latest(dir), dir + "/step_00000002");

        hooks::fail_next_save_after_files(1);
        saver.save_async(dir, t.root, t.optim.get(), at_step(3));
        expect_error([&] { saver.save_async(dir, t.root, t.optim.get(), at_step(4)); },
                     {"save of '" + dir + "/step_00000003' failed in the background"});
        EXPECT_FALSE(saver.in_flight());  // step 4 was not started
        EXPECT_EQ(*ck::latest(dir, [](const std::string&) {}), dir + "/step_00000002");
        EXPECT_EQ(saver.stats().committed, 2);
      },
      with_dir(dir));
  if (!in_rank_process()) fs::remove_all(dir);
}

// HSDP, 2 replicas of 2: replica 0 writes a checkpoint of 2 shards, every rank learns the
// outcome, and it loads into plain FSDP over all 4 ranks with the values of the replicas.
TEST(CheckpointAsync, UnderHsdpReplicaZeroWritesForAll) {
  const std::string dir = test_dir();
  run_ranks(
      4,
      [&](Rank& r) {
        Trainee t(r, 2);
        t.train(r.rank, 0, 2);
        ck::AsyncSaver saver;
        std::atomic<int> commits{0};
        saver.set_on_commit([&](const std::string&) { ++commits; });
        saver.save_async(dir, t.root, t.optim.get(), at_step(2));
        saver.wait();
        EXPECT_EQ(commits.load(), 1);
        EXPECT_EQ(ck::defect(dir + "/step_00000002"), std::nullopt);
        EXPECT_FALSE(fs::exists(dir + "/step_00000002/rank2.safetensors"));
        hooks::fail_next_save_after_files(1);  // replica 0's failure reaches every replica
        saver.save_async(dir, t.root, t.optim.get(), at_step(3));
        expect_error([&] { saver.wait(); }, {"step_00000003' failed in the background"});
        Trainee plain(r);
        EXPECT_EQ(ck::load(*ck::latest(dir, [](const std::string&) {}), plain.root,
                           plain.optim.get(), *r.world())
                      .step,
                  2);
        // Full parameters: the replicas' shards, gathered, against the plain model's.
        auto a = fsdp::full_state_dict(t.root);
        auto b = fsdp::full_state_dict(plain.root);
        ASSERT_EQ(a.size(), b.size());
        for (const auto& item : a)
          EXPECT_TRUE(torch::equal(item.value(), b[item.key()])) << item.key();
      },
      with_dir(dir));
  if (!in_rank_process()) fs::remove_all(dir);
}

// ---- a crash at each point of a background save ----
struct Crash {
  hooks::SavePoint point;
  int victim;  // the rank killed there
};

std::string crash_name(const ::testing::TestParamInfo<Crash>& info) {
  const char* names[] = {"BeforeFiles", "FileInPlace", "BeforeIndex", "AfterCommit"};
  return std::string(names[static_cast<int>(info.param.point)]) + "Rank" +
         std::to_string(info.param.victim);
}

// What the crashed run left: the victim died by SIGKILL, and the latest complete checkpoint is step
// 1 (the save of step 2 reported as incomplete), or step 2 when the victim died after the commit.
void check_crashed_run(const RunResult& res, const std::string& dir, const Crash& c,
                       bool committed) {
  ASSERT_FALSE(res.timed_out) << res.output[0] << res.output[1];
  EXPECT_EQ(res.exit_codes[c.victim], 128 + SIGKILL) << res.output[c.victim];
  std::vector<std::string> reports;
  const auto latest = ck::latest(dir, [&](const std::string& s) { reports.push_back(s); });
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(*latest, dir + (committed ? "/step_00000002" : "/step_00000001"));
  if (!committed) {
    ASSERT_EQ(reports.size(), 1u);
    EXPECT_NE(reports[0].find("step_00000002' is unusable (incomplete: no index.json"),
              std::string::npos)
        << reports[0];
  }
}

class CheckpointAsyncCrash : public ::testing::TestWithParam<Crash> {};

// Run 1 saves step 1 (waited for), trains a step and starts saving step 2, in whose background
// the victim raises SIGKILL at the point; the other ranks' writes fail or are killed by the
// harness. Then the directory holds step 1 as the latest complete checkpoint (step 2 only when
// the victim died after the commit), and run 2 loads it with exactly the state the first run had
// at that step, retrained from the same data.
TEST_P(CheckpointAsyncCrash, LeavesTheLastCompleteCheckpointLoadable) {
  const Crash c = GetParam();
  const std::string dir = test_dir();  // the same in both runs (kDirEnv)
  const int world = 2;
  RunOptions opt = with_dir(dir);
  opt.expect_failure = true;
  auto res = run_ranks(
      world,
      [&](Rank& r) {
        Trainee t(r);
        t.train(r.rank, 0, 1);
        ck::AsyncSaver saver;
        saver.save_async(dir, t.root, t.optim.get(), at_step(1));
        saver.wait();
        t.train(r.rank, 1, 1);
        if (r.rank == c.victim) hooks::kill_next_save_at(c.point);
        saver.save_async(dir, t.root, t.optim.get(), at_step(2));
        t.train(r.rank, 2, 1);  // training goes on while the save is written (or dies)
        saver.wait();
        r.world()->barrier().wait();  // fails: the victim has died by now, whatever the point
      },
      opt);
  const bool committed = c.point == hooks::SavePoint::kAfterCommit;
  const int64_t want = committed ? 2 : 1;
  if (!in_rank_process()) check_crashed_run(res, dir, c, committed);
  // Run 2: the checkpoint loads (checksums verified) into the state of step `want`.
  run_ranks(
      world,
      [&](Rank& r) {
        Trainee expected(r);
        expected.train(r.rank, 0, static_cast<int>(want));
        Trainee loaded(r);
        EXPECT_EQ(ck::load(*ck::latest(dir, [](const std::string&) {}), loaded.root,
                           loaded.optim.get(), *r.world())
                      .step,
                  want);
        expect_same(loaded.snapshot(), expected.snapshot());
        // The next save into the same directory completes, and clears the killed temporaries.
        ck::save(dir, loaded.root, loaded.optim.get(), at_step(5), *r.world());
        EXPECT_EQ(*ck::latest(dir), dir + "/step_00000005");
      },
      with_dir(dir));
  if (in_rank_process()) return;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Points, CheckpointAsyncCrash,
                         ::testing::Values(Crash{hooks::SavePoint::kBeforeFiles, 1},
                                           Crash{hooks::SavePoint::kFileInPlace, 0},
                                           Crash{hooks::SavePoint::kFileInPlace, 1},
                                           Crash{hooks::SavePoint::kBeforeIndex, 0},
                                           Crash{hooks::SavePoint::kAfterCommit, 1}),
                         crash_name);

}  // namespace
}  // namespace fsdp::testing::checkpoint_async_test
