// ShardOptions::shard_placement_fn (FSDP2's shard_placement_fn): parameters sharded on a dim other
// than 0 (expert weights whose dim 0 is smaller than the world, a weight split by columns) train
// exactly as unsharded, with uneven and empty slices; state dicts, checkpoints (loaded at another
// world size and into another placement) and consolidation hold the full parameters; a placement
// a parameter cannot take is an error naming it.
#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad_norm.h>
#include <fsdp/safetensors_torch.h>
#include <fsdp/state_dict.h>

#include <filesystem>

#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::shard_placement_test {
namespace {

namespace fs = std::filesystem;

const at::Tensor& at_name(const StateDict& d, const std::string& name) {
  const at::Tensor* t = d.find(name);
  if (!t) throw std::runtime_error("no tensor '" + name + "' in the state dict");
  return *t;
}

// A layer with a column-split weight, a bias, experts stacked on dim 0 (2 of them: fewer than
// the ranks of most tests) and a 0-d scale.
struct ExpertsImpl : torch::nn::Module {
  torch::Tensor w, b, experts, scale;
  ExpertsImpl(int64_t in, int64_t hidden, int64_t out) {
    w = register_parameter("w", torch::randn({hidden, in}) / std::sqrt(double(in)));
    b = register_parameter("b", torch::randn({hidden}) * 0.1);
    experts =
        register_parameter("experts", torch::randn({2, hidden, out}) / std::sqrt(double(hidden)));
    scale = register_parameter("scale", torch::tensor(1.25));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(torch::addmm(b, x, w.t()));
    return torch::einsum("bi,eio->bo", {h, experts}) * scale;
  }
};
TORCH_MODULE(Experts);

struct NetImpl : torch::nn::Module {
  fsdp::Sharded<Experts> a{Experts(5, 7, 5)}, c{Experts(5, 6, 3)};
  torch::Tensor head;
  NetImpl() {
    register_module("a", a.ptr());
    register_module("c", c.ptr());
    head = register_parameter("head", torch::randn({3, 4}) * 0.5);
  }
  torch::Tensor forward(const torch::Tensor& x) { return c(a(x)).mm(head); }
};
TORCH_MODULE(Net);

// Columns of w and head, the experts' last dim in `a` (counted from the end) and their hidden dim
// in `c`; biases and scales on dim 0.
std::optional<Shard> placement(const std::string& name, const at::Tensor&) {
  if (name == "w" || name == "head") return Shard{1};
  if (name == "experts") return Shard{-1};
  return std::nullopt;
}
std::optional<Shard> placement_c(const std::string& name, const at::Tensor& t) {
  return name == "experts" ? std::optional<Shard>(Shard{1}) : placement(name, t);
}

struct ShardedNet {
  fsdp::Sharded<Net> m{Net()};
  FSDPModule root;
  ShardedNet(Rank& r, bool placed, bool checkpointed = false) {
    m->to(torch::kDouble);
    ShardOptions o = audited();
    o.runtime.activation_checkpointing = checkpointed;
    if (placed) o.shard_placement_fn = placement;
    fully_shard(m->a, r.world(), o);
    if (placed) o.shard_placement_fn = placement_c;
    fully_shard(m->c, r.world(), o);
    o.runtime.activation_checkpointing = false;
    if (placed) o.shard_placement_fn = placement;
    root = fully_shard(m, r.world(), o);
  }
};

at::Tensor batch(int step, int micro, int rank) {
  torch::manual_seed(1000 * step + 10 * micro + rank);
  return torch::randn({3, 5}, torch::kDouble);
}

// Two micro-batches per step (the first without gradient sync), clipping and AdamW, against the
// unsharded model trained on every rank's data, in fp64.
void trains_as_unsharded(int world, bool checkpointed) {
  run_ranks(world, [&](Rank& r) {
    torch::manual_seed(0);
    ShardedNet s(r, /*placed=*/true, checkpointed);
    torch::manual_seed(0);
    Net ref;
    ref->to(torch::kDouble);
    std::map<std::string, ShardInfo> by;
    for (auto& i : s.root.shards()) by[i.name] = i;
    // The layout: slices of the named dim, torch.chunk's sizes (uneven, trailing ones empty).
    auto expect_slice = [&](const std::string& name, int64_t dim, int64_t size) {
      SCOPED_TRACE(name);
      const ShardInfo& i = by.at(name);
      const int64_t chunk = (size + world - 1) / world;
      const int64_t offset = std::min<int64_t>(r.rank * chunk, size);
      EXPECT_EQ(i.dim, dim);
      EXPECT_EQ(i.rows_per_rank, chunk);
      EXPECT_EQ(i.row_offset, offset);
      EXPECT_EQ(i.shard.size(dim), std::min(chunk, size - offset));
      EXPECT_TRUE(i.shard.is_contiguous());
    };
    expect_slice("a.w", 1, 5);
    expect_slice("a.experts", 2, 5);
    expect_slice("c.experts", 1, 6);
    expect_slice("head", 1, 4);
    expect_slice("a.b", 0, 7);
    EXPECT_EQ(by.at("a.scale").dim, 0);
    torch::optim::AdamW opt(s.root.parameters(), torch::optim::AdamWOptions(0.05));
    torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(0.05));
    for (int step = 0; step < 3; ++step) {
      double loss = 0, ref_loss = 0;
      for (int micro = 0; micro < 2; ++micro) {
        s.root.set_requires_gradient_sync(micro == 1);
        auto l = s.m(batch(step, micro, r.rank)).pow(2).mean();
        l.backward();
        loss += l.item<double>();
        for (int k = 0; k < world; ++k) {
          auto rl = ref(batch(step, micro, k)).pow(2).mean() / world;
          rl.backward();
          if (k == r.rank) ref_loss += rl.item<double>() * world;
        }
      }
      EXPECT_NEAR(loss, ref_loss, 1e-12);
      expect_shard_grads(s.root, full_grads(*ref), 0, 1e-12);
      const double norm = clip_grad_norm_(s.root, 0.5);
      const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
      EXPECT_NEAR(norm, ref_norm, 1e-12);
      opt.step();
      ref_opt.step();
      opt.zero_grad();
      ref_opt.zero_grad();
    }
    expect_shards_equal(s.root, *ref, 0, 1e-12);
    auto full = full_state_dict(s.root, {/*rank0_only=*/false});
    for (const auto& p : ref->named_parameters())
      EXPECT_TRUE(torch::allclose(at_name(full, p.key()), p.value(), 0, 1e-12)) << p.key();
  });
}

