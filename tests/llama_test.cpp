// fsdp::models::Llama and Hugging Face directories without Python (the parity with transformers
// itself: hf_parity_test.cpp): transformers' names and shapes, grouped-query attention, the
// attention and rotary embeddings against their formulas in double, sharded training equal to
// unsharded, config.json both ways with its refusals, and loading (bf16, sharded files, each
// rank its rows) with missing and unexpected tensors named.
#include <fsdp/deferred_init.h>
#include <fsdp/hf.h>
#include <fsdp/models/llama.h>
#include <fsdp/safetensors_torch.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "compat/attention.h"
#include "harness.h"

namespace fsdp::llama_test {
namespace {

namespace fs = std::filesystem;
using fsdp::testing::Rank;
using models::Llama;
using models::LlamaConfig;

LlamaConfig tiny(int64_t kv_heads = 2, bool tied = false) {
  LlamaConfig c;
  c.vocab_size = 40;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = kv_heads;
  c.tie_word_embeddings = tied;
  return c;
}

TEST(LlamaModel, ParameterNamesShapesAndCountAreTransformers) {
  for (bool tied : {false, true}) {
    torch::manual_seed(0);
    Llama m(tiny(2, tied));
    const auto want = hf::llama_tensors(m->cfg);
    const auto got = m->named_parameters();
    ASSERT_EQ(got.size(), want.size()) << "tied " << tied;
    int64_t count = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].key(), want[i].first);
      EXPECT_EQ(got[i].value().sizes().vec(), want[i].second) << want[i].first;
      count += got[i].value().numel();
    }
    EXPECT_EQ(count, m->cfg.parameter_count());
    EXPECT_EQ(m->named_buffers().size(), 0u) << "the rotary tables are computed, not stored";
  }
}

// With Hkv = 2 of 4 heads, query heads 0, 1 read key/value head 0 and 2, 3 head 1: the same
// logits as Hkv = 4 with each key/value head's weights repeated for its query heads.
TEST(LlamaModel, GroupedQueryAttentionServesEachQueryHeadItsGroup) {
  torch::manual_seed(0);
  Llama gqa(tiny(2));
  Llama mha(tiny(4));
  torch::NoGradGuard no_grad;
  const auto src = gqa->named_parameters();
  for (auto& p : mha->named_parameters()) {
    const auto& from = src[p.key()];
    if (p.key().find("k_proj") != std::string::npos || p.key().find("v_proj") != std::string::npos)
      p.value().copy_(from.view({2, 1, 8, 32}).expand({2, 2, 8, 32}).reshape({32, 32}));
    else
      p.value().copy_(from);
  }
  const auto idx = torch::randint(40, {2, 7}, torch::kLong);
  EXPECT_TRUE(torch::allclose(gqa->forward(idx), mha->forward(idx), 1e-5, 1e-6));
}

TEST(LlamaModel, AttentionMatchesTheMathInDouble) {
  torch::manual_seed(1);
  const auto q = torch::randn({2, 4, 9, 8}), k = torch::randn({2, 2, 9, 8}),
             v = torch::randn({2, 2, 9, 8});
  const auto got = compat::causal_attention(q, k, v);
  auto qd = q.to(torch::kDouble), kd = k.to(torch::kDouble).repeat_interleave(2, 1),
       vd = v.to(torch::kDouble).repeat_interleave(2, 1);
  auto s = qd.matmul(kd.transpose(-2, -1)) / std::sqrt(8.0);
  s = s.masked_fill(torch::ones({9, 9}, torch::kBool).triu(1), -INFINITY);
  const auto want = torch::softmax(s, -1).matmul(vd);
  EXPECT_LT((got.to(torch::kDouble) - want).abs().max().item<double>(), 1e-5);
}

