// Buffers in sharded checkpoints: rank 0's values saved (with a warning naming a buffer that
// differs across ranks), restored on every rank, kept in the consolidated file and read back by
// init_from; a checkpoint saved before buffers were stored still loads, with a note.
#include <fsdp/checkpoint.h>
#include <fsdp/safetensors_torch.h>
#include <fsdp/state_dict.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "adoption_models.h"
#include "core/buffers.h"
#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::checkpoint_buffers_test {
namespace {

namespace fs = std::filesystem;
namespace ck = fsdp::checkpoint;

constexpr const char* kDirEnv = "FSDP_TEST_BUFFERS_DIR";
std::string run_dir() { return test_scratch_dir(kDirEnv, "fsdp_ckbuf_"); }
RunOptions with_dir(const std::string& dir) {
  RunOptions o;
  o.env[kDirEnv] = dir;
  return o;
}

std::vector<torch::Tensor> clone_buffers(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& b : m.buffers()) out.push_back(b.clone());
  return out;
}

// Every shard of `got` equals the same-named shard of `want` (same world size).
void expect_state_equals_shards(const FSDPModule& got, const FSDPModule& want) {
  const auto theirs = want.shards();
  for (const auto& s : got.shards()) {
    auto it = std::find_if(theirs.begin(), theirs.end(),
                           [&](const ShardInfo& t) { return t.name == s.name; });
    ASSERT_NE(it, theirs.end()) << s.name;
    EXPECT_TRUE(torch::equal(s.shard, it->shard)) << s.name;
  }
}

struct Trained {
  fsdp::Sharded<Cnn> model{Cnn()};
  FSDPModule root;
  Trained(Rank& r) {
    fully_shard(model->block1, r.world());
    fully_shard(model->block2, r.world());
    root = fully_shard(model, r.world());
    auto [x, t] = cnn_batch(r.rank, 0);  // each rank its own batch: the statistics drift apart
    torch::mse_loss(model(x), t).backward();
  }
};

TEST(CheckpointBuffers, RankZerosBuffersAreSavedRestoredAndConsolidated) {
  const std::string dir = run_dir();
  run_ranks(
      2,
      [&](Rank& r) {
        torch::manual_seed(0);
        Trained a(r);
        ::testing::internal::CaptureStderr();
        const std::string ckpt = ck::save(run_dir(), a.root, nullptr, {}, *r.world());
        const std::string err = ::testing::internal::GetCapturedStderr();
        EXPECT_EQ(err.find("buffer 'block1.bn.running_mean' differs between rank 1 and rank 0") !=
                      std::string::npos,
                  r.rank == 0)
            << err;
        detail::broadcast_buffers(*a.model.ptr(), *r.world());
        const auto saved = clone_buffers(*a.model.ptr());  // rank 0's, now on every rank

        torch::manual_seed(1);  // other weights, initial statistics
        Trained b(r);
        ck::load(ckpt, b.root, nullptr, *r.world());
        const auto got = clone_buffers(*b.model.ptr());
        ASSERT_EQ(got.size(), saved.size());
        for (size_t i = 0; i < got.size(); ++i)
          EXPECT_TRUE(torch::equal(got[i], saved[i])) << "buffer #" << i;
        expect_state_equals_shards(b.root, a.root);

        const std::string full = run_dir() + "/full.safetensors";
        if (r.rank == 0) {  // the consolidated file holds the buffers under the unsharded names
          ck::consolidate(ckpt, full);
          auto f = fsdp::safetensors::File::open(full);
          EXPECT_TRUE(torch::equal(fsdp::safetensors::read_tensor(*f, "block1.bn.running_mean"),
                                   a.model->block1->bn->running_mean));
          EXPECT_TRUE(
              torch::equal(fsdp::safetensors::read_tensor(*f, "block2.bn.num_batches_tracked"),
                           a.model->block2->bn->num_batches_tracked));
        }
        r.world()->barrier().wait();
        torch::manual_seed(2);
        Trained c(r);  // init_from the consolidated file: parameters and buffers
        ck::init_from(full, c.root);
        const auto from_file = clone_buffers(*c.model.ptr());
        for (size_t i = 0; i < from_file.size(); ++i)
          EXPECT_TRUE(torch::equal(from_file[i], saved[i])) << "buffer #" << i;
        expect_state_equals_shards(c.root, a.root);
      },
      with_dir(dir));
  if (!in_rank_process()) fs::remove_all(dir);
}

// An index that has buffers but lacks one of the model's is an error naming it. A checkpoint
// without any buffer entry (as saved before buffers were stored): the parameters load, the buffers
// stay, and rank 0 says so, naming them.
TEST(CheckpointBuffers, CheckpointWithoutBuffersLoadsWithANote) {
  const std::string dir = run_dir();
  run_ranks(
      2,
      [&](Rank& r) {
        torch::manual_seed(0);
        Trained a(r);
        ::testing::internal::CaptureStderr();
        const std::string ckpt = ck::save(run_dir(), a.root, nullptr, {}, *r.world());
        ::testing::internal::GetCapturedStderr();
        auto strip = [&](std::vector<std::string> names) {  // rank 0 edits the index
          if (r.rank == 0) {
            const std::string path = ckpt + "/index.json";
            std::ifstream in(path);
            auto idx = nlohmann::json::parse(in);
            in.close();
            for (const auto& n : names) EXPECT_EQ(idx["tensors"].erase(n), 1u) << n;
            idx.erase("index_xxh64");  // as an index from before indexes carried a checksum
            std::ofstream(path) << idx.dump();
          }
          r.world()->barrier().wait();
        };
        // One buffer gone: an index with buffers must hold every one of the model's.
        strip({"block2.bn.running_var"});
        {
          torch::manual_seed(1);
          Trained b(r);
          expect_error([&] { ck::load(ckpt, b.root, nullptr, *r.world()); },
                       {"missing tensors 'block2.bn.running_var'", "model parameters and buffers"});
        }
        // All of them: a checkpoint from before buffers were saved.
        strip({"block1.bn.running_mean", "block1.bn.running_var", "block1.bn.num_batches_tracked",
               "block2.bn.running_mean", "block2.bn.num_batches_tracked"});
        torch::manual_seed(1);
        Trained b(r);
        const auto before = clone_buffers(*b.model.ptr());
        ::testing::internal::CaptureStderr();
        ck::load(ckpt, b.root, nullptr, *r.world());
        const std::string err = ::testing::internal::GetCapturedStderr();
        if (r.rank == 0) {
          EXPECT_NE(
              err.find("holds no buffers (saved before fsdp-cpp stored them); the model keeps "
                       "its current values of 6 buffers: 'block1.bn.running_mean'"),
              std::string::npos)
              << err;
        }
        const auto after = clone_buffers(*b.model.ptr());
        for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(torch::equal(after[i], before[i]));
        expect_shards_equal(
            b.root,
            *[&] {
              StateDict sd = full_state_dict(a.root);
              torch::manual_seed(5);
              Cnn plain;
              torch::NoGradGuard g;
              for (auto& p : plain->named_parameters()) p.value().copy_(sd[p.key()]);
              return plain;
            }(),
            0, 0);
      },
      with_dir(dir));
  if (!in_rank_process()) fs::remove_all(dir);
}

}  // namespace
}  // namespace fsdp::testing::checkpoint_buffers_test
