// Unit tests of fsdp-train's torch-free parts: settings (flags, JSON/TOML files, validation), the
// data order, the learning-rate schedule, metrics CSV and the SVG plot.
#include <fsdp/checkpoint_index.h>
#include <fsdp/error.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/atomic_file.h"
#include "harness.h"
#include "train/config.h"
#include "train/data.h"
#include "train/generate.h"
#include "train/malloc.h"
#include "train/metrics.h"
#include "train/model_size.h"
#include "train/plot.h"
#include "train/resume.h"
#include "train/schedule.h"
#include "train/token_sample.h"

namespace fsdp::train {
namespace {

// Temporary files of this process, removed after all tests.
std::vector<std::string>& temp_files() {
  static std::vector<std::string> files;
  return files;
}

class RemoveTempFiles : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const auto& f : temp_files()) std::remove(f.c_str());
  }
};
const auto* const kRemoveTempFiles = ::testing::AddGlobalTestEnvironment(new RemoveTempFiles);

std::string temp_path(const std::string& name) {
  temp_files().push_back(::testing::TempDir() + "fsdp_train_unit_" + std::to_string(::getpid()) +
                         "_" + name);
  return temp_files().back();
}

std::string write_file(const std::string& name, const std::string& text) {
  const std::string p = temp_path(name);
  std::ofstream(p) << text;
  return p;
}

// The message of the fsdp::Error thrown by f, or "" when none is thrown.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(TrainConfig, DefaultsAreValid) {
  auto r = parse_args({"fsdp-train"});
  ASSERT_TRUE(r.config.has_value()) << r.message;
  EXPECT_EQ(r.config->nproc, 2);
  EXPECT_TRUE(r.config->reshard_after_forward);
  EXPECT_EQ(r.config->optimizer, "fused");  // fsdp::optim::AdamW
  EXPECT_TRUE(r.config->explicit_keys.empty());
}

TEST(TrainConfig, FlagsOverrideDefaults) {
  auto r = parse_args({"fsdp-train", "--steps", "7", "--width=96", "--heads", "3", "--no-shard",
                       "--no-reshard-after-forward", "--data-order", "sequential", "--lr", "1e-3"});
  ASSERT_TRUE(r.config.has_value()) << r.message;
  EXPECT_EQ(r.config->steps, 7);
  EXPECT_EQ(r.config->width, 96);
  EXPECT_TRUE(r.config->no_shard);
  EXPECT_FALSE(r.config->reshard_after_forward);
  EXPECT_EQ(r.config->data_order, "sequential");
  EXPECT_DOUBLE_EQ(r.config->lr, 1e-3);
  EXPECT_DOUBLE_EQ(r.config->clip, 0);
  EXPECT_FALSE(r.config->activation_checkpointing);
  auto t = parse_args({"fsdp-train", "--clip", "0.5", "--activation-checkpointing"});
  ASSERT_TRUE(t.config.has_value()) << t.message;
  EXPECT_DOUBLE_EQ(t.config->clip, 0.5);
  EXPECT_TRUE(t.config->activation_checkpointing);
  EXPECT_EQ(r.config->mixed_precision, "none");
  EXPECT_EQ(r.config->hsdp, 1);
  auto m = parse_args({"fsdp-train", "--mixed-precision", "bf16", "--hsdp", "2"});
  ASSERT_TRUE(m.config.has_value()) << m.message;
  EXPECT_EQ(m.config->mixed_precision, "bf16");
  EXPECT_EQ(m.config->hsdp, 2);
  auto bad = parse_args({"fsdp-train", "--mixed-precision", "fp8"});
  EXPECT_FALSE(bad.config.has_value());
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.message.find("--mixed-precision"), std::string::npos) << bad.message;
  EXPECT_TRUE(r.config->was_set("steps"));
  EXPECT_FALSE(r.config->was_set("batch"));
  EXPECT_EQ(r.config->malloc_policy, "auto");
  // auto: steady, but glibc's default in a sanitizer build (its allocator takes no thresholds).
  EXPECT_EQ(sanitizer_build(), fsdp::testing::kSanitized);
  EXPECT_EQ(resolve_malloc_policy("auto"), fsdp::testing::kSanitized ? "default" : "steady");
  EXPECT_EQ(resolve_malloc_policy("steady"), "steady");
  EXPECT_EQ(resolve_malloc_policy("default"), "default");
  EXPECT_EQ(describe_malloc_policy("default"), "default");
  auto d = parse_args({"fsdp-train", "--malloc", "default"});
  ASSERT_TRUE(d.config.has_value()) << d.message;
  EXPECT_EQ(d.config->malloc_policy, "default");
  EXPECT_NE(d.config->to_json().find("\"malloc\": \"default\""), std::string::npos);
  auto bad_malloc = parse_args({"fsdp-train", "--malloc", "jemalloc"});
  EXPECT_FALSE(bad_malloc.config.has_value());
  EXPECT_NE(bad_malloc.message.find("--malloc"), std::string::npos) << bad_malloc.message;
}

TEST(TrainConfig, HelpListsEveryFlagWithDefault) {
  auto r = parse_args({"fsdp-train", "--help"});
  EXPECT_FALSE(r.config.has_value());
  EXPECT_EQ(r.exit_code, 0);
  for (const char* flag : {"--nproc",      "--steps",
                           "--layers",     "--heads",
                           "--width",      "--seq",
                           "--batch",      "--lr",
                           "--warmup",     "--weight-decay",
                           "--seed",       "--data",
                           "--run-dir",    "--reshard-after-forward",
                           "--no-shard",   "--data-order",
                           "--quiet",      "--config",
                           "--save-every", "--resume",
                           "--init-from"})
    EXPECT_NE(r.message.find(flag), std::string::npos) << flag;
  EXPECT_NE(r.message.find("300"), std::string::npos) << r.message;  // --steps default
}