// inv_freq of each rope type against its definition, in double.
TEST(LlamaModel, RopeInverseFrequenciesFollowEachRopeType) {
  LlamaConfig c = tiny();
  c.head_dim = 16;
  c.rope_theta = 500000;
  auto check = [&](const std::function<double(double)>& scale) {
    const auto got = models::rope_inv_freq(c);
    ASSERT_EQ(got.numel(), 8);
    for (int64_t i = 0; i < 8; ++i) {
      const double base = 1.0 / std::pow(c.rope_theta, 2.0 * i / 16);
      const double want = scale(base);
      EXPECT_NEAR(got[i].item<double>(), want, 2e-6 * want) << c.rope_scaling.type << " i=" << i;
    }
  };
  check([](double f) { return f; });
  c.rope_scaling.type = "linear";
  c.rope_scaling.factor = 4;
  check([](double f) { return f / 4; });
  c.rope_scaling = {"llama3", 8.0, 1.0, 4.0, 64};
  check([](double f) {
    const double wavelen = 2 * M_PI / f, low = 64.0, high = 16.0;
    if (wavelen < high) return f;
    if (wavelen > low) return f / 8;
    const double smooth = (64.0 / wavelen - 1.0) / 3.0;
    return (1 - smooth) * f / 8 + smooth * f;
  });
}

// Rotated queries and keys score by their distance only.
TEST(LlamaModel, RotaryScoresDependOnRelativePositionOnly) {
  LlamaConfig c = tiny();
  const auto [cos, sin] = models::rotary_tables(c, 12, torch::TensorOptions().dtype(torch::kFloat));
  torch::manual_seed(2);
  const auto q = torch::randn({8}), k = torch::randn({8});
  auto rot = [&, cos = cos, sin = sin](const torch::Tensor& x, int64_t pos) {
    const auto half = torch::cat({-x.narrow(0, 4, 4), x.narrow(0, 0, 4)});
    return x * cos[pos] + half * sin[pos];
  };
  const double a = rot(q, 5).dot(rot(k, 2)).item<double>();
  const double b = rot(q, 10).dot(rot(k, 7)).item<double>();
  EXPECT_NEAR(a, b, 1e-5);
  EXPECT_GT(std::abs(a - rot(q, 5).dot(rot(k, 3)).item<double>()), 1e-3);
}

// Deferred init, one group per layer, AdamW: the same losses as the unsharded model built from
// the same seed, at 2 and 3 ranks (3: rows that do not divide evenly).
TEST(LlamaModel, ShardedTrainingEqualsUnshardedAtTwoAndThreeRanks) {
  for (int n : {2, 3}) {
    fsdp::testing::run_ranks(n, [](Rank& r) {
      const LlamaConfig cfg = tiny(2);
      torch::manual_seed(0);
      Llama plain(cfg);
      torch::manual_seed(0);
      auto sharded = fsdp::deferred_init([&] { return fsdp::Sharded<Llama>(cfg); });
      auto root = models::shard_llama(sharded, r.world());
      fsdp::materialize(sharded);
      torch::optim::AdamW a(plain->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW b(root.parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(100 + step);
        const auto x = torch::randint(40, {6, 10}, torch::kLong),
                   y = torch::randint(40, {6, 10}, torch::kLong);
        const int64_t rows = 6 / r.size + (r.rank < 6 % r.size ? 1 : 0);
        const int64_t from = r.rank * (6 / r.size) + std::min<int64_t>(r.rank, 6 % r.size);
        auto lp = plain->forward(x, y);
        lp.backward();
        a.step();
        a.zero_grad();
        // Each rank its rows; the reduce-scatter averages: weight the rank's mean by its rows.
        auto ls = sharded(x.narrow(0, from, rows), y.narrow(0, from, rows)) *
                  (static_cast<double>(rows) * r.size / 6);
        ls.backward();
        b.step();
        b.zero_grad();
        auto t = ls.detach().clone().view({1});
        r.world()->all_reduce(t, ReduceOp::kSum).wait();
        const double got = t.item<double>() / r.size, want = lp.item<double>();
        EXPECT_NEAR(got, want, 2e-6 * std::abs(want)) << "N=" << r.size << " step " << step;
      }
    });
  }
}

TEST(LlamaConfigJson, RoundTripsThroughTheTransformersForm) {
  LlamaConfig c = tiny(2, true);
  c.rope_theta = 500000;
  c.rope_scaling = {"llama3", 8.0, 1.0, 4.0, 8192};
  c.pad_token_id = 3;
  c.rms_norm_eps = 1e-6;
  const std::string text = c.to_hf_json(R"({"bos_token_id": 1, "torch_dtype": "bfloat16"})");
  const auto j = nlohmann::json::parse(text);
  EXPECT_EQ(j["bos_token_id"], 1) << "other keys are kept";
  EXPECT_EQ(j["dtype"], "float32");
  EXPECT_FALSE(j.contains("torch_dtype"));
  EXPECT_EQ(j["rope_scaling"]["rope_type"], "llama3");  // transformers 4's spelling too
  const auto back = LlamaConfig::from_hf_json(text, "t");
  EXPECT_EQ(back.to_hf_json(), c.to_hf_json());
  // transformers 4's form: rope_theta and rope_scaling with "type".
  const auto v4 = LlamaConfig::from_hf_json(
      R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "rope_theta": 1000.0, "rope_scaling": {"type": "linear", "factor": 2.0}})",
      "v4");
  EXPECT_EQ(v4.rope_theta, 1000.0);
  EXPECT_EQ(v4.rope_scaling.type, "linear");
  EXPECT_EQ(v4.kv_heads(), 2);
  EXPECT_EQ(v4.rms_norm_eps, 1e-6) << "transformers' default";
}

