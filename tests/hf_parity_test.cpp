// fsdp-cpp's Llama against transformers' own LlamaForCausalLM (bench/hf_peer.py, PyPI transformers
// 5.x in FSDP_PEER_PYTHON's venv, CPU, fp32), issue 48:
// - LogitsMatchTransformers...: a random LlamaForCausalLM (4 layers, 8 heads, 2 key/value heads,
//   Llama 3.1 rope scaling, untied head) saved in ten safetensors shards; fsdp::hf::load_llama into
//   the sharded model at N = 1, 2 and 4 gives transformers' logits within 1e-5; the same for a
//   bf16 single-file model with a tied head (transformers loading it in fp32).
// - FineTuning...: 20 steps of fsdp-train --init-from DIR on a token file of the tests' BPE
//   tokenizer (uint32), and the same 20 steps of transformers' model under plain PyTorch (the same
//   batches, schedule and torch.optim.AdamW): losses within 1e-5 relative at every step.
// - Export...: fsdp-checkpoint export of fsdp-train's step-20 checkpoint, loaded by
//   AutoModelForCausalLM.from_pretrained unchanged, gives the logits of the checkpoint's model in
//   fsdp-cpp within 1e-5.
// - bad directories refused by name; the closing sample of token data decoded as tokenizers does.
#include <fsdp/checkpoint.h>
#include <fsdp/deferred_init.h>
#include <fsdp/hf.h>
#include <fsdp/models/llama.h>
#include <fsdp/safetensors_torch.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "harness.h"
#include "train/metrics.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using fsdp::testing::ProcResult;
using fsdp::testing::Rank;

constexpr const char* kDirEnv = "FSDP_HF_PARITY_DIR";
constexpr int kSteps = 20;

// The scratch directory: made by the parent, passed to the ranks.
const std::string& scratch() {
  static const std::string d = [] {
    if (const char* env = std::getenv(kDirEnv)) return std::string(env);
    std::string p = ::testing::TempDir() + "hf_parity_" + std::to_string(::getpid());
    fs::remove_all(p);
    fs::create_directories(p);
    return p;
  }();
  return d;
}

class RemoveScratch : public ::testing::Environment {
 public:
  void TearDown() override {
    if (fsdp::testing::in_rank_process()) return;
    std::error_code ec;
    fs::remove_all(scratch(), ec);
  }
};
const auto* const kRemoveScratch = ::testing::AddGlobalTestEnvironment(new RemoveScratch);

ProcResult run(const std::vector<std::string>& argv, int seconds = 300) {
  return fsdp::testing::run_process(argv, std::chrono::seconds(seconds));
}

std::string peer() { return std::string(FSDP_SOURCE_DIR) + "/bench/hf_peer.py"; }

// FSDP_PEER_PYTHON imports transformers 5.x and tokenizers; checked once.
const std::string& python_problem() {
  static const std::string problem = [] {
    const auto r = run({FSDP_PEER_PYTHON, "-c",
                        "import sys, transformers, tokenizers, safetensors; "
                        "sys.exit(not transformers.__version__.startswith('5.'))"});
    if (r.exit_code != 0)
      return "FSDP_PEER_PYTHON " + std::string(FSDP_PEER_PYTHON) +
             " lacks transformers 5.x, tokenizers or safetensors; run scripts/torch_pip.sh. "
             "Output:\n" +
             r.output;
    return std::string();
  }();
  return problem;
}
#define REQUIRE_PYTHON() ASSERT_EQ(python_problem(), "") << "transformers cannot run"

// Runs the peer; "" or the failure's output.
std::string py(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {FSDP_PEER_PYTHON, peer()};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r = run(argv);
  return r.exit_code == 0 ? "" : "hf_peer.py failed:\n" + r.output;
}