TEST(TrainConfig, UnknownFlagIsNamed) {
  auto r = parse_args({"fsdp-train", "--stpes", "3"});
  EXPECT_FALSE(r.config.has_value());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.message.find("--stpes"), std::string::npos) << r.message;
}

TEST(TrainConfig, JsonAndTomlFilesTakeTheSameKeys) {
  const auto json = write_file("c.json", R"({"steps": 11, "data_order": "sequential",
      "lr": 0.002, "quiet": true, "reshard-after-forward": false})");
  const auto toml = write_file("c.toml",
                               "steps = 11\ndata-order = \"sequential\"\nlr = 0.002\nquiet = true\n"
                               "reshard_after_forward = false\n");
  for (const auto& file : {json, toml}) {
    auto r = parse_args({"fsdp-train", "--config", file});
    ASSERT_TRUE(r.config.has_value()) << r.message;
    EXPECT_EQ(r.config->steps, 11) << file;
    EXPECT_EQ(r.config->data_order, "sequential") << file;
    EXPECT_DOUBLE_EQ(r.config->lr, 0.002) << file;
    EXPECT_TRUE(r.config->quiet) << file;
    EXPECT_FALSE(r.config->reshard_after_forward) << file;
    EXPECT_TRUE(r.config->was_set("steps")) << file;
  }
  // The command line wins over the file.
  auto r = parse_args({"fsdp-train", "--config", json, "--steps", "5"});
  ASSERT_TRUE(r.config.has_value()) << r.message;
  EXPECT_EQ(r.config->steps, 5);
}