TEST(ShardPlacement, TrainsAsUnshardedOnTwoRanks) { trains_as_unsharded(2, false); }
// 5 and 7 over 3 ranks are uneven; 4 over 4 ranks leaves the last rank 1 column; 5 over 4 gives
// 2, 2, 1, 0: the last rank holds nothing of a.w.
TEST(ShardPlacement, TrainsAsUnshardedWithUnevenAndEmptySlices) {
  trains_as_unsharded(3, false);
  trains_as_unsharded(4, true);
}

// load_full_state_dict writes each rank's slice; full_state_dict joins them again.
TEST(ShardPlacement, FullStateDictRoundTrips) {
  run_ranks(3, [](Rank& r) {
    torch::manual_seed(0);
    ShardedNet s(r, true);
    torch::manual_seed(7);
    Net other;
    other->to(torch::kDouble);
    StateDict sd;
    for (const auto& p : other->named_parameters()) sd.insert(p.key(), p.value().detach().clone());
    load_full_state_dict(s.root, sd);
    expect_shards_equal(s.root, *other, 0, 0);
    auto back = full_state_dict(s.root, {/*rank0_only=*/false});
    for (const auto& i : sd)
      EXPECT_TRUE(torch::equal(at_name(back, i.key()), i.value())) << i.key();
  });
}

constexpr const char* kDirEnv = "FSDP_TEST_PLACEMENT_DIR";

