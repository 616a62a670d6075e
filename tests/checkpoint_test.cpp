// Sharded checkpoints through the multi-rank harness: round trips across world sizes with
// bit-identical consolidated values (parameters and optimizer state), an interrupted save, hostile
// checkpoints (checksum, truncation, missing tensors, dtype/shape mismatch), init_from, and the
// independent Python reader on a consolidated file.
#include <fsdp/checkpoint.h>
#include <fsdp/fsdp.h>
#include <fsdp/models/gpt.h>
#include <fsdp/optim.h>
#include <fsdp/safetensors_torch.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "checkpoint/hex.h"
#include "checkpoint/test_hooks.h"
#include "harness.h"
#include "tiny_gpt.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::checkpoint_test {
namespace {

namespace fs = std::filesystem;
namespace ck = fsdp::checkpoint;
namespace st = fsdp::safetensors;
using models::GPT;
using models::GPTConfig;

constexpr const char* kDirEnv = "FSDP_CKPT_TEST_DIR";

// LibTorch's optimizers, and fsdp::optim's fused ones (their state layout is LibTorch's).
enum class Opt { kAdamW, kAdam, kSGD, kFusedAdamW, kFusedSGD };

// A sharded GPT and its optimizer on this rank.
struct Trainee {
  explicit Trainee(Rank& r, GPTConfig cfg = tiny_gpt(), int seed = 0, Opt opt = Opt::kAdamW,
                   at::ScalarType dtype = at::kFloat)
      : model([&] {
          torch::manual_seed(seed);
          return fsdp::Sharded<GPT>(GPT(cfg));
        }()) {
    cfg_ = cfg;
    if (dtype != at::kFloat) model->to(dtype);
    root = models::shard_gpt(model, r.world());
    if (opt == Opt::kAdamW) {
      optim = std::make_unique<torch::optim::AdamW>(root.parameters(),
                                                    torch::optim::AdamWOptions(1e-2));
    } else if (opt == Opt::kAdam) {
      optim = std::make_unique<torch::optim::Adam>(root.parameters(),
                                                   torch::optim::AdamOptions(1e-2).amsgrad(true));
    } else if (opt == Opt::kSGD) {
      optim = std::make_unique<torch::optim::SGD>(root.parameters(),
                                                  torch::optim::SGDOptions(1e-2).momentum(0.9));
    } else if (opt == Opt::kFusedAdamW) {
      optim =
          std::make_unique<fsdp::optim::AdamW>(root.parameters(), torch::optim::AdamWOptions(1e-2));
    } else {
      optim = std::make_unique<fsdp::optim::SGD>(root.parameters(),
                                                 torch::optim::SGDOptions(1e-2).momentum(0.9));
    }
  }
  void train(int rank, int steps) {
    for (int i = 0; i < steps; ++i) {
      torch::manual_seed(100 * rank + i);
      auto x = torch::randint(0, cfg_.vocab_size, {2, cfg_.seq_len});
      auto y = torch::randint(0, cfg_.vocab_size, {2, cfg_.seq_len});
      auto loss = model(x, y);
      loss.backward();
      optim->step();
      optim->zero_grad();
    }
  }
  std::vector<torch::Tensor> snapshot() const {
    std::vector<torch::Tensor> out;
    for (auto& s : root.shards()) out.push_back(s.shard.detach().clone());
    return out;
  }
  fsdp::Sharded<GPT> model;
  FSDPModule root;
  std::unique_ptr<torch::optim::Optimizer> optim;
  GPTConfig cfg_;
};

std::string test_dir() { return test_scratch_dir(kDirEnv, "fsdp_ckpt_"); }

RunOptions with_dir(const std::string& dir) {
  RunOptions o;
  o.env[kDirEnv] = dir;
  o.timeout = std::chrono::seconds(90);
  return o;
}

// Every tensor of a checkpoint (parameters and optimizer state), reassembled in full.
std::map<std::string, torch::Tensor> full_tensors(const std::string& ckpt) {
  auto idx = ck::parse_index(st::read_text(ckpt + "/index.json", 1 << 26), ckpt);
  std::map<int, std::unique_ptr<st::File>> files;
  std::map<std::string, torch::Tensor> out;
  for (const auto& e : idx.tensors) {
    std::vector<torch::Tensor> parts;
    for (const auto& p : e.pieces) {
      auto& f = files[p.rank];
      if (!f)
        f = st::File::open_verified(ckpt + "/" + idx.files[p.rank].name, idx.files[p.rank].sums);
      parts.push_back(st::read_tensor(*f, e.name));
    }
    out[e.name] = e.replicated ? parts[0] : torch::cat(parts).reshape(e.global_shape);
  }
  return out;
}

std::map<std::string, torch::Tensor> file_tensors(const std::string& path) {
  auto f = st::File::open(path);
  std::map<std::string, torch::Tensor> out;
  for (const auto& t : f->header().tensors) out[t.name] = st::read_tensor(*f, t.name);
  return out;
}

void expect_bit_identical(const std::map<std::string, torch::Tensor>& a,
                          const std::map<std::string, torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    const auto& u = b.at(name);
    ASSERT_EQ(t.sizes(), u.sizes()) << name;
    ASSERT_EQ(t.scalar_type(), u.scalar_type()) << name;
    EXPECT_EQ(std::memcmp(t.data_ptr(), u.data_ptr(), t.numel() * t.element_size()), 0)
        << name << " differs";
  }
}