TEST(TrainConfig, UnknownConfigKeyIsNamed) {
  const auto json = write_file("bad.json", R"({"steps": 3, "layerz": 2})");
  const auto toml = write_file("bad.toml", "steps = 3\nlayerz = 2\n");
  for (const auto& file : {json, toml}) {
    const auto msg = error_of([&] { parse_args({"fsdp-train", "--config", file}); });
    EXPECT_NE(msg.find("unknown key 'layerz'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
  }
}

TEST(TrainConfig, BadConfigFiles) {
  EXPECT_NE(error_of([] {
              parse_args({"fsdp-train", "--config", "/nonexistent/x.json"});
            }).find("cannot be opened"),
            std::string::npos);
  const auto yaml = write_file("c.yaml", "steps: 3\n");
  EXPECT_NE(error_of([&] {
              parse_args({"fsdp-train", "--config", yaml});
            }).find(".json or .toml"),
            std::string::npos);
  const auto broken = write_file("broken.json", "{\"steps\": ");
  EXPECT_NE(error_of([&] {
              parse_args({"fsdp-train", "--config", broken});
            }).find("not valid JSON"),
            std::string::npos);
  const auto typed = write_file("typed.json", R"({"steps": "many"})");
  EXPECT_NE(error_of([&] {
              parse_args({"fsdp-train", "--config", typed});
            }).find("'steps'"),
            std::string::npos);
  const auto nested = write_file("nested.toml", "[model]\nlayers = 2\n");
  EXPECT_NE(error_of([&] {
              parse_args({"fsdp-train", "--config", nested});
            }).find("'model'"),
            std::string::npos);
}

TEST(TrainConfig, ValidationNamesTheSetting) {
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{"--layers", "0"}, "--layers is 0"},
      {{"--steps", "-3"}, "--steps is -3"},
      {{"--batch", "0"}, "--batch is 0"},
      {{"--seq", "0"}, "--seq is 0"},
      {{"--width", "100", "--heads", "3"}, "--width 100 is not divisible by --heads 3"},
      {{"--lr", "0"}, "--lr is 0"},
      {{"--no-shard", "--nproc", "3"}, "--no-shard"},
      {{"--clip", "-1"}, "--clip is -1"},
      {{"--clip", "inf"}, "--clip is inf"},
      {{"--no-shard", "--activation-checkpointing"}, "--activation-checkpointing applies"},
      {{"--mixed-precision", "fp16"}, "LibTorch 1.13's CPU kernels lack"},
      {{"--mixed-precision", "fp16"}, "it would work on CUDA"},
      {{"--no-shard", "--mixed-precision", "bf16"}, "--mixed-precision bf16 is a policy"},
      {{"--hsdp", "0"}, "--hsdp is 0"},
      {{"--no-shard", "--hsdp", "2"}, "--hsdp 2 shards within replicas"},
      {{"--reshard-after-forward-world", "-1"}, "--reshard-after-forward-world is -1"},
      {{"--reshard-after-forward-world", "2", "--no-reshard-after-forward"},
       "drop one of the two flags"},
      {{"--optimizer", "adam"}, "--optimizer is 'adam'; expected fused"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args{"fsdp-train"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const auto msg = error_of([&] { parse_args(args); });
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.expect << " vs: " << msg;
  }
  TrainConfig c;
  c.batch = 5;
  const auto msg = error_of([&] { c.validate_world(2); });
  EXPECT_NE(msg.find("--batch 5 is not divisible by the 2 ranks"), std::string::npos) << msg;
  TrainConfig h;
  h.hsdp = 3;
  const auto hmsg = error_of([&] { h.validate_world(4); });
  EXPECT_NE(hmsg.find("--hsdp 3 does not divide the 4 ranks"), std::string::npos) << hmsg;
  h.hsdp = 2;
  EXPECT_NO_THROW(h.validate_world(4));
  TrainConfig k;
  k.reshard_after_forward_world = 2;
  k.batch = 6;
  const auto kmsg = error_of([&] { k.validate_world(3); });
  EXPECT_NE(kmsg.find("--reshard-after-forward-world 2 does not divide the 3 ranks of a shard "
                      "group"),
            std::string::npos)
      << kmsg;
  k.hsdp = 2;
  k.batch = 8;
  EXPECT_NO_THROW(k.validate_world(4));  // shard groups of 2
}

// CLI11 2.1 clamps what does not fit (strtoll): --steps 99999999999999999999 became 2^63-1 and the
// run started. Integer flags and config keys are refused by name instead; what fits still parses
// (CLI11's own bases included).
TEST(TrainConfig, IntegersThatDoNotFitAreRefused) {
  auto r = parse_args({"fsdp-train", "--steps", "99999999999999999999"});
  EXPECT_FALSE(r.config.has_value());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.message.find("--steps: 99999999999999999999 is out of range: the value must be at "
                           "most 9223372036854775807"),
            std::string::npos)
      << r.message;
  r = parse_args({"fsdp-train", "--warmup", "-99999999999999999999"});
  EXPECT_NE(r.message.find("--warmup: -99999999999999999999 is out of range"), std::string::npos)
      << r.message;
  r = parse_args({"fsdp-train", "--seed", "-1"});
  EXPECT_NE(r.message.find("--seed: -1 is negative"), std::string::npos) << r.message;
  r = parse_args({"fsdp-train", "--seed", "18446744073709551616"});
  EXPECT_NE(r.message.find("--seed: 18446744073709551616 is out of range"), std::string::npos)
      << r.message;
  r = parse_args({"fsdp-train", "--nproc", "99999999999999999999"});
  EXPECT_FALSE(r.config.has_value()) << "an int flag";
  const auto file = write_file("huge.toml", "steps = \"99999999999999999999\"\n");
  const auto msg = error_of([&] { parse_args({"fsdp-train", "--config", file}); });
  EXPECT_NE(msg.find("key 'steps' = '99999999999999999999' is invalid"), std::string::npos) << msg;
  EXPECT_NE(msg.find("is out of range"), std::string::npos) << msg;
  r = parse_args({"fsdp-train", "--steps", "9223372036854775807", "--seed", "18446744073709551615",
                  "--warmup", "0x10"});
  ASSERT_TRUE(r.config.has_value()) << r.message;
  EXPECT_EQ(r.config->steps, INT64_MAX);
  EXPECT_EQ(r.config->seed, UINT64_MAX);
  EXPECT_EQ(r.config->warmup, 16);
}

TEST(TrainConfig, JsonRoundTrip) {
  auto r = parse_args({"fsdp-train", "--steps", "9", "--prompt", "Hi \"there\""});
  ASSERT_TRUE(r.config.has_value());
  const auto file = write_file("round.json", r.config->to_json());
  auto again = parse_args({"fsdp-train", "--config", file});
  ASSERT_TRUE(again.config.has_value()) << again.message;
  EXPECT_EQ(again.config->steps, 9);
  EXPECT_EQ(again.config->prompt, "Hi \"there\"");
  EXPECT_EQ(again.config->to_json(), r.config->to_json());
}

TEST(Data, ShortCorpusAndMissingFile) {
  auto msg = error_of([] { Corpus::from_bytes(std::vector<uint8_t>(8, 'a'), 8, "tiny.txt"); });
  EXPECT_NE(msg.find("shorter than one sequence"), std::string::npos) << msg;
  EXPECT_NO_THROW(Corpus::from_bytes(std::vector<uint8_t>(9, 'a'), 8));
  msg = error_of([] { Corpus::load("/nonexistent/corpus.txt", 8); });
  EXPECT_NE(msg.find("'/nonexistent/corpus.txt' cannot be opened"), std::string::npos) << msg;
}

TEST(Data, BinTokensDirectoriesSpecialFilesAndVocab) {
  // A .bin file: little-endian uint16 tokens, memory-mapped.
  std::vector<uint16_t> tokens;
  for (int i = 0; i < 40; ++i) tokens.push_back(static_cast<uint16_t>(1000 + 37 * i));
  const auto bin = temp_path("tokens.bin");
  {
    std::ofstream out(bin, std::ios::binary);
    out.write(reinterpret_cast<const char*>(tokens.data()), 2 * tokens.size());
  }
  const auto c = Corpus::load(bin, 8, 3000);
  EXPECT_EQ(c.format(), TokenFormat::kUint16);
  ASSERT_EQ(c.size(), 40);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(c.token(i), tokens[i]) << i;
  DataStream s(c, DataOrder::kSequential, 1, 8, 2);
  std::vector<int64_t> x, y;
  s.fill(1, 0, 1, x, y);  // window 2: tokens 16..24
  EXPECT_EQ(x[0], tokens[16]);
  EXPECT_EQ(y[7], tokens[24]);
  auto msg = error_of([&] { Corpus::load(bin, 8, 256); });
  EXPECT_NE(msg.find("holds token 2443, outside --vocab 256"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--vocab 50257"), std::string::npos) << msg;
  const auto odd = write_file("odd.bin", "abc");
  msg = error_of([&] { Corpus::load(odd, 1); });
  EXPECT_NE(msg.find("not a whole number of uint16 tokens"), std::string::npos) << msg;
  // A directory and a FIFO get the documented messages.
  const std::string dir = ::testing::TempDir();
  msg = error_of([&] { Corpus::load(dir, 8); });
  EXPECT_NE(msg.find("' is a directory; --data takes one file"), std::string::npos) << msg;
  const auto fifo = temp_path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  msg = error_of([&] { Corpus::load(fifo, 8); });
  EXPECT_NE(msg.find("' is a FIFO; --data takes a regular file"), std::string::npos) << msg;
  msg = error_of([] { Corpus::load("/dev/null", 8); });
  EXPECT_NE(msg.find("is a character device"), std::string::npos) << msg;
}

// .u32: little-endian uint32 tokens (vocabularies above 65,536); .u16 as .bin.
TEST(Data, Uint32AndUint16TokenFiles) {
  std::vector<uint32_t> tokens;
  for (int i = 0; i < 30; ++i) tokens.push_back(70000u + 4099u * static_cast<uint32_t>(i));
  const auto u32 = temp_path("tokens.u32");
  {
    std::ofstream out(u32, std::ios::binary);
    out.write(reinterpret_cast<const char*>(tokens.data()), 4 * tokens.size());
  }
  const auto c = Corpus::load(u32, 8, 200000);
  EXPECT_EQ(c.format(), TokenFormat::kUint32);
  ASSERT_EQ(c.size(), 30);
  for (int i = 0; i < 30; ++i) EXPECT_EQ(c.token(i), tokens[i]) << i;
  EXPECT_EQ(c.slice(3, 20).token(0), tokens[3]);
  auto msg = error_of([&] { Corpus::load(u32, 8, 128256); });
  EXPECT_NE(msg.find("holds token 188871, outside --vocab 128256"), std::string::npos) << msg;
  const auto odd = write_file("odd.u32", "abcdef");
  msg = error_of([&] { Corpus::load(odd, 1, 256); });
  EXPECT_NE(msg.find("not a whole number of uint32 tokens"), std::string::npos) << msg;
  const auto u16 = write_file("t.u16", std::string("\x01\x00\x02\x01\x03\x00", 6));
  const auto d = Corpus::load(u16, 1, 300);
  EXPECT_EQ(d.format(), TokenFormat::kUint16);
  EXPECT_EQ(d.token(1), 258);
}

// The closing sample of token data: its prompt, and the text of ids.
TEST(TokenSample, PromptIdsAndTheirText) {
  auto cfg = parse_args({"fsdp-train", "--vocab", "600", "--prompt", "5, 17 3"}).config.value();
  const auto held = Corpus::from_tokens({9, 8, 7, 6, 5, 4, 3, 2, 1, 0}, 4);
  EXPECT_EQ(sample_prompt_tokens(cfg, held, held), (std::vector<int64_t>{5, 17, 3}));
  cfg = parse_args({"fsdp-train", "--vocab", "600", "--seq", "4"}).config.value();
  EXPECT_EQ(sample_prompt_tokens(cfg, held, held), (std::vector<int64_t>{9, 8, 7, 6}));
  cfg = parse_args({"fsdp-train", "--vocab", "600", "--prompt", "And God"}).config.value();
  auto msg = error_of([&] { sample_prompt_tokens(cfg, held, held); });
  EXPECT_NE(msg.find("the prompt is token ids below --vocab 600"), std::string::npos) << msg;
  // A byte-level BPE vocabulary (GPT-2's alphabet: U+0120 is the space byte, U+010A newline).
  const auto bpe = write_file("tokenizer.json", R"({"model": {"type": "BPE", "vocab":
      {"a": 0, "\u0120b": 1, "\u010a": 2, "\u00e2\u0122": 3, "\u00a8": 4}},
      "added_tokens": [{"id": 5, "content": "<|eos|>", "special": true}],
      "decoder": {"type": "ByteLevel"}})");
  const auto v = TokenizerVocab::load(bpe);
  EXPECT_EQ(v.decode({0, 1, 2, 5}), "a b\n<|eos|>");
  EXPECT_EQ(v.decode({3, 4}), "\xE2\x80\xA8") << "bytes across tokens make one character";
  EXPECT_EQ(v.decode({3}), "\xEF\xBF\xBD") << "an incomplete character is U+FFFD";
  EXPECT_EQ(v.decode({77}), "<77>");
  // SentencePiece with byte fallback (Llama 2's).
  const auto sp = write_file("sp.json", R"({"model": {"type": "BPE", "vocab":
      {"\u2581the": 0, "<0x0A>": 1, "cat": 2}}, "decoder": {"type": "Sequence", "decoders":
      [{"type": "Replace"}, {"type": "ByteFallback"}, {"type": "Fuse"}]}})");
  EXPECT_EQ(TokenizerVocab::load(sp).decode({0, 2, 1}), " thecat\n");
  EXPECT_EQ(utf8_lossy("a\xC3(b\xF0\x9F\x98"), "a\xEF\xBF\xBD(b\xEF\xBF\xBD");
  EXPECT_EQ(one_line("a\nb\tc\x01"), "a\\nb\\tc?");
}