// The shared inputs, made once: the BPE tokenizer, the corpus tokenized by scripts/tokenize.py
// (uint32), and the random models.
struct Inputs {
  std::string error;
  std::string tokenizer, tokens, sharded_model, bf16_model;
};
const Inputs& inputs() {
  static const Inputs in = [] {
    Inputs i;
    const std::string d = scratch();
    i.tokenizer = d + "/tokenizer";
    i.tokens = d + "/corpus.u32";
    i.sharded_model = d + "/llama_fp32_sharded";
    i.bf16_model = d + "/llama_bf16_tied";
    i.error = py({"tokenizer", i.tokenizer, "--corpus",
                  std::string(FSDP_SOURCE_DIR) + "/data/corpus.txt", "--vocab", "512"});
    if (!i.error.empty()) return i;
    const auto t =
        run({FSDP_PEER_PYTHON, std::string(FSDP_SOURCE_DIR) + "/scripts/tokenize.py", "--tokenizer",
             i.tokenizer, std::string(FSDP_SOURCE_DIR) + "/data/corpus.txt", i.tokens});
    if (t.exit_code != 0) i.error = "tokenize.py failed:\n" + t.output;
    if (i.error.empty())
      i.error =
          py({"make", i.sharded_model, "--rope-scaling", "llama3", "--max-shard-size", "100KB"});
    if (i.error.empty())
      i.error = py({"make", i.bf16_model, "--dtype", "bfloat16", "--tie", "--seed", "1",
                    "--rope-theta", "500000"});
    return i;
  }();
  return in;
}

#define REQUIRE_INPUTS()                                  \
  do {                                                    \
    REQUIRE_PYTHON();                                     \
    ASSERT_EQ(inputs().error, "") << "making the inputs"; \
  } while (0)

// A figure measured in rank 0 of run_ranks, for the parent to print (the ranks' output is shown
// only on failure).
void put_figure(const std::string& name, const std::string& text) {
  std::ofstream(scratch() + "/figure_" + name + ".txt") << text;
}
void print_figure(const std::string& name) {
  std::ifstream in(scratch() + "/figure_" + name + ".txt");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::printf("[hf parity] %s\n", text.c_str());
}
std::string fmt(const char* format, double a, double b = 0) {
  char buf[256];
  std::snprintf(buf, sizeof buf, format, a, b);
  return buf;
}

fsdp::testing::RunOptions options() {
  fsdp::testing::RunOptions o;
  o.env[kDirEnv] = scratch();
  o.timeout = std::chrono::seconds(240);
  return o;
}

// The sharded Llama of `cfg` on this rank, materialised (values to be overwritten).
struct ShardedLlama {
  fsdp::Sharded<models::Llama> model{nullptr};
  FSDPModule root;
};
ShardedLlama build(const models::LlamaConfig& cfg, Rank& r) {
  ShardedLlama s;
  torch::manual_seed(0);
  s.model = fsdp::deferred_init([&] { return fsdp::Sharded<models::Llama>(cfg); });
  s.root = models::shard_llama(s.model, r.world());
  fsdp::materialize(s.model);
  return s;
}

// Largest |ours - theirs| of the logits of `ref` (a peer `logits` file) on its tokens.
double max_logit_diff(ShardedLlama& s, const std::string& ref) {
  auto f = safetensors::File::open(ref);
  const auto tokens = safetensors::read_tensor(*f, "tokens");
  const auto want = safetensors::read_tensor(*f, "logits");
  torch::NoGradGuard no_grad;
  const auto got = s.model(tokens);
  EXPECT_EQ(got.sizes(), want.sizes());
  return (got - want).abs().max().item<double>();
}

std::string logits_file(const std::string& model, const std::string& name,
                        const std::string& dtype = "float32") {
  const std::string out = scratch() + "/" + name + ".safetensors";
  const std::string err = py({"logits", model, "--tokens", inputs().tokens, "--rows", "2", "--seq",
                              "32", "--dtype", dtype, "--out", out});
  EXPECT_EQ(err, "");
  return out;
}

TEST(HfParity, LogitsMatchTransformersAtOneTwoAndFourRanks) {
  if (!fsdp::testing::in_rank_process()) REQUIRE_INPUTS();
  const std::string model = scratch() + "/llama_fp32_sharded";
  const std::string ref = fsdp::testing::in_rank_process() ? scratch() + "/fp32_sharded.safetensors"
                                                           : logits_file(model, "fp32_sharded");
  for (int n : {1, 2, 4}) {
    fsdp::testing::run_ranks(
        n,
        [&](Rank& r) {
          auto s = build(hf::read_llama_config(model), r);
          hf::load_llama(model, s.root);
          const double diff = max_logit_diff(s, ref);
          if (r.rank == 0)
            put_figure("fp32", fmt("fp32 10-shard Llama (GQA 8/2, llama3 rope) N=%.0f: max |logit "
                                   "difference| %.3g",
                                   n, diff));
          EXPECT_LE(diff, 1e-5) << "N=" << n;
        },
        options());
    print_figure("fp32");
  }
}