// ---- round trips ----
struct Trip {
  int from, to;
  Opt opt;
};

void PrintTo(const Trip& t, std::ostream* os) {
  *os << t.from << " -> " << t.to << " ranks, optimizer " << static_cast<int>(t.opt);
}

class RoundTrip : public ::testing::TestWithParam<Trip> {};

TEST_P(RoundTrip, ConsolidatedValuesAreBitIdentical) {
  const Trip t = GetParam();
  const std::string dir = test_dir();
  auto opts = with_dir(dir);
  // Save at `from` ranks after two steps.
  run_ranks(
      t.from,
      [&](Rank& r) {
        Trainee run(r, tiny_gpt(), 0, t.opt);
        run.train(r.rank, 2);
        ck::TrainState s;
        s.step = 2;
        s.data_position = 4096;
        s.rng_state = std::string("\x01\x00\xfe", 3);
        s.extra = {{"note", "trip"}};
        auto ckpt = ck::save(dir + "/a", run.root, run.optim.get(), s, *r.world());
        EXPECT_EQ(ckpt, dir + "/a/step_00000002");
        if (r.rank == 0) ck::consolidate(ckpt, dir + "/full_a.safetensors");
      },
      opts);
  // Load at `to` ranks into a differently initialised model, save again; init_from the full file.
  run_ranks(
      t.to,
      [&](Rank& r) {
        Trainee run(r, tiny_gpt(), 7, t.opt);
        auto ckpt = ck::latest(dir + "/a");
        ASSERT_TRUE(ckpt.has_value());
        auto s = ck::load(*ckpt, run.root, run.optim.get(), *r.world());
        EXPECT_EQ(s.step, 2);
        EXPECT_EQ(s.data_position, 4096);
        EXPECT_EQ(s.rng_state, std::string("\x01\x00\xfe", 3));
        EXPECT_EQ(s.extra["note"], "trip");
        ck::save(dir + "/b", run.root, run.optim.get(), s, *r.world());
        if (r.rank == 0) ck::consolidate(dir + "/b/step_00000002", dir + "/full_b.safetensors");

        Trainee fresh(r, tiny_gpt(), 9, t.opt);
        ck::init_from(dir + "/full_a.safetensors", fresh.root);
        auto a = run.snapshot(), b = fresh.snapshot();
        for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << i;
        // Training continues from the loaded state on every rank.
        run.train(r.rank, 1);
      },
      opts);
  if (in_rank_process()) return;
  expect_bit_identical(file_tensors(dir + "/full_a.safetensors"),
                       file_tensors(dir + "/full_b.safetensors"));
  auto fa = full_tensors(dir + "/a/step_00000002");
  auto fb = full_tensors(dir + "/b/step_00000002");
  expect_bit_identical(fa, fb);
  // Optimizer state is present (and was compared above).
  const bool sgd = t.opt == Opt::kSGD || t.opt == Opt::kFusedSGD;
  const char* probe = sgd ? "wte.weight::momentum_buffer" : "wte.weight::exp_avg";
  EXPECT_TRUE(fa.count(probe)) << probe;
  if (t.opt == Opt::kAdam) {
    EXPECT_TRUE(fa.count("wte.weight::max_exp_avg_sq"));
  }
  if (!sgd) {
    EXPECT_EQ(fa.at("wte.weight::step").item<int64_t>(), 2);
  }
  auto idx = ck::parse_index(st::read_text(dir + "/b/step_00000002/index.json", 1 << 26), "b");
  EXPECT_EQ(idx.world_size, t.to);
  fs::remove_all(dir);
}