// --init-from a model directory: its config.json's sizes; a flag given with another value is an
// error naming both; the Llama's own flags are checked.
TEST(TrainConfig, LlamaSettingsFromFlagsAndFromConfigJson) {
  const std::string hf = R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300,
      "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
      "num_attention_heads": 8, "num_key_value_heads": 2, "rope_theta": 500000.0,
      "tie_word_embeddings": true})";
  auto cfg = parse_args({"fsdp-train", "--init-from", "m", "--steps", "5"}).config.value();
  take_model_from_config(cfg, hf, "m/config.json");
  EXPECT_EQ(cfg.model, "llama");
  EXPECT_EQ(cfg.layers, 3);
  EXPECT_EQ(cfg.width, 64);
  EXPECT_EQ(cfg.vocab, 300);
  EXPECT_EQ(cfg.llama.kv_heads, 2);
  EXPECT_EQ(cfg.llama.ffn, 96);
  EXPECT_TRUE(cfg.llama.tie_embeddings);
  const auto m = llama_config_of(cfg);
  EXPECT_EQ(m.rope_theta, 500000.0);
  EXPECT_EQ(nlohmann::json::parse(cfg.to_json())["model"], "llama");
  cfg = parse_args({"fsdp-train", "--init-from", "m", "--layers", "2"}).config.value();
  auto msg = error_of([&] { take_model_from_config(cfg, hf, "m/config.json"); });
  EXPECT_NE(msg.find("--layers 2 differs from m/config.json's num_hidden_layers 3"),
            std::string::npos)
      << msg;
  cfg = parse_args({"fsdp-train", "--init-from", "m", "--model", "gpt"}).config.value();
  msg = error_of([&] { take_model_from_config(cfg, hf, "m/config.json"); });
  EXPECT_NE(msg.find("--model gpt with --init-from m"), std::string::npos) << msg;
  msg = error_of([&] {
    parse_args({"fsdp-train", "--model", "llama", "--heads", "4", "--kv-heads", "3"});
  });
  EXPECT_NE(msg.find("--heads 4 is not a multiple of --kv-heads 3"), std::string::npos) << msg;
  // From the flags: the GPT's sizes and the Llama's own.
  cfg = parse_args({"fsdp-train", "--model", "llama", "--kv-heads", "2", "--tie-embeddings"})
            .config.value();
  const auto f = llama_config_of(cfg);
  EXPECT_EQ(f.kv_heads(), 2);
  EXPECT_EQ(f.ffn(), 384);  // 8 x 128 / 3 = 341.3, rounded up to 64
  EXPECT_EQ(parameter_count(cfg), static_cast<double>(f.parameter_count()));
}