TEST(LlamaConfigJson, RefusesWhatTheModelLacksNamingTheKey) {
  const std::string base = R"("vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                              "num_hidden_layers": 1, "num_attention_heads": 2)";
  auto parse = [&](const std::string& more) {
    return LlamaConfig::from_hf_json("{" + base + more + "}", "cfg.json");
  };
  using fsdp::testing::expect_error;
  expect_error([&] { parse(R"(, "architectures": ["GPT2LMHeadModel"])"); },
               {"cfg.json", "'architectures' is [\"GPT2LMHeadModel\"]"});
  expect_error([&] { parse(R"(, "model_type": "qwen2")"); }, {"'model_type' is \"qwen2\""});
  expect_error([&] { parse(R"(, "model_type": "llama", "hidden_act": "gelu")"); },
               {"'hidden_act' is \"gelu\""});
  expect_error([&] { parse(R"(, "model_type": "llama", "mlp_bias": true)"); }, {"'mlp_bias'"});
  expect_error(
      [&] { parse(R"(, "model_type": "llama", "rope_parameters": {"rope_type": "yarn"})"); },
      {"rope type 'yarn'"});
  expect_error([&] { parse(R"(, "model_type": "llama", "num_key_value_heads": 3)"); },
               {"num_attention_heads 2 is not a multiple of num_key_value_heads 3"});
  expect_error(
      [&] {
        LlamaConfig::from_hf_json(R"({"model_type": "llama", "vocab_size": 10})", "cfg.json");
      },
      {"'hidden_size' is missing"});
}

// A transformers directory written here: the tensors of a seeded Llama in BF16, split over two
// files with model.safetensors.index.json.
std::string write_directory(const LlamaConfig& cfg, const std::string& dir,
                            const std::string& drop = "", const std::string& extra = "") {
  fs::remove_all(dir);
  fs::create_directories(dir);
  torch::manual_seed(5);
  Llama m(cfg);
  std::vector<torch::Tensor> keep;
  std::vector<safetensors::TensorView> files[2];
  nlohmann::json index;
  int k = 0;
  for (const auto& p : m->named_parameters()) {
    if (p.key() == drop) continue;
    keep.push_back(p.value().detach().to(torch::kBFloat16).contiguous());
    const int file = k++ % 2;
    files[file].push_back(safetensors::view_of(p.key(), keep.back()));
    index["weight_map"][p.key()] = "part" + std::to_string(file) + ".safetensors";
  }
  if (!extra.empty()) {
    keep.push_back(torch::zeros({2}));
    files[0].push_back(safetensors::view_of(extra, keep.back()));
    index["weight_map"][extra] = "part0.safetensors";
  }
  for (int f : {0, 1})
    safetensors::write(dir + "/part" + std::to_string(f) + ".safetensors", files[f]);
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  std::ofstream(dir + "/config.json") << cfg.to_hf_json();
  return dir;
}

