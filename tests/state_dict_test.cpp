// Whole-model state of a sharded model (label adoption): full_state_dict against the unsharded
// model, load_full_state_dict (strict), the README's "save for inference" round trip through a
// safetensors file into an unsharded model, and torch::save on a sharded model.
#include <fsdp/safetensors_torch.h>
#include <fsdp/state_dict.h>

#include <filesystem>
#include <sstream>

#include "adoption_models.h"
#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::state_dict_test {
namespace {

namespace fs = std::filesystem;

// A directory every rank of the run shares: made by the parent, passed through the environment.
constexpr const char* kSharedDirEnv = "FSDP_TEST_SHARED_DIR";
std::string shared_dir() { return test_scratch_dir(kSharedDirEnv, "fsdp_sd_"); }
RunOptions in_dir(const std::string& dir) {
  RunOptions o;
  o.env[kSharedDirEnv] = dir;
  return o;
}

// Everything the unsharded model holds, by name.
std::map<std::string, torch::Tensor> unsharded_state(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (auto& p : m.named_parameters()) out[p.key()] = p.value().detach();
  for (auto& b : m.named_buffers()) out[b.key()] = b.value();
  return out;
}

void expect_state_equals(const StateDict& sd, torch::nn::Module& ref) {
  auto want = unsharded_state(ref);
  EXPECT_EQ(sd.size(), want.size());
  for (const auto& [name, t] : want) {
    const torch::Tensor* got = sd.find(name);
    if (!got) {
      ADD_FAILURE() << "missing " << name;
      continue;
    }
    EXPECT_EQ(got->sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(*got, t)) << name;
  }
}

struct ShardedCnn {
  fsdp::Sharded<Cnn> model{Cnn()};
  FSDPModule root;
  explicit ShardedCnn(Rank& r, ShardOptions o = {}) {
    fully_shard(model->block1, r.world(), o);
    fully_shard(model->block2, r.world(), o);
    root = fully_shard(model, r.world(), o);
  }
};

// Moves the BatchNorm statistics away from their initial values (train-mode forwards).
void touch_buffers(Cnn& m, int seed) {
  torch::NoGradGuard g;
  m->forward(cnn_batch(seed, 0).first);
}

// World 3: uneven rows (5 conv channels: 2, 2, 1 rows; 4 BatchNorm channels: 2, 2, 0).
TEST(StateDict, FullStateDictIsTheUnshardedModel) {
  run_ranks(3, [](Rank& r) {
    torch::manual_seed(0);
    Cnn ref;
    torch::manual_seed(0);
    ShardedCnn s(r);
    {
      torch::NoGradGuard g;
      s.model(cnn_batch(0, 0).first);  // every rank the same batch: equal statistics
      ref->forward(cnn_batch(0, 0).first);
    }
    auto comm = r.world();
    const int64_t before = comm->stats().collectives;
    StateDict sd = full_state_dict(s.root);
    EXPECT_EQ(comm->stats().collectives - before, 10) << "one all-gather per parameter";
    expect_state_equals(sd, *ref);
    EXPECT_EQ(sd.keys().front(), "block1.conv.weight");
    StateDict only0 = full_state_dict(s.root, {/*rank0_only=*/true});
    EXPECT_EQ(only0.size(), r.rank == 0 ? sd.size() : 0u);
  });
}

// A 0-d parameter (one row, on rank 0) and a parameter with fewer rows than ranks (empty shards).
struct OddImpl : torch::nn::Module {
  OddImpl() {
    scale = register_parameter("scale", torch::randn({}, torch::kDouble));
    thin = register_parameter("thin", torch::randn({2, 3}, torch::kDouble));
    register_buffer("flags", torch::rand({4}) > 0.5);
  }
  torch::Tensor forward(const torch::Tensor& x) { return scale * x.matmul(thin.t()); }
  torch::Tensor scale, thin;
};
TORCH_MODULE(Odd);

TEST(StateDict, ZeroDimAndEmptyShardsRoundTrip) {
  run_ranks(3, [](Rank& r) {
    torch::manual_seed(0);
    Odd ref;
    torch::manual_seed(0);
    fsdp::Sharded<Odd> model{Odd()};
    auto root = fully_shard(model, r.world());
    expect_state_equals(full_state_dict(root), *ref);
    torch::manual_seed(4);
    Odd other;
    StateDict dict;
    for (auto& [name, t] : unsharded_state(*other)) dict.insert(name, t.clone());
    load_full_state_dict(root, dict);
    expect_state_equals(full_state_dict(root), *other);
  });
}

// Loading a dictionary of other values: every shard holds its rows of them, every buffer them.
TEST(StateDict, LoadFullStateDictFillsShardsAndBuffers) {
  run_ranks(3, [](Rank& r) {
    torch::manual_seed(0);
    ShardedCnn s(r);
    torch::manual_seed(7);
    Cnn other;
    touch_buffers(other, 3);
    StateDict dict;
    for (auto& [name, t] : unsharded_state(*other)) dict.insert(name, t.clone());
    load_full_state_dict(s.root, dict);
    expect_shards_equal(s.root, *other, 0, 0);
    for (auto& [name, b] : named_buffers(s.root))
      EXPECT_TRUE(torch::equal(b, *dict.find(name))) << name;
    expect_state_equals(full_state_dict(s.root), *other);
  });
}

// Strict: every missing, unexpected and mis-shaped name in one message; nothing copied.
TEST(StateDict, LoadFullStateDictListsEveryMismatch) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    ShardedCnn s(r);
    const StateDict before = full_state_dict(s.root);
    StateDict bad;
    for (const auto& item : before) {
      if (item.key() == "head.bias" || item.key() == "block2.bn.running_var") continue;
      bad.insert(item.key(),
                 item.key() == "block1.conv.weight" ? torch::zeros({5, 2, 3}) : item.value() + 1);
    }
    bad.insert("head.scale", torch::ones({3}));
    expect_error(
        [&] { load_full_state_dict(s.root, bad); },
        {"Missing (2): 'head.bias', 'block2.bn.running_var'", "Unexpected (1): 'head.scale'",
         "Shape mismatch (1): 'block1.conv.weight' is [5, 2, 3] in the dictionary, "
         "[5, 2, 3, 3] in the model",
         "full_state_dict of the same model"});
    const StateDict after = full_state_dict(s.root);  // nothing was copied
    for (const auto& item : before)
      EXPECT_TRUE(torch::equal(item.value(), after[item.key()])) << item.key();
  });
}