TEST(Data, ValidationSplitIsTheEnd) {
  std::vector<uint8_t> bytes(1000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i % 251);
  const auto c = Corpus::from_bytes(bytes, 16);
  const auto [train, val] = split_validation(c, 0.1, 16);
  EXPECT_EQ(train.size(), 900);
  EXPECT_EQ(val.size(), 100);
  EXPECT_EQ(val.token(0), 900 % 251);
  EXPECT_EQ(split_validation(c, 0, 16).second.size(), 0);
  auto msg = error_of([&] { split_validation(c, 0.01, 16); });
  EXPECT_NE(msg.find("--val-fraction 0.01 of the 1000 tokens"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fewer than one sequence"), std::string::npos) << msg;
}

TEST(Data, SequentialOffsetsAreDocumented) {
  std::vector<uint8_t> bytes(101);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i);
  auto corpus = Corpus::from_bytes(bytes, 10);
  DataStream s(corpus, DataOrder::kSequential, 1, 10, 4);
  EXPECT_EQ(s.windows(), 10);  // (101 - 1) / 10
  // Row j of the stream = step * batch + row; window j mod 10 at byte (j mod 10) * 10.
  EXPECT_EQ(s.offset(0, 0), 0);
  EXPECT_EQ(s.offset(0, 3), 30);
  EXPECT_EQ(s.offset(2, 1), 90);
  EXPECT_EQ(s.offset(2, 2), 0);  // wraps
  std::vector<int64_t> x, y;
  s.fill(1, 2, 4, x, y);  // rows 2..3 of step 1: windows 6 and 7
  ASSERT_EQ(x.size(), 20u);
  EXPECT_EQ(x[0], 60);
  EXPECT_EQ(y[0], 61);
  EXPECT_EQ(x[10], 70);
  EXPECT_EQ(y[19], 80);
}

TEST(Data, RandomOffsetsAreAFunctionOfSeedStepRow) {
  auto corpus = Corpus::from_bytes(std::vector<uint8_t>(1000, 'x'), 16);
  DataStream a(corpus, DataOrder::kRandom, 7, 16, 8);
  DataStream b(corpus, DataOrder::kRandom, 7, 16, 8);
  DataStream c(corpus, DataOrder::kRandom, 8, 16, 8);
  std::set<int64_t> seen;
  int differ = 0;
  for (int64_t step = 0; step < 10; ++step)
    for (int64_t row = 0; row < 8; ++row) {
      const int64_t o = a.offset(step, row);
      EXPECT_EQ(o, b.offset(step, row));
      EXPECT_GE(o, 0);
      EXPECT_LE(o, 1000 - 16 - 1);
      differ += o != c.offset(step, row);
      seen.insert(o);
    }
  EXPECT_GT(differ, 70);
  EXPECT_GT(seen.size(), 70u);
  // The documented formula: offset = mix64(seed ^ mix64(step * batch + row)) mod (N - T).
  EXPECT_EQ(a.offset(3, 5), static_cast<int64_t>(mix64(7 ^ mix64(3 * 8 + 5)) % (1000 - 16)));
  // splitmix64 reference value: the first output of a generator seeded with 0.
  EXPECT_EQ(mix64(0), 0xE220A8397B1DCDAFull);
}

TEST(Schedule, WarmupThenCosine) {
  LrSchedule s{1.0, 10, 110, 0.1};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(10 + 99 / 2.0), 0.55, 0.01);
  EXPECT_DOUBLE_EQ(s.at(109), 0.1);
  for (int64_t i = 10; i < 109; ++i) EXPECT_GE(s.at(i), s.at(i + 1));
  LrSchedule no_warmup{2.0, 0, 1, 0.5};
  EXPECT_DOUBLE_EQ(no_warmup.at(0), 2.0);
}

TEST(Schedule, ExtendingContinuesWithoutAJump) {
  const LrSchedule s{1.0, 10, 110, 0.1};
  // Resumed at step 60 with twice the steps: the rate at 60 is unchanged, then a cosine to the
  // floor at the new last step.
  const LrSchedule e = s.extended(60, 220, 0.1);
  EXPECT_DOUBLE_EQ(e.at(60), s.at(60));
  EXPECT_DOUBLE_EQ(e.at(219), 0.1);
  for (int64_t i = 60; i < 219; ++i) EXPECT_GE(e.at(i), e.at(i + 1)) << i;
  EXPECT_GT(e.at(100), s.at(100));  // decays more slowly than the original would have
  // Resuming a finished run: it continues at the floor it had reached.
  const LrSchedule done = s.extended(110, 150, 0.1);
  EXPECT_DOUBLE_EQ(done.at(110), 0.1);
  EXPECT_DOUBLE_EQ(done.at(149), 0.1);
  // A new floor ratio: from the reached rate to the new floor.
  const LrSchedule lower = s.extended(60, 110, 0.01);
  EXPECT_DOUBLE_EQ(lower.at(60), s.at(60));
  EXPECT_DOUBLE_EQ(lower.at(109), 0.01);
  // In warmup, or nothing changed: the plain schedule.
  EXPECT_EQ(s.extended(5, 220, 0.1).restart_step, -1);
  EXPECT_EQ(s.extended(60, 110, 0.1).restart_step, -1);
  // Extending twice chains: the second segment starts at the first one's rate.
  const LrSchedule twice = e.extended(150, 300, 0.1);
  EXPECT_DOUBLE_EQ(twice.at(150), e.at(150));
}