std::string trip_name(const ::testing::TestParamInfo<Trip>& info) {
  static const char* kOpt[] = {"AdamW", "Adam", "SGD", "FusedAdamW", "FusedSGD"};
  return std::to_string(info.param.from) + "to" + std::to_string(info.param.to) +
         kOpt[static_cast<int>(info.param.opt)];
}

INSTANTIATE_TEST_SUITE_P(Worlds, RoundTrip,
                         ::testing::Values(Trip{2, 2, Opt::kAdamW}, Trip{2, 3, Opt::kAdamW},
                                           Trip{3, 1, Opt::kAdamW}, Trip{1, 4, Opt::kAdamW},
                                           Trip{2, 3, Opt::kSGD}, Trip{3, 2, Opt::kAdam},
                                           Trip{2, 3, Opt::kFusedAdamW},
                                           Trip{3, 2, Opt::kFusedSGD}),
                         trip_name);

// fsdp::optim's optimizers write and read LibTorch's state layout: a checkpoint saved with one
// loads into the other (at another world size), and training goes on with the same bits either
// way. Saved at 2 ranks after 2 steps by each kind, loaded at 3 ranks by both kinds, 2 more steps.
TEST(Checkpoint, FusedAndLibTorchOptimizersShareCheckpoints) {
  const std::string dir = test_dir();
  auto opts = with_dir(dir);
  for (auto [saver, name] :
       {std::pair{Opt::kAdamW, "torch"}, std::pair{Opt::kFusedAdamW, "fused"},
        std::pair{Opt::kSGD, "torch_sgd"}, std::pair{Opt::kFusedSGD, "fused_sgd"}}) {
    run_ranks(
        2,
        [&, saver = saver, name = name](Rank& r) {
          Trainee run(r, tiny_gpt(), 0, saver);
          run.train(r.rank, 2);
          ck::TrainState s;
          s.step = 2;
          ck::save(dir + "/" + name, run.root, run.optim.get(), s, *r.world());
        },
        opts);
  }
  run_ranks(
      3,
      [&](Rank& r) {
        for (bool sgd : {false, true}) {
          // Every saved kind into every loading kind: one result.
          std::vector<std::vector<torch::Tensor>> after;
          for (const char* saved : {"torch", "fused"}) {
            for (Opt loader : sgd ? std::vector<Opt>{Opt::kSGD, Opt::kFusedSGD}
                                  : std::vector<Opt>{Opt::kAdamW, Opt::kFusedAdamW}) {
              Trainee run(r, tiny_gpt(), 7, loader);
              const std::string from = dir + "/" + saved + (sgd ? "_sgd" : "");
              ck::load(from + "/step_00000002", run.root, run.optim.get(), *r.world());
              run.train(r.rank, 2);
              after.push_back(run.snapshot());
            }
          }
          // Bitwise where the CPU has FMA (include/fsdp/optim.h, Numerics).
          const bool fma = __builtin_cpu_supports("fma");
          for (size_t k = 1; k < after.size(); ++k)
            for (size_t i = 0; i < after[0].size(); ++i)
              EXPECT_TRUE(fma ? torch::equal(after[0][i], after[k][i])
                              : torch::allclose(after[0][i], after[k][i], 1e-6, 1e-9))
                  << (sgd ? "SGD" : "AdamW") << ": combination " << k << ", shard " << i;
        }
      },
      opts);
  if (!in_rank_process()) fs::remove_all(dir);
}