TEST(HfParity, Bf16TiedModelLoadsToTransformersFp32Logits) {
  if (!fsdp::testing::in_rank_process()) REQUIRE_INPUTS();
  const std::string model = scratch() + "/llama_bf16_tied";
  const std::string ref = fsdp::testing::in_rank_process() ? scratch() + "/bf16_tied.safetensors"
                                                           : logits_file(model, "bf16_tied");
  fsdp::testing::run_ranks(
      2,
      [&](Rank& r) {
        const auto cfg = hf::read_llama_config(model);
        EXPECT_TRUE(cfg.tie_word_embeddings);
        auto s = build(cfg, r);
        hf::load_llama(model, s.root);
        const double diff = max_logit_diff(s, ref);
        if (r.rank == 0)
          put_figure("bf16",
                     fmt("bf16 tied Llama read into fp32, N=2: max |logit difference| %.3g", diff));
        EXPECT_LE(diff, 1e-5);
      },
      options());
  print_figure("bf16");
}

// fsdp-train's run of the fine-tuning tests (N = 2), made once: its losses and its run directory.
struct FineTune {
  std::string error, run_dir;
  std::vector<double> loss;
};
const FineTune& fine_tune() {
  static const FineTune ft = [] {
    FineTune f;
    f.run_dir = scratch() + "/finetune_run";
    const auto r = run({fsdp::testing::bin_dir() + "/fsdp-train",
                        "--init-from",
                        inputs().sharded_model,
                        "--data",
                        inputs().tokens,
                        "--steps",
                        std::to_string(kSteps),
                        "--seq",
                        "32",
                        "--batch",
                        "8",
                        "--lr",
                        "1e-3",
                        "--warmup",
                        "5",
                        "--eval-every",
                        "0",
                        "--sample-tokens",
                        "0",
                        "--save-every",
                        std::to_string(kSteps),
                        "--nproc",
                        "2",
                        "--peak-tflops",
                        "1",
                        "--quiet",
                        "--run-dir",
                        f.run_dir});
    if (r.exit_code != 0) {
      f.error = "fsdp-train failed:\n" + r.output;
      return f;
    }
    for (const auto& row : train::read_metrics(f.run_dir + "/metrics.csv"))
      f.loss.push_back(row.loss);
    return f;
  }();
  return ft;
}

TEST(HfParity, FineTuningMatchesTransformersUnderPyTorchForTwentySteps) {
  REQUIRE_INPUTS();
  const FineTune& ours = fine_tune();
  ASSERT_EQ(ours.error, "");
  const std::string json = scratch() + "/peer_train.json";
  ASSERT_EQ(py({"train", inputs().sharded_model, "--data", inputs().tokens, "--steps",
                std::to_string(kSteps), "--seq", "32", "--batch", "8", "--lr", "1e-3", "--warmup",
                "5", "--json", json}),
            "");
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in);
  std::vector<double> theirs;
  for (const auto& row : j["steps"]) theirs.push_back(row["loss"].get<double>());
  ASSERT_EQ(ours.loss.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(theirs.size(), static_cast<size_t>(kSteps));
  double worst = 0;
  for (int i = 0; i < kSteps; ++i) {
    const double rel = std::abs(ours.loss[i] - theirs[i]) / std::abs(theirs[i]);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-5) << "step " << i + 1 << ": fsdp-train " << ours.loss[i] << ", transformers "
                         << theirs[i];
  }
  std::printf(
      "[hf parity] fine-tuning, fsdp-train N=2 against transformers %s under torch %s: "
      "max relative loss difference over %d steps %.3g (loss %.4f -> %.4f)\n",
      j["transformers"].get<std::string>().c_str(), j["torch"].get<std::string>().c_str(), kSteps,
      worst, theirs.front(), theirs.back());
  EXPECT_LT(ours.loss.back(), ours.loss.front() - 0.2) << "the run did not train";
}