TEST(Schedule, LastStepUsesTheFloorOnlyAfterWarmupPlusOne) {
  EXPECT_DOUBLE_EQ((LrSchedule{1.0, 10, 12, 0.1}.at(11)), 0.1);  // S = W + 2
  EXPECT_DOUBLE_EQ((LrSchedule{1.0, 10, 11, 0.1}.at(10)), 1.0);  // S = W + 1: the peak
  EXPECT_DOUBLE_EQ((LrSchedule{1.0, 10, 5, 0.1}.at(4)), 0.5);    // S <= W: still warming up
}

TEST(Metrics, WriteReadAppendWithValidationAndJsonl) {
  const auto path = temp_path("metrics.csv");
  temp_files().push_back(jsonl_path(path));
  {
    MetricsWriter w(path, false);
    for (int64_t s = 1; s <= 5; ++s) {
      MetricsRow r{s, 5.0 - s * 0.5, 1e-3, 1000, 0.1, 300};
      if (s % 2 == 0) r.val_loss = 4.0 - s * 0.1;
      r.mfu = 0.125;
      if (s == 2) r.grad_norm = 0.75;
      w.write(r);
    }
  }
  auto rows = read_metrics(path);
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_EQ(rows[4].step, 5);
  EXPECT_DOUBLE_EQ(rows[4].loss, 2.5);
  EXPECT_TRUE(std::isnan(rows[0].val_loss));
  EXPECT_DOUBLE_EQ(rows[1].val_loss, 3.8);
  EXPECT_DOUBLE_EQ(rows[1].mfu, 0.125);
  EXPECT_DOUBLE_EQ(rows[1].grad_norm, 0.75);
  EXPECT_TRUE(std::isnan(rows[0].grad_norm));
  {
    MetricsWriter w(path, true, 3);  // resumed from the checkpoint at step 3
    w.write({4, 1.25, 1e-3, 1000, 0.1, 300});
  }
  rows = read_metrics(path);
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_DOUBLE_EQ(rows[3].loss, 1.25);
  // The JSONL stream holds the same rows, val_loss only where evaluated.
  std::ifstream in(jsonl_path(path));
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[3]["step"], 4);
  EXPECT_DOUBLE_EQ(lines[1]["val_loss"].get<double>(), 3.8);
  EXPECT_FALSE(lines[2].contains("val_loss"));
  EXPECT_GT(peak_rss_mb(), 1.0);
  // Files of the earlier format (six columns) are still read.
  const auto old =
      write_file("old.csv", std::string(kMetricsHeaderV1) + "\n1,5.5,0.001,10,0.1,20\n");
  rows = read_metrics(old);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_TRUE(std::isnan(rows[0].val_loss));
  // And of the eight-column format (before grad_norm).
  const auto v2 =
      write_file("v2.csv", std::string(kMetricsHeaderV2) + "\n1,5.5,0.001,10,0.1,20,4.5,0.25\n");
  rows = read_metrics(v2);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_DOUBLE_EQ(rows[0].mfu, 0.25);
  EXPECT_TRUE(std::isnan(rows[0].grad_norm));
  const auto bad = write_file("bad.csv", std::string(kMetricsHeader) + "\n1,,0.1,1,1,1,,\n");
  EXPECT_NE(error_of([&] { read_metrics(bad); }).find("line 2"), std::string::npos);
}

TEST(Plot, CentredMeanDoesNotLag) {
  // On a straight line a centred mean equals the line (an EMA would trail it).
  std::vector<double> line;
  for (int i = 0; i < 100; ++i) line.push_back(10.0 - 0.05 * i);
  const auto m = centred_mean(line, 5);
  for (int i = 0; i < 100; ++i) EXPECT_NEAR(m[i], line[i], 1e-9) << i;
  const auto flat = centred_mean({1, 3, 5, 7}, 1);  // ends shrink the window: [1], [1 3 5], ...
  EXPECT_EQ(flat, (std::vector<double>{1, 3, 5, 7}));
  EXPECT_EQ(centred_mean({0, 3, 0, 3, 0}, 1), (std::vector<double>{0, 1, 2, 1, 0}));
}

TEST(Plot, SvgHasCurvesLegendAndSecondAxis) {
  PlotSeries series;
  for (int64_t s = 1; s <= 50; ++s) {
    series.loss.emplace_back(s, 5.5 * std::exp(-s / 20.0) + 1.0);
    series.lr.emplace_back(s, 1e-3);
    if (s % 10 == 0) series.val_loss.emplace_back(s, 5.6 * std::exp(-s / 20.0) + 1.1);
  }
  series.loss.emplace_back(51, std::nan(""));
  const auto svg = loss_curve_svg(series, {"loss & <curve>", "2 ranks"});
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("loss &amp; &lt;curve&gt;"), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  for (const char* label : {"training loss", "centred mean of 3 steps", "validation loss",
                            "learning rate (right axis)"})
    EXPECT_NE(svg.find(label), std::string::npos) << label;
  EXPECT_NE(svg.find("#d62728"), std::string::npos);     // the validation curve
  EXPECT_NE(svg.find("rotate(90)"), std::string::npos);  // the right axis title
  const auto path = temp_path("loss.svg");
  fsdp::write_text_atomic(path, svg);
  std::ifstream in(path);
  EXPECT_TRUE(in.good());
  EXPECT_NE(loss_curve_svg({}).find("no finite losses"), std::string::npos);
}