// ---- interrupted save ----
TEST(Checkpoint, InterruptedSaveLeavesPreviousLoadable) {
  const std::string dir = test_dir();
  run_ranks(
      2,
      [&](Rank& r) {
        Trainee run(r);
        run.train(r.rank, 1);
        ck::TrainState s;
        s.step = 1;
        ck::save(dir, run.root, run.optim.get(), s, *r.world());
        auto saved = run.snapshot();
        run.train(r.rank, 1);
        s.step = 2;
        ck::test_hooks::fail_next_save_after_files(1);
        expect_error([&] { ck::save(dir, run.root, run.optim.get(), s, *r.world()); },
                     {"interrupted", "step_00000002"});
        r.world()->barrier().wait();
        // The new checkpoint is visibly incomplete, the previous one is the latest.
        EXPECT_TRUE(fs::exists(dir + "/step_00000002/rank0.safetensors"));
        EXPECT_FALSE(fs::exists(dir + "/step_00000002/rank1.safetensors"));
        EXPECT_FALSE(fs::exists(dir + "/step_00000002/index.json"));
        ASSERT_EQ(ck::latest(dir), dir + "/step_00000001");
        expect_error(
            [&] { ck::load(dir + "/step_00000002", run.root, run.optim.get(), *r.world()); },
            {"step_00000002", "has no index.json", "did not complete"});
        auto st1 = ck::load(*ck::latest(dir), run.root, run.optim.get(), *r.world());
        EXPECT_EQ(st1.step, 1);
        auto now = run.snapshot();
        for (size_t i = 0; i < now.size(); ++i) EXPECT_TRUE(torch::equal(now[i], saved[i])) << i;
        run.train(r.rank, 1);  // still trains
      },
      with_dir(dir));
  if (!in_rank_process()) fs::remove_all(dir);
}

// ---- a damaged newest checkpoint is reported, temporaries of killed saves, retention ----
// A pid that no process holds: a child that has exited and been reaped.
int dead_pid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

TEST(CheckpointScan, DamagedNewestIsReportedStaleTemporariesGoRetentionKeepsNewest) {
  const std::string dir = test_dir();
  run_ranks(
      2,
      [&](Rank& r) {
        auto& comm = *r.world();
        Trainee run(r);
        ck::TrainState s;
        for (int step = 1; step <= 3; ++step) {
          s.step = step;
          ck::save(dir, run.root, run.optim.get(), s, comm);
        }
        const std::string s1 = dir + "/step_00000001", s2 = dir + "/step_00000002",
                          s3 = dir + "/step_00000003", s4 = dir + "/step_00000004";
        const std::string dead_tmp = s2 + "/rank1.safetensors.tmp." + std::to_string(dead_pid());
        const std::string live_tmp = s2 + "/rank0.safetensors.tmp." + std::to_string(::getppid());
        if (r.rank == 0) {
          // The newest checkpoint's index is cut short (a torn copy, a bad disk).
          fs::resize_file(s3 + "/index.json", fs::file_size(s3 + "/index.json") / 2);
          std::ofstream(dead_tmp) << "killed save";
          std::ofstream(live_tmp) << "a save in progress";
        }
        comm.barrier().wait();

        // Reported by name and reason before the fallback; the reason is there for the trainer.
        std::vector<std::string> lines;
        auto got = ck::latest(dir, [&](const std::string& l) { lines.push_back(l); });
        EXPECT_EQ(got, s2);
        ASSERT_EQ(lines.size(), 1u);
        EXPECT_NE(lines[0].find("checkpoint '" + s3 + "' is unusable (damaged: "),
                  std::string::npos)
            << lines[0];
        EXPECT_NE(lines[0].find("not valid JSON"), std::string::npos) << lines[0];
        EXPECT_NE(lines[0].find("falling back to '" + s2 + "'"), std::string::npos) << lines[0];
        auto scan = ck::scan(dir);
        ASSERT_EQ(scan.skipped.size(), 1u);
        EXPECT_EQ(scan.skipped[0].path, s3);
        EXPECT_EQ(ck::defect(s2), std::nullopt);
        EXPECT_NE(ck::defect(s3)->find("damaged: "), std::string::npos);
        EXPECT_NE(ck::defect(dir + "/step_00000009")->find("incomplete: no index.json"),
                  std::string::npos);

        comm.barrier().wait();  // rank 0's next save starts step 4's directory at once

        // The next save clears the temporaries of dead writers only.
        s.step = 4;
        ck::save(dir, run.root, run.optim.get(), s, comm);
        EXPECT_FALSE(fs::exists(dead_tmp));
        EXPECT_TRUE(fs::exists(live_tmp));
        comm.barrier().wait();

        // Keep the newest two complete: step 1 goes; damaged step 3 is newer than step 2, kept.
        if (r.rank == 0) {
          fs::remove(live_tmp);
          EXPECT_EQ(ck::keep_last(dir, 2), std::vector<std::string>{s1});
          EXPECT_TRUE(fs::exists(s2) && fs::exists(s3) && fs::exists(s4));
          EXPECT_EQ(ck::keep_last(dir, 1), (std::vector<std::string>{s2, s3}));
          EXPECT_EQ(ck::latest(dir), s4);
          expect_error([&] { ck::keep_last(dir, 0); }, {"keep = 0 must be at least 1"});
        }
        comm.barrier().wait();
      },
      with_dir(dir));
  if (!in_rank_process()) fs::remove_all(dir);
}