TEST(HfParity, ExportedCheckpointLoadsInTransformersToTheFineTunedLogits) {
  const std::string ckpt = scratch() + "/finetune_run/step_00000020";
  const std::string out = scratch() + "/exported";
  std::string ref = scratch() + "/exported.safetensors";
  if (!fsdp::testing::in_rank_process()) {
    REQUIRE_INPUTS();
    ASSERT_EQ(fine_tune().error, "");
    // Shards of about 100 KB: the index and several files, as save_pretrained writes them.
    const auto r = run({fsdp::testing::bin_dir() + "/fsdp-checkpoint", "export", ckpt, out,
                        "--max-shard-mb", "0.1"});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(fs::exists(out + "/model.safetensors.index.json"));
    // Unchanged: from_pretrained(out) with its defaults (dtype from the config).
    ref = logits_file(out, "exported", "auto");
    // Refused: an existing directory.
    const auto again = run({fsdp::testing::bin_dir() + "/fsdp-checkpoint", "export", ckpt, out});
    EXPECT_NE(again.exit_code, 0);
    EXPECT_NE(again.output.find("exists and is not an empty directory"), std::string::npos)
        << again.output;
    // fsdp-checkpoint consolidate of the run directory (its newest checkpoint): the same tensors,
    // bit for bit, in one file.
    const std::string whole = scratch() + "/consolidated.safetensors";
    const auto c = run({fsdp::testing::bin_dir() + "/fsdp-checkpoint", "consolidate",
                        scratch() + "/finetune_run", whole});
    ASSERT_EQ(c.exit_code, 0) << c.output;
    auto file = safetensors::File::open(whole);
    const auto exported = hf::weight_files(out);
    EXPECT_EQ(file->header().tensors.size(), exported.size());
    for (const auto& [name, path] : exported) {
      auto part = safetensors::File::open(path);
      EXPECT_TRUE(torch::equal(safetensors::read_tensor(*file, name),
                               safetensors::read_tensor(*part, name)))
          << name;
    }
  }
  fsdp::testing::run_ranks(
      2,
      [&](Rank& r) {
        auto s = build(hf::read_llama_config(out), r);
        checkpoint::load(ckpt, s.root, nullptr, *r.world());
        const double diff = max_logit_diff(s, ref);
        if (r.rank == 0)
          put_figure("export", fmt("the exported step-20 checkpoint in transformers against "
                                   "fsdp-cpp's model of that checkpoint, N=2: max |logit "
                                   "difference| %.3g",
                                   diff));
        EXPECT_LE(diff, 1e-5);
      },
      options());
  print_figure("export");
}

// A copy of the sharded model's directory with `edit` applied to its config.json and index.
std::string edited_copy(const std::string& name,
                        const std::function<void(nlohmann::json&, nlohmann::json&)>& edit) {
  const std::string dir = scratch() + "/" + name;
  fs::remove_all(dir);
  fs::copy(inputs().sharded_model, dir);
  nlohmann::json cfg, index;
  std::ifstream(dir + "/config.json") >> cfg;
  std::ifstream(dir + "/model.safetensors.index.json") >> index;
  edit(cfg, index);
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump(2);
  return dir;
}

// fsdp-train refuses, before any rank starts, a directory it cannot load, naming the key or the
// tensor.
TEST(HfParity, FsdpTrainRefusesOtherArchitecturesAndMissingTensorsByName) {
  REQUIRE_INPUTS();
  struct Case {
    std::string name;
    std::function<void(nlohmann::json&, nlohmann::json&)> edit;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {"mistral",
       [](auto& c, auto&) {
         c["architectures"] = {"MistralForCausalLM"};
         c["model_type"] = "mistral";
       },
       {"'architectures' is [\"MistralForCausalLM\"]", "LlamaForCausalLM only"}},
      {"yarn",
       [](auto& c, auto&) { c["rope_parameters"]["rope_type"] = "yarn"; },
       {"rope type 'yarn'", "default, linear and llama3"}},
      {"bias", [](auto& c, auto&) { c["attention_bias"] = true; }, {"'attention_bias' is true"}},
      {"missing",
       [](auto&, auto& i) { i["weight_map"].erase("model.layers.3.mlp.down_proj.weight"); },
       {"lacks 1 of the", "'model.layers.3.mlp.down_proj.weight'"}},
  };
  for (const auto& c : cases) {
    const std::string dir = edited_copy(c.name, c.edit);
    const auto r = run(
        {fsdp::testing::bin_dir() + "/fsdp-train", "--init-from", dir, "--data", inputs().tokens,
         "--steps", "1", "--nproc", "2", "--quiet", "--run-dir", scratch() + "/refused_" + c.name},
        60);
    EXPECT_EQ(r.exit_code, 1) << c.name << ":\n" << r.output;
    for (const auto& part : c.message)
      EXPECT_NE(r.output.find(part), std::string::npos) << c.name << ": '" << part << "' not in\n"
                                                        << r.output;
    EXPECT_EQ(r.output.find("[rank"), std::string::npos) << c.name << ": ranks were started";
  }
}