std::string test_dir(const std::string& name) {
  return ::testing::TempDir() + "llama_test_" + name;
}

TEST(HfDirectory, LoadsBf16ShardsIntoTheWholeModel) {
  const LlamaConfig cfg = tiny(2, true);
  const std::string dir = write_directory(cfg, test_dir("whole"));
  hf::check_llama_weights(dir, hf::read_llama_config(dir));
  torch::manual_seed(5);
  Llama want(cfg);
  torch::manual_seed(9);
  Llama got(hf::read_llama_config(dir));
  hf::load_llama(dir, *got);
  const auto w = want->named_parameters();
  for (const auto& p : got->named_parameters())
    EXPECT_TRUE(torch::equal(p.value(), w[p.key()].to(torch::kBFloat16).to(torch::kFloat)))
        << p.key();
  fs::remove_all(dir);
}

// Each rank's shards hold the rows of the file at N = 2 and 3.
TEST(HfDirectory, EachRankLoadsItsRows) {
  const std::string dir = test_dir("sharded");
  if (!fsdp::testing::in_rank_process()) write_directory(tiny(2), dir);
  for (int n : {2, 3}) {
    fsdp::testing::run_ranks(n, [&](Rank& r) {
      const auto cfg = hf::read_llama_config(dir);
      torch::manual_seed(0);  // every rank the same (overwritten) initial values
      auto model = fsdp::deferred_init([&] { return fsdp::Sharded<Llama>(cfg); });
      auto root = models::shard_llama(model, r.world());
      fsdp::materialize(model);
      hf::load_llama(dir, root);
      torch::manual_seed(5);
      Llama want(cfg);
      const auto w = want->named_parameters();
      for (const auto& s : root.shards()) {
        const auto rows = w[s.name].to(torch::kBFloat16).to(torch::kFloat);
        const int64_t n_rows = s.shard.dim() == 0 ? 1 : s.shard.size(0);
        EXPECT_TRUE(torch::equal(s.shard, rows.narrow(0, s.row_offset, n_rows))) << s.name;
      }
    });
  }
  if (!fsdp::testing::in_rank_process()) fs::remove_all(dir);
}

TEST(HfDirectory, NamesMissingAndUnexpectedTensors) {
  const LlamaConfig cfg = tiny(2);
  using fsdp::testing::expect_error;
  const std::string missing =
      write_directory(cfg, test_dir("missing"), "model.layers.1.mlp.up_proj.weight");
  expect_error([&] { hf::check_llama_weights(missing, cfg); },
               {"lacks 1 of the", "'model.layers.1.mlp.up_proj.weight'"});
  torch::manual_seed(0);
  Llama m(cfg);
  expect_error([&] { hf::load_llama(missing, *m); }, {"'model.layers.1.mlp.up_proj.weight'"});
  const std::string extra =
      write_directory(cfg, test_dir("extra"), "", "model.layers.0.self_attn.q_proj.bias");
  expect_error([&] { hf::check_llama_weights(extra, cfg); },
               {"does not have", "'model.layers.0.self_attn.q_proj.bias'"});
  // Older files' rotary tables are computed here: skipped, not refused.
  const std::string rotary =
      write_directory(cfg, test_dir("rotary"), "", "model.layers.0.self_attn.rotary_emb.inv_freq");
  hf::check_llama_weights(rotary, cfg);
  fs::remove_all(test_dir("noweights"));
  fs::create_directories(test_dir("noweights"));
  std::ofstream(test_dir("noweights") + "/config.json") << cfg.to_hf_json();
  expect_error([&] { hf::weight_files(test_dir("noweights")); },
               {"holds neither model.safetensors nor model.safetensors.index.json"});
  for (const char* d : {"missing", "extra", "rotary", "noweights"}) fs::remove_all(test_dir(d));
}

}  // namespace
}  // namespace fsdp::llama_test
