// Unit tests of fsdp-train's torch-free parts: settings (flags, JSON/TOML files, validation), the
// data order, the learning-rate schedule, metrics CSV and the SVG plot.
#include <fsdp/error.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "train/config.h"
#include "train/data.h"
#include "train/generate.h"
#include "train/metrics.h"
#include "train/plot.h"
#include "train/schedule.h"

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
  EXPECT_TRUE(r.config->was_set("steps"));
  EXPECT_FALSE(r.config->was_set("batch"));
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

TEST(Metrics, WriteReadAppend) {
  const auto path = temp_path("metrics.csv");
  {
    MetricsWriter w(path, false);
    for (int64_t s = 1; s <= 5; ++s) w.write({s, 5.0 - s * 0.5, 1e-3, 1000, 0.1, 300});
  }
  auto rows = read_metrics(path);
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_EQ(rows[4].step, 5);
  EXPECT_DOUBLE_EQ(rows[4].loss, 2.5);
  {
    MetricsWriter w(path, true, 3);  // resumed from the checkpoint at step 3
    w.write({4, 1.25, 1e-3, 1000, 0.1, 300});
  }
  rows = read_metrics(path);
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_DOUBLE_EQ(rows[3].loss, 1.25);
  EXPECT_GT(peak_rss_mb(), 1.0);
}

TEST(Plot, SvgHasTheCurve) {
  std::vector<std::pair<int64_t, double>> pts;
  for (int64_t s = 1; s <= 50; ++s) pts.emplace_back(s, 5.5 * std::exp(-s / 20.0) + 1.0);
  pts.emplace_back(51, std::nan(""));
  const auto svg = loss_curve_svg(pts, {"loss & <curve>", "2 ranks"});
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("<polyline"), std::string::npos);
  EXPECT_NE(svg.find("loss &amp; &lt;curve&gt;"), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  const auto path = temp_path("loss.svg");
  write_text_file_atomic(path, svg);
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

}  // namespace
}  // namespace fsdp::train