TEST(Generate, DeterministicAndFollowsTheLogits) {
  // A "model" that always puts all mass on the byte after the last one.
  std::vector<size_t> context_sizes;
  auto next = [&](const std::vector<int64_t>& ctx) {
    context_sizes.push_back(ctx.size());
    std::vector<float> logits(256, -1e4f);
    logits[static_cast<size_t>((ctx.back() + 1) % 256)] = 0;
    return logits;
  };
  SampleOptions o;
  o.tokens = 5;
  o.context = 3;
  EXPECT_EQ(generate_text("ab", o, next), "cdefg");
  EXPECT_EQ(context_sizes, (std::vector<size_t>{2, 3, 3, 3, 3}));
  // Uniform logits: the same seed gives the same text, another seed another text.
  auto uniform = [](const std::vector<int64_t>&) { return std::vector<float>(256, 0.f); };
  o.tokens = 32;
  o.seed = 1;
  const auto a = generate_text("", o, uniform);
  EXPECT_EQ(a, generate_text("", o, uniform));
  o.seed = 2;
  EXPECT_NE(a, generate_text("", o, uniform));
  EXPECT_EQ(printable(std::string("a\x01\n\xff", 4)), "a?\n?");
}

// ---- resume: fake checkpoints with valid indexes (one rank file of 8 bytes) ----