std::vector<double> train(ShardedNet& s, torch::optim::AdamW& opt, int rank, int from, int to) {
  std::vector<double> losses;
  for (int step = from; step < to; ++step) {
    auto loss = s.m(batch(step, 0, rank)).pow(2).mean();
    loss.backward();
    opt.step();
    opt.zero_grad();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

// A checkpoint saved with column slices ("slices" entries in the index) loads into dim-0 shards
// and back, with the AdamW state, and the run goes on with the same losses; it loads at another
// world size; consolidate writes the full parameters.
TEST(ShardPlacement, CheckpointsLoadIntoAnyPlacementAndWorldSize) {
  auto dir = fs::temp_directory_path() / ("fsdp_placement_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  RunOptions o;
  o.env[kDirEnv] = dir.string();
  run_ranks(
      2,
      [](Rank& r) {
        const std::string d = std::getenv(kDirEnv);
        torch::manual_seed(0);
        ShardedNet s(r, true);
        torch::optim::AdamW opt(s.root.parameters(), torch::optim::AdamWOptions(0.05));
        train(s, opt, r.rank, 0, 2);
        const std::string placed = checkpoint::save(d + "/placed", s.root, &opt, {}, *r.world());
        auto saved = full_state_dict(s.root, {/*rank0_only=*/false});
        const auto go_on = train(s, opt, r.rank, 2, 4);
        // Into dim-0 shards, then saved from there and loaded into column slices again.
        torch::manual_seed(1);
        ShardedNet rows(r, false);
        torch::optim::AdamW rows_opt(rows.root.parameters(), torch::optim::AdamWOptions(0.05));
        checkpoint::load(placed, rows.root, &rows_opt, *r.world());
        for (const auto& i : full_state_dict(rows.root, {false}))
          EXPECT_TRUE(torch::equal(i.value(), at_name(saved, i.key()))) << i.key();
        const std::string saved_rows =
            checkpoint::save(d + "/rows", rows.root, &rows_opt, {}, *r.world());
        EXPECT_EQ(train(rows, rows_opt, r.rank, 2, 4), go_on);
        torch::manual_seed(2);
        ShardedNet back(r, true);
        torch::optim::AdamW back_opt(back.root.parameters(), torch::optim::AdamWOptions(0.05));
        checkpoint::load(saved_rows, back.root, &back_opt, *r.world());
        EXPECT_EQ(train(back, back_opt, r.rank, 2, 4), go_on);
        if (r.rank == 0) {
          checkpoint::consolidate(placed, d + "/full.safetensors");
          auto f = safetensors::File::open(d + "/full.safetensors");
          for (const auto& i : saved)
            EXPECT_TRUE(torch::equal(safetensors::read_tensor(*f, i.key()), i.value())) << i.key();
        }
      },
      o);
  run_ranks(
      3,
      [](Rank& r) {
        const std::string d = std::getenv(kDirEnv);
        torch::manual_seed(0);
        ShardedNet s2(r, true);  // the values the first run started from do not matter
        checkpoint::load(*checkpoint::latest(d + "/placed"), s2.root, nullptr, *r.world());
        auto f = safetensors::File::open(d + "/full.safetensors");
        for (const auto& i : full_state_dict(s2.root, {false}))
          EXPECT_TRUE(torch::equal(i.value(), safetensors::read_tensor(*f, i.key()))) << i.key();
        // init_from a full file into column slices.
        torch::manual_seed(3);
        ShardedNet s3(r, true);
        checkpoint::init_from(d + "/full.safetensors", s3.root);
        for (const auto& i : full_state_dict(s3.root, {false}))
          EXPECT_TRUE(torch::equal(i.value(), safetensors::read_tensor(*f, i.key()))) << i.key();
      },
      o);
  fs::remove_all(dir);
}

TEST(ShardPlacement, ANonexistentDimIsAnErrorNamingTheParameter) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Experts> e{Experts(5, 7, 5)};
    ShardOptions o;
    o.shard_placement_fn = [](const std::string& name, const at::Tensor&) {
      return name == "w" ? std::optional<Shard>(Shard{2}) : std::nullopt;
    };
    auto err = error_of([&] { fully_shard(e, r.world(), o); });
    EXPECT_HAS(err, "shard_placement_fn gave Shard(2) for 'w' of shape [7, 5]");
    EXPECT_HAS(err, "return a dim in [-2, 2)");
    o.shard_placement_fn = [](const std::string& name, const at::Tensor&) {
      return name == "scale" ? std::optional<Shard>(Shard{-1}) : std::nullopt;
    };
    err = error_of([&] { fully_shard(e, r.world(), o); });
    EXPECT_HAS(err, "Shard(-1) for 'scale', a 0-d parameter");
    EXPECT_FALSE(e.is_sharded());
    fully_shard(e, r.world());  // nothing was claimed by the failed calls
  });
}

TEST(ShardPlacement, PlacementsThatDifferBetweenRanksAreAnError) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Experts> e{Experts(5, 7, 5)};
    ShardOptions o;
    const int64_t dim = r.rank;
    o.shard_placement_fn = [dim](const std::string& name, const at::Tensor&) {
      return name == "w" ? std::optional<Shard>(Shard{dim}) : std::nullopt;
    };
    auto err = error_of([&] { fully_shard(e, r.world(), o); });
    EXPECT_HAS(err, "the model differs across ranks at parameter #0");
    EXPECT_HAS(err, r.rank == 1 ? "'w' [7, 5] Float sharded on dim 1"
                                : "'w' [7, 5] Float sharded on dim 0");
    EXPECT_HAS(err, "the same shard_placement_fn");
  });
}

// A placement function that throws, on every rank or on one: every rank stops at fully_shard with
// an error naming the parameter (none waits in a collective), and the module stays unsharded.
TEST(ShardPlacement, APlacementFunctionThatThrowsStopsEveryRank) {
  run_ranks(3, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Experts> e{Experts(5, 7, 5)};
    for (int thrower : {-1, 1}) {
      ShardOptions o;
      o.shard_placement_fn = [&](const std::string& name, const at::Tensor&) {
        if (name == "experts" && (thrower < 0 || thrower == r.rank))
          throw std::runtime_error("no placement for experts");
        return std::optional<Shard>();
      };
      auto err = error_of([&] { fully_shard(e, r.world(), o); });
      if (thrower >= 0 && r.rank != thrower) {
        EXPECT_HAS(err, ") failed on rank 1: ");
      }
      EXPECT_HAS(err,
                 "shard_placement_fn threw for parameter 'experts' (shape [2, 7, 5]): no "
                 "placement for experts");
      EXPECT_FALSE(e.is_sharded());
    }
  });
}

}  // namespace
}  // namespace fsdp::testing::shard_placement_test
