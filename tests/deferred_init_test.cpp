// fsdp::deferred_init and fsdp::materialize (issue 11, item 4): a model built under deferred_init,
// sharded and materialised holds, bit for bit, the values an eager build from the same seed holds
// (each rank: its rows), at N=1..4, for the GPT, for an unsharded model with buffers and for
// generated models with custom init (random ops, view writes, dead results, temporaries); training
// afterwards matches training from the eager model; the generator ends where the eager build left
// it; materialize's peak is the shards plus one parameter (instrumented and RSS); misuse fails by
// its message. FSDP_TEST_VERBOSE=1 prints the memory figures.
#include <fsdp/memory.h>
#include <fsdp/models/gpt.h>
#include <malloc.h>

#include <array>
#include <cmath>
#include <iostream>
#include <random>

#include "fsdp_test_util.h"
#include "tiny_gpt.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::deferred_init_test {
namespace {

using fsdp::models::GPT;
using fsdp::models::GPTConfig;
using Named = std::vector<std::pair<std::string, torch::Tensor>>;

bool verbose() { return std::getenv("FSDP_TEST_VERBOSE") != nullptr; }

Named named_tensors(torch::nn::Module& m, bool buffers) {
  Named out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  if (buffers)
    for (const auto& b : m.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

// Every tensor of `got` equals the same-named tensor of `want` bitwise (same dtype and shape).
void expect_same_values(const Named& want, const Named& got) {
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(want[i].first, got[i].first);
    EXPECT_TRUE(got[i].second.storage().nbytes() > 0 || got[i].second.numel() == 0)
        << got[i].first << " has no bytes";
    EXPECT_EQ(want[i].second.scalar_type(), got[i].second.scalar_type()) << got[i].first;
    EXPECT_TRUE(torch::equal(want[i].second, got[i].second)) << got[i].first;
  }
}

// Each shard (original names) equals its rows of the eager parameter: torch.chunk's rule.
void expect_rows(const Named& eager, const Named& shards, int rank, int world) {
  ASSERT_EQ(eager.size(), shards.size());
  std::map<std::string, torch::Tensor> full(eager.begin(), eager.end());
  for (const auto& [name, shard] : shards) {
    ASSERT_TRUE(full.count(name)) << name;
    const torch::Tensor f = full[name].detach();
    const int64_t rows = f.dim() == 0 ? 1 : f.size(0);
    const int64_t c = (rows + world - 1) / world;
    const int64_t off = std::min<int64_t>(rank * c, rows);
    const int64_t len = std::max<int64_t>(0, std::min<int64_t>(c, rows - off));
    const torch::Tensor want = f.reshape({rows, -1}).narrow(0, off, len).reshape(shard.sizes());
    EXPECT_TRUE(torch::equal(shard.detach(), want)) << name << " rank " << rank;
  }
}

fsdp::Sharded<GPT> eager_gpt(const GPTConfig& cfg, uint64_t seed) {
  torch::manual_seed(seed);
  return fsdp::Sharded<GPT>(GPT(cfg));
}

fsdp::Sharded<GPT> deferred_gpt(const GPTConfig& cfg, uint64_t seed) {
  torch::manual_seed(seed);
  return fsdp::deferred_init([&] { return fsdp::Sharded<GPT>(GPT(cfg)); });
}

// ---------------------------------------------------------------------------------------------
// Generated models: random layers, then random custom init over every parameter.
// ---------------------------------------------------------------------------------------------
constexpr int kInitKinds = 11;
std::array<int, kInitKinds> init_kinds_used{};  // how often each custom init ran (eager + deferred)

struct GenNetImpl : torch::nn::Module {
  GenNetImpl(uint64_t seed, bool with_buffers, const torch::Tensor& outside) {
    namespace nn = torch::nn;
    std::mt19937_64 g(seed);
    auto pick = [&](int n) { return static_cast<int64_t>(g() % static_cast<uint64_t>(n)); };
    const int64_t layers = 2 + pick(4);
    for (int64_t i = 0; i < layers; ++i) {
      const std::string name = "l" + std::to_string(i);
      switch (pick(with_buffers ? 5 : 4)) {
        case 0:
          register_module(
              name, nn::Linear(nn::LinearOptions(1 + pick(9), 1 + pick(9)).bias(pick(3) > 0)));
          break;
        case 1:
          register_module(name, nn::LayerNorm(nn::LayerNormOptions({2 + pick(7)})));
          break;
        case 2:
          register_module(
              name,
              nn::Embedding(nn::EmbeddingOptions(3 + pick(9), 2 + pick(6)).padding_idx(pick(3))));
          break;
        case 3:
          register_module(
              name,
              nn::Conv2d(
                  nn::Conv2dOptions(1 + pick(3), 1 + pick(4), 1 + pick(3)).bias(pick(2) > 0)));
          break;
        default:
          register_module(name, nn::BatchNorm1d(2 + pick(6)));
      }
    }
    extra = register_parameter("extra", torch::randn({1 + pick(7), 3}));  // a random factory
    torch::NoGradGuard no_grad;
    for (auto& p : parameters())
      for (int64_t n = pick(3); n-- > 0;) custom_init(p, g, outside);
  }

  static void custom_init(torch::Tensor& p, std::mt19937_64& g, const torch::Tensor& outside) {
    auto pick = [&](int n) { return static_cast<int64_t>(g() % static_cast<uint64_t>(n)); };
    const double x = 0.1 + 0.1 * static_cast<double>(pick(9));
    const int64_t rows = p.dim() == 0 ? 1 : p.size(0);
    const int64_t kind = pick(kInitKinds);
    ++init_kinds_used[kind];
    switch (kind) {
      case 0:
        p.normal_(x, 0.5);
        break;
      case 1:
        p.uniform_(-x, x);
        break;
      case 2:
        p.fill_(x);
        break;
      case 3:  // a partial write through a view (the rest keeps its value)
        if (rows > 1) p.narrow(0, 1, rows - 1).fill_(-x);
        break;
      case 4:  // random draws into a non-contiguous view
        if (p.dim() == 2) p.t().narrow(0, 0, 1).normal_();
        break;
      case 5:
        p.mul_(x).add_(0.5);
        break;  // read-modify-write
      case 6:
        p.copy_(torch::randn(p.sizes()) * x);
        break;  // temporaries, then an overwrite
      case 7:   // a dead random result: overwritten before anything reads it
        p.normal_();
        p.fill_(x);
        break;
      case 8:
        p.add_(outside);
        break;  // reads a tensor built outside deferred_init
      case 9:   // index tensors built inside: index_fill_, index_put_ (a list of optional tensors)
        if (p.dim() >= 1) {
          p.index_fill_(0, torch::arange(0, rows, 2), x);
          p.index_put_({torch::arange(1, rows, 2)}, torch::full({}, -x));
        }
        break;
      default:
        if (p.dim() >= 1) p.select(0, rows - 1).uniform_(0, x);
    }
  }
  torch::Tensor extra;
};
TORCH_MODULE(GenNet);

// A 0-d tensor built before (outside) deferred_init, read by the generated init.
torch::Tensor outside_value() { return torch::full({}, 0.125); }

// ---------------------------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------------------------
TEST(DeferredInit, UnshardedModelsEqualEagerIncludingBuffers) {
  auto outside = outside_value();
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    SCOPED_TRACE(detail::cat("seed ", seed));
    torch::manual_seed(seed);
    GenNet eager(seed, /*with_buffers=*/true, outside);
    torch::manual_seed(seed);
    auto lazy = fsdp::deferred_init([&] { return GenNet(seed, true, outside); });
    for (const auto& [name, t] : named_tensors(*lazy, true))
      ASSERT_EQ(t.storage().nbytes(), 0u) << name << " was allocated under deferred_init";
    const auto report = fsdp::materialize(lazy);
    EXPECT_EQ(report.sharded, 0);
    EXPECT_EQ(report.tensors, static_cast<int64_t>(named_tensors(*eager, true).size()));
    expect_same_values(named_tensors(*eager, true), named_tensors(*lazy, true));
  }
  for (int k = 0; k < kInitKinds; ++k) EXPECT_GT(init_kinds_used[k], 0) << "custom init " << k;
  {  // A parameter that is a view, one registered twice (tied), a buffer from an init list.
    struct TiedImpl : torch::nn::Module {
      TiedImpl() {
        view = register_parameter("view", torch::randn({6, 4}).narrow(0, 2, 3));
        lin = register_module("lin", torch::nn::Linear(4, 4));
        register_parameter("tied", lin->weight);
        table = register_buffer("table", torch::tensor({1.5, -2.0, 3.25}));
      }
      torch::Tensor view, table;
      torch::nn::Linear lin{nullptr};
    };
    torch::manual_seed(8);
    auto eager = std::make_shared<TiedImpl>();
    torch::manual_seed(8);
    auto lazy = fsdp::deferred_init([] { return std::make_shared<TiedImpl>(); });
    const auto report = fsdp::materialize(lazy);
    EXPECT_EQ(report.tensors, 4);  // view, lin.weight (= tied), lin.bias, table
    expect_same_values(named_tensors(*eager, true), named_tensors(*lazy, true));
    // Module::to inside the build (set_data onto a converted copy) is recorded too.
    torch::manual_seed(8);
    eager = std::make_shared<TiedImpl>();
    eager->to(torch::kDouble);
    torch::manual_seed(8);
    lazy = fsdp::deferred_init([] {
      auto m = std::make_shared<TiedImpl>();
      m->to(torch::kDouble);
      return m;
    });
    fsdp::materialize(lazy);
    expect_same_values(named_tensors(*eager, true), named_tensors(*lazy, true));
  }
  {  // torch::nn::init's functions (orthogonal_: QR and sign on a random matrix; dirac_, eye_)
    struct InitsImpl : torch::nn::Module {
      InitsImpl() {
        namespace init = torch::nn::init;
        torch::NoGradGuard no_grad;
        auto add = [&](const char* name, std::vector<int64_t> shape) {
          return register_parameter(name, torch::empty(shape));
        };
        init::xavier_uniform_(add("xu", {5, 7}));
        init::xavier_normal_(add("xn", {7, 5}));
        init::kaiming_normal_(add("kn", {4, 3, 2, 2}), 0.1, torch::kFanOut);
        init::orthogonal_(add("orth", {6, 4}), 0.5);
        init::dirac_(add("dirac", {3, 3, 3}));
        init::eye_(add("eye", {4, 6}));
        init::constant_(add("const", {3}), 0.75);
        register_buffer("perm", torch::randperm(9));  // no meta kernel in 1.13
      }
    };
    torch::manual_seed(13);
    auto eager = std::make_shared<InitsImpl>();
    torch::manual_seed(13);
    auto lazy = fsdp::deferred_init([] { return std::make_shared<InitsImpl>(); });
    fsdp::materialize(lazy);
    expect_same_values(named_tensors(*eager, true), named_tensors(*lazy, true));
  }
  // The GPT too (no buffers), unsharded.
  auto eager = eager_gpt(tiny_gpt(), 5);
  auto lazy = deferred_gpt(tiny_gpt(), 5);
  fsdp::materialize(lazy);
  expect_same_values(named_tensors(*eager, false), named_tensors(*lazy, false));
}

TEST(DeferredInit, GeneratorEndsWhereTheEagerBuildLeftIt) {
  const auto cfg = tiny_gpt();
  auto eager = eager_gpt(cfg, 11);
  const torch::Tensor next_eager = torch::rand({16});
  torch::manual_seed(11);
  const torch::Tensor first = torch::rand({16});
  auto lazy = deferred_gpt(cfg, 11);
  // deferred_init draws nothing: the generator is where the seed put it.
  EXPECT_TRUE(torch::equal(torch::rand({16}), first));
  fsdp::materialize(lazy);  // restarts from the state at deferred_init: the draw above is undone
  EXPECT_TRUE(torch::equal(torch::rand({16}), next_eager));
  expect_same_values(named_tensors(*eager, false), named_tensors(*lazy, false));
}

// Every rank: the GPT and two generated models, sharded, equal their eager rows.
void check_sharded_values(Rank& r) {
  const auto cfg = tiny_gpt();
  for (uint64_t seed : {21}) {
    auto eager = eager_gpt(cfg, seed);
    auto lazy = deferred_gpt(cfg, seed);
    auto root = fsdp::models::shard_gpt(lazy, r.world());
    const auto report = fsdp::materialize(lazy);
    EXPECT_EQ(report.sharded, report.tensors);
    expect_rows(named_tensors(*eager, false), root.named_parameters(), r.rank, r.size);
  }
  {  // materialised before fully_shard: an ordinary model by then
    auto eager = eager_gpt(cfg, 24);
    auto lazy = deferred_gpt(cfg, 24);
    EXPECT_EQ(fsdp::materialize(lazy).sharded, 0);
    auto root = fsdp::models::shard_gpt(lazy, r.world());
    expect_rows(named_tensors(*eager, false), root.named_parameters(), r.rank, r.size);
  }
  {  // mixed precision gives the full parameters a bf16 storage at fully_shard: shards stay fp32
    ShardOptions bf16;
    bf16.mixed_precision.param_dtype = torch::kBFloat16;
    auto eager = eager_gpt(cfg, 23);
    auto lazy = deferred_gpt(cfg, 23);
    auto root = fsdp::models::shard_gpt(lazy, r.world(), bf16, bf16);
    fsdp::materialize(lazy);
    expect_rows(named_tensors(*eager, false), root.named_parameters(), r.rank, r.size);
    lazy(torch::zeros({1, 4}, torch::kLong)).sum().backward();
  }
  auto outside = outside_value();
  for (uint64_t seed = 30; seed < 32; ++seed) {
    SCOPED_TRACE(detail::cat("generated seed ", seed));
    torch::manual_seed(seed);
    GenNet eager(seed, /*with_buffers=*/true, outside);
    torch::manual_seed(seed);
    auto lazy =
        fsdp::deferred_init([&] { return fsdp::Sharded<GenNet>(GenNet(seed, true, outside)); });
    auto root = fsdp::fully_shard(lazy, r.world());
    fsdp::materialize(lazy);
    expect_rows(named_tensors(*eager, false), root.named_parameters(), r.rank, r.size);
    // Buffers (BatchNorm's, when drawn) are filled whole on every rank.
    auto lazy_buffers = lazy->named_buffers();
    for (const auto& b : eager->named_buffers())
      EXPECT_TRUE(torch::equal(b.value(), lazy_buffers[b.key()])) << b.key();
  }
}

TEST(DeferredInit, ShardedValuesEqualEagerRowsN1) { run_ranks(1, check_sharded_values); }
TEST(DeferredInit, ShardedValuesEqualEagerRowsN2) { run_ranks(2, check_sharded_values); }
TEST(DeferredInit, ShardedValuesEqualEagerRowsN3) { run_ranks(3, check_sharded_values); }
TEST(DeferredInit, ShardedValuesEqualEagerRowsN4) { run_ranks(4, check_sharded_values); }

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------
TEST(DeferredInit, TrainingMatchesEagerInit) {
  run_ranks(2, [](Rank& r) {
    const auto cfg = tiny_gpt();
    auto eager = eager_gpt(cfg, 41);
    auto root_e = fsdp::models::shard_gpt(eager, r.world());
    auto lazy = deferred_gpt(cfg, 41);
    auto root_l = fsdp::models::shard_gpt(lazy, r.world());
    fsdp::materialize(lazy);
    torch::optim::AdamW opt_e(root_e.parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt_l(root_l.parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(100 * step + r.rank);
      const auto idx = torch::randint(cfg.vocab_size, {2, cfg.seq_len});
      const auto tgt = torch::randint(cfg.vocab_size, {2, cfg.seq_len});
      auto loss_e = eager(idx, tgt);
      loss_e.backward();
      opt_e.step();
      opt_e.zero_grad();
      auto loss_l = lazy(idx, tgt);
      loss_l.backward();
      opt_l.step();
      opt_l.zero_grad();
      EXPECT_EQ(loss_e.item<float>(), loss_l.item<float>()) << "step " << step;
    }
    const auto se = root_e.named_parameters(), sl = root_l.named_parameters();
    ASSERT_EQ(se.size(), sl.size());
    for (size_t i = 0; i < se.size(); ++i)
      EXPECT_TRUE(torch::equal(se[i].second, sl[i].second)) << se[i].first;
  });
}

// Parameters that are views (a transpose, a column slice of a wider tensor, two views into one
// buffer) were bound to the gathered bytes in their recorded geometry: the forward computed with
// wrong values, silently (or failed in borrow_storage for views into one buffer). Each layout,
// deferred against eager, at two and three ranks.
struct ViewsImpl : torch::nn::Module {
  explicit ViewsImpl(int layout) {
    at::Tensor a, b;
    const auto f64 = torch::kDouble;
    if (layout == 0) {
      a = torch::randn({4, 6}, f64).narrow(1, 1, 4);
      b = torch::randn({2, 4}, f64);
    } else if (layout == 1) {
      a = torch::randn({4, 4}, f64).t();
      b = torch::randn({4, 2}, f64).t();
    } else {
      auto buf = torch::randn({26}, f64);
      a = buf.narrow(0, 1, 16).view({4, 4});
      b = buf.narrow(0, 17, 8).view({2, 4});
    }
    w = register_parameter("w", a);
    u = register_parameter("u", b);
  }
  at::Tensor forward(const at::Tensor& x) { return torch::tanh(x.matmul(w)).matmul(u.t()); }
  at::Tensor w, u;
};
TORCH_MODULE(Views);
struct ViewsNetImpl : torch::nn::Module {
  explicit ViewsNetImpl(int layout) {
    block = register_module("block", fsdp::Sharded<Views>{Views(layout)});
  }
  at::Tensor forward(const at::Tensor& x) { return block(x).pow(2).sum(); }
  fsdp::Sharded<Views> block{nullptr};
};
TORCH_MODULE(ViewsNet);

void views_train_as_eager(Rank& r) {
  for (int layout = 0; layout < 3; ++layout) {
    SCOPED_TRACE("layout " + std::to_string(layout));
    torch::manual_seed(5);
    fsdp::Sharded<ViewsNet> eager{ViewsNet(layout)};
    torch::manual_seed(5);
    auto lazy = fsdp::deferred_init([&] { return fsdp::Sharded<ViewsNet>{ViewsNet(layout)}; });
    std::vector<FSDPModule> roots;
    for (auto* m : {&eager, &lazy}) {
      fully_shard((*m)->block, r.world());
      roots.push_back(fully_shard(*m, r.world()));
    }
    fsdp::materialize(lazy);
    torch::optim::SGD opt_e(roots[0].parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD opt_l(roots[1].parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      torch::manual_seed(10 * step + r.rank);
      const auto x = torch::randn({3, 4}, torch::kDouble);
      auto loss_e = eager(x), loss_l = lazy(x);
      EXPECT_EQ(loss_e.item<double>(), loss_l.item<double>()) << "step " << step;
      loss_e.backward();
      loss_l.backward();
      opt_e.step();
      opt_l.step();
    }
    const auto se = roots[0].named_parameters(), sl = roots[1].named_parameters();
    ASSERT_EQ(se.size(), sl.size());
    for (size_t i = 0; i < se.size(); ++i)
      EXPECT_TRUE(torch::equal(se[i].second, sl[i].second)) << se[i].first;
  }
}
TEST(DeferredInit, ViewParametersTrainAsEagerN2) { run_ranks(2, views_train_as_eager); }
TEST(DeferredInit, ViewParametersTrainAsEagerN3) { run_ranks(3, views_train_as_eager); }

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------
// Many equal layers and one small one: the largest parameter is a small part of the model.
struct WideImpl : torch::nn::Module {
  WideImpl(int64_t width, int64_t depth) {
    for (int64_t i = 0; i < depth; ++i)
      register_module("l" + std::to_string(i), torch::nn::Linear(width, width));
    register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    // Like the GPT's init_weights: every parameter drawn again once all exist. Without dropping
    // the constructors' dead results, every parameter would be live at once.
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.normal_(0.0, 0.02);
  }
};
TORCH_MODULE(Wide);

TEST(DeferredInit, PeakIsShardsPlusOneParameter) {
  run_ranks(2, [](Rank& r) {
    const int64_t width = 768, depth = 8;  // 2.25 MiB per weight, 18 MiB in all
    // Large blocks always mmapped, so that a freed parameter leaves RSS (glibc otherwise raises
    // its threshold after the first free and keeps later blocks in the heap).
    ::mallopt(M_MMAP_THRESHOLD, 256 * 1024);
    const double mib = 1024.0 * 1024.0;
    torch::manual_seed(3);
    auto lazy = fsdp::deferred_init([&] { return fsdp::Sharded<Wide>(Wide(width, depth)); });
    auto root = fsdp::fully_shard(lazy, r.world());
    int64_t shard_bytes = 0, model_bytes = 0;
    for (const auto& s : root.parameters()) shard_bytes += s.nbytes();
    for (const auto& p : lazy->parameters()) model_bytes += p.numel() * p.element_size();
    fsdp::memory::trim();
    const double before = fsdp::memory::current_rss_mb();
    const bool can_reset = fsdp::memory::reset_peak_rss();
    const auto report = fsdp::materialize(lazy);
    const double peak = fsdp::memory::peak_rss_mb() - before;
    const int64_t weight_bytes = width * width * 4;
    EXPECT_EQ(report.largest_tensor_bytes, weight_bytes);
    // Instrumented: one parameter at a time (the dead kaiming_uniform_ on scratch included).
    EXPECT_LE(report.peak_live_bytes, report.largest_tensor_bytes + 64 * 1024);
    EXPECT_GE(report.peak_live_bytes, report.largest_tensor_bytes);
    // Dead: each torch::empty and each constructor init (kaiming_uniform_, uniform_, fill_).
    EXPECT_EQ(report.operators_on_scratch, 2 * (depth * 2 + 2));
    // RSS: the shards get their bytes now; slack for the allocator and Gloo. Not bounded in a
    // sanitizer build (kRssUnderSanitizer); the instrumented peak above still is.
    if (can_reset && !kSanitized) {
      EXPECT_LE(peak, (shard_bytes + weight_bytes) / mib + 3.0);
    }
    if (verbose())
      std::cout << "rank " << r.rank << ": model " << model_bytes / mib << " MiB, shards "
                << shard_bytes / mib << " MiB, largest parameter "
                << report.largest_tensor_bytes / mib << " MiB; materialize: peak live "
                << report.peak_live_bytes / mib << " MiB (instrumented), peak RSS growth " << peak
                << " MiB" << (can_reset ? "" : " (peak reset not permitted)") << "\n";
  });
}

// Peak RSS growth of construction + sharding (+ materialize) on each of N=2 ranks, each build in
// fresh processes: the GPT's default config, or FSDP_INIT_GPT="layers,width". The largest over
// the ranks, parsed from their output.
double gpt_build_peak_mb(bool deferred) {
  auto result = run_ranks(2, [deferred](Rank& r) {
    GPTConfig cfg;
    if (const char* e = std::getenv("FSDP_INIT_GPT"); e && *e) {
      ASSERT_EQ(std::sscanf(e, "%ld,%ld", &cfg.n_layer, &cfg.n_embd), 2) << "FSDP_INIT_GPT=" << e;
    }
    r.world();  // rendezvous before measuring
    fsdp::memory::trim();
    const double before = fsdp::memory::current_rss_mb();
    fsdp::memory::reset_peak_rss();
    std::string detail;
    if (deferred) {
      auto lazy = deferred_gpt(cfg, 9);
      auto root = fsdp::models::shard_gpt(lazy, r.world());
      const auto report = fsdp::materialize(lazy);
      int64_t shards = 0;
      for (const auto& s : root.parameters()) shards += s.nbytes();
      detail = detail::cat(" shards_mb ", shards / 1048576.0, " peak_live_mb ",
                           report.peak_live_bytes / 1048576.0, " largest_parameter_mb ",
                           report.largest_tensor_bytes / 1048576.0);
    } else {
      auto eager = eager_gpt(cfg, 9);
      fsdp::models::shard_gpt(eager, r.world());
    }
    std::cout << "peak_rss_growth_mb " << fsdp::memory::peak_rss_mb() - before << " layers "
              << cfg.n_layer << " width " << cfg.n_embd << detail << "\n";
  });
  double peak = 0;
  for (const auto& out : result.output) {
    const auto at = out.find("peak_rss_growth_mb ");
    if (at == std::string::npos) continue;
    peak = std::max(peak, std::stod(out.substr(at + 19)));
  }
  return peak;
}

TEST(DeferredInit, GPTBuildPeakRSS) {
  if (kSanitized) GTEST_SKIP() << kRssUnderSanitizer;
  const double deferred = gpt_build_peak_mb(true);
  const double eager = gpt_build_peak_mb(false);
  if (in_rank_process()) return;
  if (verbose())
    std::cout << "GPT at N=2, peak RSS growth of construction + sharding, largest over ranks: "
              << "eager " << eager << " MiB, deferred (+ materialize) " << deferred << " MiB\n";
  EXPECT_LE(deferred, eager + 2.0);
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------
TEST(DeferredInit, UseBeforeMaterializeFails) {
  run_ranks(1, [](Rank& r) {
    const auto idx = torch::zeros({1, 4}, torch::kLong);
    auto lazy = deferred_gpt(tiny_gpt(), 1);
    expect_error([&] { lazy->wte->weight.sum(); },
                 {"aten::sum", "built under fsdp::deferred_init that has no values yet",
                  "fsdp::materialize(model)"});
    fsdp::models::shard_gpt(lazy, r.world());
    expect_error([&] { lazy(idx); }, {"was built under fsdp::deferred_init and has no values yet",
                                      "call fsdp::materialize(model) after fully_shard"});
    // Sharded now: the same message, and the failed forward left the model usable.
    expect_error([&] { lazy->wte->weight.sum(); },
                 {"has no values yet", "call fsdp::materialize(model)"});
    fsdp::materialize(lazy);
    EXPECT_EQ(lazy(idx).sizes(), (std::vector<int64_t>{1, 4, tiny_gpt().vocab_size}));
    expect_error([&] { fsdp::materialize(lazy); },
                 {"no parameter or buffer of this module waits", "materialised already"});
  });
}

TEST(DeferredInit, HostReadsInsideBuildFail) {
  expect_error([] { fsdp::deferred_init([] { return torch::ones({2}).sum().item<float>(); }); },
               {"aten::_local_scalar_dense", "reads the values", "after fsdp::materialize"});
  expect_error([] { fsdp::deferred_init([] { std::cout << torch::ones({2}); }); },
               {"read the bytes of a tensor built under fsdp::deferred_init", "printing"});
  expect_error(
      [] { fsdp::deferred_init([] { return torch::equal(torch::ones({2}), torch::ones({2})); }); },
      {"aten::equal", "reads the values"});
  // torch::nn::init::sparse_ indexes with a 0-d tensor it creates, which reads it (item()).
  expect_error(
      [] {
        fsdp::deferred_init([] { return torch::nn::init::sparse_(torch::empty({4, 3}), 0.5); });
      },
      {"aten::_local_scalar_dense", "reads the values"});
  // Nothing was left marked: an eager tensor afterwards works.
  EXPECT_EQ(torch::ones({2}).sum().item<float>(), 2.0f);
}

TEST(DeferredInit, GeneratorTouchedInsideBuildFails) {
  expect_error(
      [] {
        fsdp::deferred_init([] {
          torch::manual_seed(5);
          return torch::randn({3});
        });
      },
      {"random generator's state changed during the build", "seed before deferred_init"});
}

TEST(DeferredInit, RanksSeededDifferentlyFailByName) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(1 + r.rank);
    auto lazy = fsdp::deferred_init([&] { return fsdp::Sharded<GPT>(GPT(tiny_gpt())); });
    fsdp::models::shard_gpt(lazy, r.world());
    expect_error([&] { fsdp::materialize(lazy); },
                 {"parameter 'wte.weight' has different initial values on rank 1 than on rank 0",
                  "torch::manual_seed"});
  });
}

TEST(DeferredInit, UnsupportedBuildsFailByName) {
  auto outside = torch::zeros({2});
  expect_error([&] { fsdp::deferred_init([&] { outside.copy_(torch::ones({2})); }); },
               {"aten::copy_", "into a tensor built outside it", "inside the build too"});
  EXPECT_TRUE(torch::equal(outside, torch::zeros({2})));
  expect_error(
      [] {
        auto g = at::detail::createCPUGenerator(3);
        fsdp::deferred_init([&] { return torch::randn({2}, g); });
      },
      {"aten::randn", "draws from its own generator", "default CPU generator"});
  expect_error([] { fsdp::deferred_init([] { fsdp::deferred_init([] {}); }); },
               {"called inside another deferred_init's build"});
  auto gpt = deferred_gpt(tiny_gpt(), 2);
  expect_error([&] { fsdp::materialize(gpt->blocks[0]); },
               {"also built tensors outside it",
                "call materialize on the module deferred_init "
                "returned"});
  fsdp::materialize(gpt);  // still possible, whole
  auto built = fsdp::deferred_init([] { return torch::nn::Linear(2, 2); });
  expect_error([&] { fsdp::deferred_init([&] { return built->weight * 2; }); },
               {"aten::mul", "a tensor that this deferred_init did not build"});
}

}  // namespace
}  // namespace fsdp::testing::deferred_init_test