TEST(CheckpointScan, OnlyADamagedCheckpointIsReportedNotCalledMissing) {
  const std::string dir = test_dir();
  fs::create_directories(dir + "/step_00000005");
  std::ofstream(dir + "/step_00000005/index.json") << "{\"format\": \"fsdp-cpp-checkpoint\"";
  std::vector<std::string> lines;
  EXPECT_EQ(ck::latest(dir, [&](const std::string& l) { lines.push_back(l); }), std::nullopt);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("step_00000005' is unusable (damaged: "), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("no older complete checkpoint"), std::string::npos) << lines[0];
  fs::remove_all(dir);
}

// ---- hostile checkpoints, through load on every rank ----
TEST(CheckpointHostile, CorruptTruncatedMissingMismatched) {
  const std::string dir = test_dir();
  run_ranks(
      2,
      [&](Rank& r) {
        auto& comm = *r.world();
        Trainee run(r);
        run.train(r.rank, 1);
        ck::TrainState s;
        s.step = 1;
        auto good = ck::save(dir + "/good", run.root, run.optim.get(), s, comm);
        // Rank 0 prepares a damaged copy; every rank loads it and must raise the same error.
        auto damaged = [&](const std::string& name,
                           const std::function<void(const std::string&)>& damage) {
          std::string d = dir + "/" + name;
          if (r.rank == 0) {
            fs::copy(good, d, fs::copy_options::recursive);
            damage(d);
          }
          comm.barrier().wait();
          return d;
        };
        auto flip_tail_byte = [](const std::string& path) {
          std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
          f.seekp(-3, std::ios::end);
          f.put('\x7f');
        };
        // An edit of the index: with its checksum removed (an edit meant, or an index from before
        // indexes carried one), load's own checks against the files and the model must catch it;
        // with the checksum kept, the checksum does.
        auto edit_index = [](const std::string& d, const std::function<void(nlohmann::json&)>& fn,
                             bool keep_checksum = false) {
          auto j = nlohmann::json::parse(st::read_text(d + "/index.json", 1 << 26));
          EXPECT_TRUE(j.contains("index_xxh64"));
          fn(j);
          if (!keep_checksum) j.erase("index_xxh64");
          std::ofstream(d + "/index.json", std::ios::trunc) << j.dump();
        };

        auto c = damaged("checksum",
                         [&](const std::string& d) { flip_tail_byte(d + "/rank1.safetensors"); });
        expect_error([&] { ck::load(c, run.root, run.optim.get(), comm); },
                     {"rank1.safetensors", "checksum mismatch", "tensor '"});

        auto t = damaged("truncated", [&](const std::string& d) {
          fs::resize_file(d + "/rank0.safetensors", fs::file_size(d + "/rank0.safetensors") - 16);
        });
        expect_error([&] { ck::load(t, run.root, run.optim.get(), comm); },
                     {"rank0.safetensors", "truncated or replaced"});

        auto m = damaged("missing", [&](const std::string& d) {
          edit_index(d, [](auto& j) { j["tensors"].erase("h.1.c_fc.weight"); });
        });
        expect_error([&] { ck::load(m, run.root, run.optim.get(), comm); },
                     {"missing", "missing tensors 'h.1.c_fc.weight'", "different model"});

        // Edits that leave a valid index: another data position, a piece of optimizer state
        // dropped (it would load as never stepped). Refused by the index's checksum, by load and
        // by defect() (so latest() passes over it).
        for (const auto& [name, edit] :
             std::vector<std::pair<std::string, std::function<void(nlohmann::json&)>>>{
                 {"position", [](auto& j) { j["data_position"] = 31; }},
                 {"state", [](auto& j) { j["tensors"].erase("h.1.c_fc.weight::exp_avg"); }}}) {
          auto e = damaged("edited_" + name, [&](const std::string& d) {
            edit_index(d, edit, /*keep_checksum=*/true);
          });
          expect_error([&] { ck::load(e, run.root, run.optim.get(), comm); },
                       {"index.json", "does not match its checksum", "changed after it was written",
                        "remove the field 'index_xxh64'"});
          const auto why = ck::defect(e);
          ASSERT_TRUE(why.has_value()) << name;
          EXPECT_NE(why->find("damaged: "), std::string::npos) << *why;
          EXPECT_NE(why->find("does not match its checksum"), std::string::npos) << *why;
        }

        auto lie = damaged("shape_lie", [&](const std::string& d) {
          // The index claims a shape the file does not hold: caught against the model first.
          edit_index(d, [](auto& j) { j["tensors"]["ln_f.weight"]["shape"] = {16, 1}; });
        });
        expect_error(
            [&] { ck::load(lie, run.root, run.optim.get(), comm); },
            {"tensor 'ln_f.weight'", "shape [16, 1] in the checkpoint, [16] in the model"});

        // A model of another shape, and of another dtype.
        GPTConfig wide = tiny_gpt();
        wide.n_embd = 24;
        Trainee other(r, wide);
        expect_error([&] { ck::load(good, other.root, other.optim.get(), comm); },
                     {"in the checkpoint", "in the model", "configuration differs"});
        Trainee dbl(r, tiny_gpt(), 0, Opt::kAdamW, at::kDouble);
        expect_error([&] { ck::load(good, dbl.root, dbl.optim.get(), comm); },
                     {"is F32 in the checkpoint, F64 in the model"});
        // Another optimizer type.
        Trainee sgd(r, tiny_gpt(), 0, Opt::kSGD);
        expect_error([&] { ck::load(good, sgd.root, sgd.optim.get(), comm); },
                     {"holds adamw state, the optimizer is sgd"});
        // init_from a file lacking a tensor.
        if (r.rank == 0) {
          ck::consolidate(good, dir + "/full.safetensors");
          auto full = file_tensors(dir + "/full.safetensors");
          full.erase("wpe.weight");
          std::vector<st::TensorView> views;
          for (auto& [n, x] : full) views.push_back(st::view_of(n, x));
          st::write(dir + "/partial.safetensors", views);
        }
        comm.barrier().wait();
        expect_error([&] { ck::init_from(dir + "/partial.safetensors", run.root); },
                     {"partial.safetensors", "missing tensors 'wpe.weight'"});
        // The intact checkpoint still loads.
        EXPECT_EQ(ck::load(good, run.root, run.optim.get(), comm).step, 1);
      },
      with_dir(dir));
  if (!in_rank_process()) fs::remove_all(dir);
}

