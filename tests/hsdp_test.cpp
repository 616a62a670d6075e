// HSDP (a 2-D mesh, replicas x shards): the GPT trained on 4 ranks as 2 replicas x 2 shards
// matches the unsharded model (fp64, one global batch) and plain FSDP over the same 4 ranks, step
// by step; under the audit. Checkpoints are written once (by replica 0) and load into any layout
// (HSDP 2x2 <-> plain FSDP at 4, and 4 x 1).
#include <fsdp/checkpoint.h>
#include <fsdp/models/gpt.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "fsdp_test_util.h"
#include "tiny_gpt.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::hsdp_test {
namespace {

namespace fs = std::filesystem;
using fsdp::models::GPT;

constexpr int kSteps = 5;
constexpr int64_t kGlobalBatch = 8;

fsdp::Sharded<GPT> build() {
  torch::manual_seed(0);
  fsdp::Sharded<GPT> m{GPT(tiny_gpt())};
  m->to(torch::kDouble);
  return m;
}

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(700 + step);
  auto tokens = torch::randint(0, tiny_gpt().vocab_size, {kGlobalBatch, tiny_gpt().seq_len + 1},
                               torch::kLong);
  return {tokens.narrow(1, 0, tiny_gpt().seq_len), tokens.narrow(1, 1, tiny_gpt().seq_len)};
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

// The unsharded reference: the whole global batch at once.
std::vector<double> reference(fsdp::Sharded<GPT>& m, int steps) {
  torch::optim::AdamW opt(m->parameters(), adamw());
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(s);
    auto loss = m->forward(x, y);
    loss.backward();
    opt.step();
    opt.zero_grad();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

// Trains `steps` steps on world rank `rank` of `world` ranks (each rank its slice of the batch).
std::vector<double> train(fsdp::Sharded<GPT>& model, FSDPModule& root, torch::optim::Optimizer& opt,
                          Communicator& world, int first, int steps) {
  const int64_t per = kGlobalBatch / world.size();
  std::vector<double> losses;
  for (int s = first; s < first + steps; ++s) {
    auto [x, y] = batch(s);
    auto loss = model(x.narrow(0, world.rank() * per, per), y.narrow(0, world.rank() * per, per));
    loss.backward();
    opt.step();
    opt.zero_grad();
    auto l = loss.detach().clone();
    world.all_reduce(l, ReduceOp::kAvg).wait();
    losses.push_back(l.item<double>());
  }
  return losses;
}

FSDPModule shard(fsdp::Sharded<GPT>& model, const DeviceMesh& mesh) {
  for (auto& b : model->blocks) fully_shard(b, mesh, audited());
  return fully_shard(model, mesh, audited());
}

TEST(Hsdp, TwoByTwoMatchesUnshardedAndPlainFsdp) {
  run_ranks(4, [](Rank& r) {
    auto ref = build();
    auto want = reference(ref, kSteps);

    auto world = r.world();
    auto mesh = init_mesh(world, 2);
    ASSERT_EQ(mesh.shards(), 2);
    ASSERT_EQ(mesh.replicate->size(), 2);
    EXPECT_EQ(mesh.replica_index(), r.rank / 2);
    auto hsdp_model = build();
    auto hsdp = shard(hsdp_model, mesh);
    torch::optim::AdamW hsdp_opt(hsdp.parameters(), adamw());
    auto hsdp_losses = train(hsdp_model, hsdp, hsdp_opt, *world, 0, kSteps);

    auto plain_model = build();
    auto plain = fsdp::models::shard_gpt(plain_model, world->split("plain"), audited(), audited());
    torch::optim::AdamW plain_opt(plain.parameters(), adamw());
    auto plain_losses = train(plain_model, plain, plain_opt, *world, 0, kSteps);

    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(hsdp_losses[s], want[s], 1e-10 * std::abs(want[s])) << "step " << s;
      EXPECT_NEAR(hsdp_losses[s], plain_losses[s], 1e-10 * std::abs(want[s])) << "step " << s;
    }
    // Shards (over the 2 ranks of a replica) equal the reference's rows; replicas hold equal ones.
    expect_shards_equal(hsdp, *ref.ptr(), 1e-9, 1e-11);
    expect_shards_equal(plain, *ref.ptr(), 1e-9, 1e-11);
    for (const auto& s : hsdp.shards()) {
      auto mine = s.shard.detach().clone();
      auto theirs = mine.clone();
      mesh.replicate->broadcast(theirs, 0).wait();
      EXPECT_TRUE(torch::equal(mine, theirs)) << s.name << " differs across replicas";
    }
  });
}

std::string shared_dir() {
  static const char* kEnv = "FSDP_TEST_HSDP_DIR";
  if (const char* d = std::getenv(kEnv)) return d;
  return "";
}

// Saved under HSDP 2x2 (only replica 0 writes: 2 rank files), loaded as plain FSDP at 4 and as
// HSDP 4x1, and the other way round; the loaded runs continue exactly as the saving run does.
std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(Hsdp, CheckpointsLoadIntoAnyLayout) {
  auto dir = fs::temp_directory_path() / ("fsdp_hsdp_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  RunOptions o;
  o.env["FSDP_TEST_HSDP_DIR"] = dir.string();
  run_ranks(
      4,
      [](Rank& r) {
        const std::string d = shared_dir();
        auto world = r.world();
        auto mesh = init_mesh(world, 2);
        auto model = build();
        auto root = shard(model, mesh);
        torch::optim::AdamW opt(root.parameters(), adamw());
        train(model, root, opt, *world, 0, 2);
        auto ckpt = checkpoint::save(d + "/hsdp", root, &opt, {2, 0, {}, {}}, *mesh.shard);
        world->barrier().wait();
        int files = 0;
        for (const auto& e : fs::directory_iterator(ckpt))
          if (e.path().extension() == ".safetensors") ++files;
        EXPECT_EQ(files, 2) << "one file per rank of a replica, written once";
        // The world may be passed too: the same checkpoint.
        auto same = checkpoint::save(d + "/hsdp_world", root, &opt, {2, 0, {}, {}}, *world);
        world->barrier().wait();
        for (const auto& e : fs::directory_iterator(ckpt)) {
          const auto other = fs::path(same) / e.path().filename();
          ASSERT_TRUE(fs::exists(other)) << other;
          if (e.path().extension() == ".safetensors") {
            EXPECT_TRUE(read_bytes(e.path()) == read_bytes(other)) << other << " differs";
          }
        }
        auto cont = train(model, root, opt, *world, 2, 2);

        // Plain FSDP over the 4 ranks.
        auto plain_model = build();
        auto plain =
            fsdp::models::shard_gpt(plain_model, world->split("plain"), audited(), audited());
        torch::optim::AdamW plain_opt(plain.parameters(), adamw());
        EXPECT_EQ(checkpoint::load(ckpt, plain, &plain_opt, plain.communicator()).step, 2);
        auto plain_cont = train(plain_model, plain, plain_opt, *world, 2, 2);
        // HSDP with 4 replicas of 1 rank.
        auto mesh4 = init_mesh(world, 4);
        auto rep_model = build();
        auto rep = shard(rep_model, mesh4);
        torch::optim::AdamW rep_opt(rep.parameters(), adamw());
        checkpoint::load(ckpt, rep, &rep_opt, *mesh4.shard);
        auto rep_cont = train(rep_model, rep, rep_opt, *world, 2, 2);
        for (int s = 0; s < 2; ++s) {
          EXPECT_NEAR(plain_cont[s], cont[s], 1e-12 * std::abs(cont[s])) << "plain, step " << s;
          EXPECT_NEAR(rep_cont[s], cont[s], 1e-12 * std::abs(cont[s])) << "4x1, step " << s;
        }
        // And back: plain FSDP's checkpoint into HSDP 2x2.
        auto ckpt2 =
            checkpoint::save(d + "/plain", plain, &plain_opt, {4, 0, {}, {}}, plain.communicator());
        auto back_model = build();
        auto back = shard(back_model, init_mesh(world, 2));
        torch::optim::AdamW back_opt(back.parameters(), adamw());
        checkpoint::load(ckpt2, back, &back_opt, back.communicator());
        auto a = train(back_model, back, back_opt, *world, 4, 1);
        auto b = train(plain_model, plain, plain_opt, *world, 4, 1);
        EXPECT_NEAR(a[0], b[0], 1e-12 * std::abs(b[0]));
      },
      o);
  fs::remove_all(dir);
}

TEST(Hsdp, BadMeshesFailByMessage) {
  run_ranks(4, [](Rank& r) {
    auto world = r.world();
    expect_error([&] { init_mesh(world, 3); }, {"3 replicas do not divide the world of 4"});
    auto mesh = init_mesh(world, 2);
    auto model = build();
    fully_shard(model->blocks[0], mesh, audited());
    expect_error([&] { fully_shard(model, world, audited()); },
                 {"different communicator or mesh than its parent"});
    // An error of one rank's shard_placement_fn stops every rank of the mesh, in both replicas.
    {
      auto model3 = build();
      ShardOptions o = audited();
      o.shard_placement_fn = [&r](const std::string& name, const at::Tensor&) {
        if (r.rank == 2 && name.find("weight") != std::string::npos)
          throw std::runtime_error("no placement on rank 2");
        return std::optional<Shard>();
      };
      const auto err = error_of([&] { fully_shard(model3->blocks[0], mesh, o); });
      EXPECT_HAS(err, "shard_placement_fn threw for parameter");
      EXPECT_HAS(err, "no placement on rank 2");
      if (r.rank != 2) {
        EXPECT_HAS(err, " failed on rank ");  // of the shard group or of the replicas
        EXPECT_HAS(err, " of 'world");
      }
    }
    auto model2 = build();
    auto root = shard(model2, mesh);
    torch::optim::AdamW opt(root.parameters(), adamw());
    expect_error(
        [&] {
          checkpoint::save("/tmp/never", root, &opt, {1, 0, {}, {}}, *mesh.replicate);
        },
        {"under HSDP pass the shard communicator (mesh.shard, 2 ranks) or the world (4 ranks)",
         "has 2"});
  });
}

}  // namespace
}  // namespace fsdp::testing::hsdp_test