// The README's "Save for inference": rank 0 writes full_state_dict to a safetensors file; an
// unsharded model loads it and computes what the sharded model computes.
TEST(StateDict, SaveForInferenceLoadsIntoTheUnshardedModel) {
  const std::string dir = shared_dir();
  run_ranks(
      2,
      [&](Rank& r) {
        const std::string path = shared_dir() + "/model.safetensors";
        torch::manual_seed(0);
        ShardedCnn s(r);
        torch::optim::AdamW opt(s.root.parameters(), adoption_adamw());
        for (int step = 0; step < 2;
             ++step) {  // trained weights and statistics, not the initial ones
          auto [x, t] = cnn_batch(0, step);
          opt.zero_grad();
          torch::mse_loss(s.model(x), t).backward();
          opt.step();
        }
        // --- README: save (collective; rank 0 writes) ---
        auto sd = fsdp::full_state_dict(s.root, {/*rank0_only=*/true});
        if (r.rank == 0) {
          std::vector<fsdp::safetensors::TensorView> views;
          for (const auto& item : sd)
            views.push_back(fsdp::safetensors::view_of(item.key(), item.value()));
          fsdp::safetensors::write(path, views, {{"format", "pt"}});
        }
        r.world()->barrier().wait();
        // --- README: load into the unsharded model ---
        Cnn plain;
        {
          auto file = fsdp::safetensors::File::open(path);
          torch::NoGradGuard no_grad;
          for (auto& p : plain->named_parameters())
            p.value().copy_(fsdp::safetensors::read_tensor(*file, p.key()));
          for (auto& b : plain->named_buffers())
            b.value().copy_(fsdp::safetensors::read_tensor(*file, b.key()));
        }
        plain->eval();
        s.model->eval();
        auto x = cnn_batch(5, 9).first;
        torch::Tensor want = s.model(x).detach();
        torch::Tensor got = plain->forward(x);
        EXPECT_TRUE(torch::allclose(got, want, 1e-12, 1e-12))
            << "max abs diff " << (got - want).abs().max().item<double>();
      },
      in_dir(dir));
  if (!in_rank_process()) fs::remove_all(dir);
}

// torch::save on a sharded module (the root or a block) is an error naming the ways to save; before
// fully_shard the model saves and loads as usual.
TEST(StateDict, TorchSaveOnAShardedModuleIsAClearError) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Cnn> model{Cnn()};
    std::stringstream plain;
    torch::save(model, plain);  // not sharded yet: an ordinary archive
    Cnn loaded;
    torch::load(loaded, plain);
    for (auto& [name, t] : unsharded_state(*model.ptr()))
      EXPECT_TRUE(torch::equal(t, unsharded_state(*loaded)[name])) << name;

    fully_shard(model->block1, r.world());
    fully_shard(model->block2, r.world());
    fully_shard(model, r.world());
    for (int which = 0; which < 2; ++which) {
      std::stringstream out;
      expect_error(
          [&] {
            if (which == 0)
              torch::save(model, out);
            else
              torch::save(model->block1, out);
          },
          {"torch::save was called on sharded module '", which == 0 ? "CnnImpl)" : "'block1' (",
           "full_state_dict(root)", "Save for inference", "fsdp::checkpoint::save"});
      EXPECT_EQ(out.str().size(), 0u) << "nothing written";
    }
  });
}

}  // namespace
}  // namespace fsdp::testing::state_dict_test