// A run from a model directory resumes without it: the checkpoint carries the config.json
// (extra.hf_config), and the losses equal the uninterrupted run's.
TEST(HfParity, ResumedRunNeedsNotTheModelDirectory) {
  REQUIRE_INPUTS();
  const std::string copy = scratch() + "/llama_copy", a = scratch() + "/resume_a",
                    b = scratch() + "/resume_b";
  fs::remove_all(copy);
  fs::copy(inputs().sharded_model, copy);
  auto train = [&](const std::string& dir, const std::vector<std::string>& more) {
    std::vector<std::string> argv = {fsdp::testing::bin_dir() + "/fsdp-train",
                                     "--data",
                                     inputs().tokens,
                                     "--seq",
                                     "32",
                                     "--batch",
                                     "8",
                                     "--nproc",
                                     "2",
                                     "--eval-every",
                                     "0",
                                     "--sample-tokens",
                                     "0",
                                     "--peak-tflops",
                                     "1",
                                     "--quiet",
                                     "--run-dir",
                                     dir};
    argv.insert(argv.end(), more.begin(), more.end());
    const auto r = run(argv, 120);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output;
  };
  train(a, {"--init-from", copy, "--steps", "4", "--save-every", "2"});
  train(b, {"--init-from", copy, "--steps", "6"});
  fs::remove_all(copy);
  std::vector<std::string> resume = {
      fsdp::testing::bin_dir() + "/fsdp-train", "--resume", a, "--steps", "6", "--quiet"};
  const auto r = run(resume, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resuming from " + a + "/step_00000004 at step 4"), std::string::npos)
      << r.output;
  std::vector<double> resumed, straight;
  for (const auto& row : train::read_metrics(a + "/metrics.csv")) resumed.push_back(row.loss);
  for (const auto& row : train::read_metrics(b + "/metrics.csv")) straight.push_back(row.loss);
  EXPECT_EQ(resumed, straight);
  EXPECT_EQ(resumed.size(), 6u);
}

// --model llama from scratch on the token file: the closing sample's ids, shown as text with
// --tokenizer exactly as the tokenizers package decodes them.
TEST(HfParity, TokenSampleIsDecodedAsTokenizersDecodes) {
  REQUIRE_INPUTS();
  const auto r = run({fsdp::testing::bin_dir() + "/fsdp-train",
                      "--model",
                      "llama",
                      "--data",
                      inputs().tokens,
                      "--vocab",
                      "512",
                      "--layers",
                      "2",
                      "--heads",
                      "4",
                      "--kv-heads",
                      "2",
                      "--width",
                      "32",
                      "--seq",
                      "32",
                      "--batch",
                      "4",
                      "--steps",
                      "3",
                      "--nproc",
                      "1",
                      "--sample-tokens",
                      "16",
                      "--tokenizer",
                      inputs().tokenizer,
                      "--eval-every",
                      "0",
                      "--peak-tflops",
                      "1",
                      "--run-dir",
                      scratch() + "/sample_run"},
                     120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("prompt tokens \\[([0-9 ]+)\\]")))
      << r.output;
  const std::string prompt = m[1];
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("token ids: ([0-9 ]+)"))) << r.output;
  const std::string ids = m[1];
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("\\| text: ([^\\n]*)"))) << r.output;
  const std::string text = m[1];
  const auto decoded =
      run({FSDP_PEER_PYTHON, "-c",
           "import sys; from tokenizers import Tokenizer; "
           "t = Tokenizer.from_file(sys.argv[1]); "
           "p = [int(x) for x in sys.argv[2].split()]; "
           "g = [int(x) for x in sys.argv[3].split()]; "
           "d = lambda ids: t.decode(ids, skip_special_tokens=False); "
           "s = d(p) + '[' + d(g) + ']'; "
           "s = ''.join({'\\n': '\\\\n', '\\t': '\\\\t'}.get(c, '?' if ord(c) < 32 "
           "or ord(c) == 127 else c) for c in s); "
           "sys.stdout.buffer.write(s.encode())",
           inputs().tokenizer + "/tokenizer.json", prompt, ids});
  ASSERT_EQ(decoded.exit_code, 0) << decoded.output;
  // The summary's line: newline and tab escaped, other control characters '?' (one_line).
  EXPECT_EQ(text, decoded.output);
  std::printf("[hf parity] the sample of token data as the tokenizers package decodes it: %s\n",
              text.c_str());
}

}  // namespace
}  // namespace fsdp