std::string temp_dir(const std::string& name) {
  const std::string d = temp_path(name);
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

void fake_checkpoint(const std::string& run_dir, int64_t step, const TrainConfig& cfg,
                     const LrSchedule& schedule) {
  char name[32];
  std::snprintf(name, sizeof name, "/step_%08lld", static_cast<long long>(step));
  const std::string d = run_dir + name;
  std::filesystem::create_directories(d);
  // A real (empty) safetensors file with its checksums: --resume auto reads it against them.
  checkpoint::Index idx;
  idx.world_size = 1;
  checkpoint::FileEntry f;
  f.name = "rank0.safetensors";
  f.sums = safetensors::write(d + "/rank0.safetensors", {}, {{"format", "pt"}});
  idx.files.push_back(f);
  idx.state.step = step;
  idx.state.data_position = step;
  idx.state.extra = checkpoint_extra(cfg, schedule);
  std::ofstream(d + "/index.json") << checkpoint::index_to_json(idx);
}

TrainConfig parsed(const std::vector<std::string>& args) {
  std::vector<std::string> argv{"fsdp-train"};
  argv.insert(argv.end(), args.begin(), args.end());
  return *parse_args(argv).config;
}

// Cleans up after itself (the temp_files list only removes files).
struct TempDirs {
  ~TempDirs() {
    for (const auto& d : dirs) std::filesystem::remove_all(d);
  }
  std::string make(const std::string& name) { return dirs.emplace_back(temp_dir(name)); }
  std::vector<std::string> dirs;
};

TEST(Resume, TakesTheSettingsFromTheCheckpointAndExtendsTheSchedule) {
  TempDirs tmp;
  const auto run = tmp.make("run_settings");
  const TrainConfig original = parsed({"--layers", "3", "--width", "48", "--heads", "3", "--steps",
                                       "30", "--warmup", "5", "--lr", "0.01", "--run-dir", run});
  fake_checkpoint(run, 30, original, {});
  // Only --steps given: everything else from the checkpoint.
  RunPlan plan = plan_run(parsed({"--resume", run, "--steps", "60"}));
  ASSERT_TRUE(plan.from.has_value());
  EXPECT_EQ(plan.from->step, 30);
  EXPECT_EQ(plan.cfg.layers, 3);
  EXPECT_EQ(plan.cfg.width, 48);
  EXPECT_EQ(plan.cfg.steps, 60);
  EXPECT_EQ(plan.cfg.run_dir, run);
  const LrSchedule before{0.01, 5, 30, 0.1};
  EXPECT_DOUBLE_EQ(plan.schedule.at(30), before.at(30));  // no jump
  EXPECT_DOUBLE_EQ(plan.schedule.at(59), 0.001);
  // The same value of a fixed setting is fine; another one is an error naming it.
  EXPECT_NO_THROW(plan_run(parsed({"--resume", run, "--layers", "3"})));
  const auto msg = error_of([&] {
    plan_run(parsed({"--resume", run, "--layers", "4", "--lr", "0.02", "--steps", "40"}));
  });
  EXPECT_NE(msg.find("--layers 4 (the checkpoint has 3)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--lr 0.02 (the checkpoint has 0.01)"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("--steps"), msg.find("--steps, --min-lr-ratio")) << msg;  // steps allowed
  // A checkpoint written by an extended run keeps its segment when resumed again.
  const auto run2 = tmp.make("run_chain");
  TrainConfig extended = plan.cfg;
  extended.run_dir = run2;
  fake_checkpoint(run2, 45, extended, plan.schedule);
  const RunPlan again = plan_run(parsed({"--resume", run2}));
  EXPECT_EQ(again.schedule.restart_step, 30);
  EXPECT_DOUBLE_EQ(again.schedule.at(50), plan.schedule.at(50));
}

TEST(Resume, DamagedLatestIsReportedThenFallsBackButANamedOneNever) {
  TempDirs tmp;
  const auto run = tmp.make("run_damaged");
  const TrainConfig cfg = parsed({"--run-dir", run});
  fake_checkpoint(run, 2, cfg, {});
  fake_checkpoint(run, 4, cfg, {});
  fake_checkpoint(run, 6, cfg, {});
  std::ofstream(run + "/step_00000006/index.json") << "{\"format\": ";  // truncated
  std::filesystem::create_directories(run + "/step_00000008");          // a save that died
  std::filesystem::resize_file(run + "/step_00000004/rank0.safetensors", 3);
  const RunPlan plan = plan_run(parsed({"--resume", run}));
  ASSERT_TRUE(plan.from.has_value());
  EXPECT_EQ(plan.from->checkpoint, run + "/step_00000002");
  ASSERT_EQ(plan.from->skipped.size(), 3u);
  EXPECT_NE(plan.from->skipped[0].find("step_00000008 is damaged: incomplete: no index.json"),
            std::string::npos)
      << plan.from->skipped[0];
  EXPECT_NE(plan.from->skipped[1].find("step_00000006 is damaged: checkpoint index"),
            std::string::npos)
      << plan.from->skipped[1];
  EXPECT_NE(plan.from->skipped[2].find("rank0.safetensors has 3 bytes, the index says "),
            std::string::npos)
      << plan.from->skipped[2];
  // Named explicitly: an error, no fallback.
  const auto msg = error_of([&] { plan_run(parsed({"--resume", run + "/step_00000006"})); });
  EXPECT_NE(msg.find("checkpoint '" + run + "/step_00000006' is damaged"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("there is no fallback"), std::string::npos) << msg;
  EXPECT_EQ(plan_run(parsed({"--resume", run + "/step_00000002/"})).from->checkpoint,
            run + "/step_00000002");
  // Nothing complete at all: the message lists what was skipped.
  std::filesystem::remove_all(run + "/step_00000002");
  const auto none = error_of([&] { plan_run(parsed({"--resume", run})); });
  EXPECT_NE(none.find("holds no complete checkpoint"), std::string::npos) << none;
  EXPECT_NE(none.find("step_00000006 is damaged"), std::string::npos) << none;
}

TEST(Resume, AutoStartsWhenEmptyAndResumesOtherwise) {
  TempDirs tmp;
  const auto run = tmp.make("run_auto");
  RunPlan plan = plan_run(parsed({"--resume", "auto", "--run-dir", run, "--steps", "9"}));
  EXPECT_FALSE(plan.from.has_value());
  EXPECT_EQ(plan.cfg.steps, 9);
  fake_checkpoint(run, 4, parsed({"--run-dir", run, "--steps", "9"}), {});
  plan = plan_run(parsed({"--resume", "auto", "--run-dir", run}));
  ASSERT_TRUE(plan.from.has_value());
  EXPECT_EQ(plan.from->step, 4);
  EXPECT_EQ(plan.cfg.steps, 9);
  EXPECT_NE(error_of([] {
              parsed({"--resume", "auto"});
            }).find("give --run-dir DIR"),
            std::string::npos);
  // A newer checkpoint damaged inside (same size, one byte changed): auto reads the checksums and
  // passes over it, naming it; RUN_DIR takes it (the load would then stop, saying so).
  fake_checkpoint(run, 6, parsed({"--run-dir", run, "--steps", "9"}), {});
  {
    std::fstream f(run + "/step_00000006/rank0.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(9);
    f.put('X');
  }
  plan = plan_run(parsed({"--resume", "auto", "--run-dir", run}));
  ASSERT_TRUE(plan.from.has_value());
  EXPECT_EQ(plan.from->step, 4);
  ASSERT_EQ(plan.from->skipped.size(), 1u);
  EXPECT_NE(plan.from->skipped[0].find("step_00000006 is damaged: "), std::string::npos)
      << plan.from->skipped[0];
  EXPECT_EQ(plan_run(parsed({"--resume", run})).from->step, 6);
  // An index that names another step than its directory: refused by name, passed over.
  fake_checkpoint(run, 8, parsed({"--run-dir", run, "--steps", "9"}), {});
  std::filesystem::rename(run + "/step_00000008", run + "/step_00000007");
  const RunPlan renamed = plan_run(parsed({"--resume", run}));
  EXPECT_EQ(renamed.from->step, 6);
  ASSERT_FALSE(renamed.from->skipped.empty());
  EXPECT_NE(renamed.from->skipped[0].find("index.json says step 8, but the directory is named "
                                          "for step 7"),
            std::string::npos)
      << renamed.from->skipped[0];
}

TEST(Resume, KeepLastRemovesOlderCheckpoints) {
  TempDirs tmp;
  const auto run = tmp.make("run_keep");
  const TrainConfig cfg = parsed({"--run-dir", run});
  for (int64_t s : {0, 2, 4, 6, 8}) fake_checkpoint(run, s, cfg, {});
  std::filesystem::create_directories(run + "/step_00000010");  // incomplete, newest: kept
  std::filesystem::remove(run + "/step_00000002/index.json");   // incomplete, old: removed
  const auto removed = remove_old_checkpoints(run, 2);
  EXPECT_EQ(removed, (std::vector<std::string>{run + "/step_00000004", run + "/step_00000002",
                                               run + "/step_00000000"}));
  EXPECT_EQ(step_dirs(run),
            (std::vector<std::string>{run + "/step_00000010", run + "/step_00000008",
                                      run + "/step_00000006"}));
  EXPECT_TRUE(remove_old_checkpoints(run, 0).empty());
}

TEST(Bounds, RefusesARunThatCannotFitNamingTheSetting) {
  TrainConfig c;
  // The documented count: 12 L C^2 + 13 L C + (V + T) C + 2 C.
  EXPECT_DOUBLE_EQ(parameter_count(c), 12.0 * 4 * 128 * 128 + 13.0 * 4 * 128 + 320.0 * 128 + 256);
  EXPECT_DOUBLE_EQ(flops_per_token(c), 6 * (parameter_count(c) - 64.0 * 128) + 12.0 * 4 * 128 * 64);
  EXPECT_NO_THROW(check_memory_bounds(c, 2, 2, 4.0 * (1 << 30)));
  c.layers = 100000000;
  auto msg = error_of([&] { check_memory_bounds(c, 2, 2, 20.0 * (1 << 30)); });
  EXPECT_NE(msg.find("--layers 100000000"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lower --layers or --width"), std::string::npos) << msg;
  EXPECT_NE(msg.find("MemAvailable"), std::string::npos) << msg;
  c = TrainConfig{};
  c.batch = 1000000000;
  msg = error_of([&] { check_memory_bounds(c, 2, 2, 20.0 * (1 << 30)); });
  EXPECT_NE(msg.find("lower --batch or --seq, or raise --grad-accum"), std::string::npos) << msg;
  EXPECT_GT(mem_available_bytes(), 1e8);
}

}  // namespace
}  // namespace fsdp::train