// ---- an independent reader agrees with the consolidated file ----
TEST(Checkpoint, PythonReaderReadsConsolidatedFile) {
  const char* py = "/usr/bin/python3";
  if (::access(py, X_OK) != 0) GTEST_SKIP() << py << " not found; the independent reader needs it";
  const std::string dir = test_dir();
  run_ranks(
      2,
      [&](Rank& r) {
        Trainee run(r);
        run.train(r.rank, 1);
        auto ckpt = ck::save(dir, run.root, run.optim.get(), {}, *r.world());
        if (r.rank == 0) ck::consolidate(ckpt, dir + "/full.safetensors");
      },
      with_dir(dir));
  if (in_rank_process()) return;
  auto res = run_process(
      {py, FSDP_SOURCE_DIR "/tests/read_safetensors.py", dir + "/full.safetensors", "--xxh64"},
      std::chrono::seconds(60));
  ASSERT_EQ(res.exit_code, 0) << res.output;
  auto tensors = file_tensors(dir + "/full.safetensors");
  EXPECT_EQ(tensors.size(), static_cast<size_t>(2 + 2 * 12 + 2));  // wte, wpe, 12 per block, ln_f
  for (const auto& [name, t] : tensors) {
    double sum = 0;
    auto f = t.contiguous();
    for (int64_t i = 0; i < f.numel(); ++i) sum += static_cast<double>(f.data_ptr<float>()[i]);
    char line[512];
    std::string shape;
    for (int64_t i = 0; i < t.dim(); ++i) shape += (i ? ", " : "") + std::to_string(t.size(i));
    std::snprintf(line, sizeof line, "%s F32 [%s] sum=%.17g\n", name.c_str(), shape.c_str(), sum);
    EXPECT_NE(res.output.find(line), std::string::npos) << line << "not in\n" << res.output;
  }
  std::ifstream in(dir + "/full.safetensors", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(
      res.output.find("xxh64 " + fsdp::hex::encode_u64(st::xxh64(bytes.data(), bytes.size()))),
      std::string::npos)
      << res.output;
  fs::remove_all(dir);
}

// ---- save/load times for fsdp-train's default model (printed, not asserted) ----
TEST(Checkpoint, TimesForTrainerDefaultModel) {
  const std::string dir = test_dir();
  run_ranks(
      2,
      [&](Rank& r) {
        GPTConfig cfg;  // fsdp-train defaults: 4 layers, 4 heads, width 128, seq 64, vocab 256
        cfg.n_layer = 4;
        cfg.n_head = 4;
        cfg.n_embd = 128;
        cfg.seq_len = 64;
        Trainee run(r, cfg);
        run.train(r.rank, 1);
        auto& comm = *r.world();
        using Clock = std::chrono::steady_clock;
        auto secs = [](Clock::time_point a) {
          return std::chrono::duration<double>(Clock::now() - a).count();
        };
        comm.barrier().wait();
        auto t0 = Clock::now();
        auto ckpt = ck::save(dir, run.root, run.optim.get(), {}, comm);
        double save_s = secs(t0);
        t0 = Clock::now();
        ck::load(ckpt, run.root, run.optim.get(), comm);
        double load_s = secs(t0);
        if (r.rank == 0) {
          t0 = Clock::now();
          ck::consolidate(ckpt, dir + "/full.safetensors");
          double cons_s = secs(t0);
          int64_t params = 0;
          for (auto& p : run.model->parameters()) params += p.numel();
          uint64_t bytes = 0;
          for (auto& e : fs::directory_iterator(ckpt)) bytes += fs::file_size(e.path());
          std::ofstream(dir + "/timing.txt")
              << "world 2, " << params << " parameters, AdamW state, " << bytes
              << " checkpoint bytes: save " << save_s * 1e3 << " ms, load " << load_s * 1e3
              << " ms, consolidate " << cons_s * 1e3 << " ms\n";
        }
      },
      with_dir(dir));
  if (in_rank_process()) return;
  std::ifstream in(dir + "/timing.txt");
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  std::cout << "[ timing ] " << line << std::endl;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fsdp::testing::checkpoint_test
