// fsdp-train against PyTorch's own FSDP2 (bench/fsdp2_peer.py, torch 2.15, Gloo): the same GPT,
// initial weights, batches, AdamW and schedule, written independently (issue 29, items 3 and 5).
//
// - Fp32 / Bf16: fsdp-train (its own launcher, fsdp-run) and the peer (torchrun) at N = 2 and 4,
//   30 steps from one consolidated init file; per-step losses agree within 1e-5 relative (fp32),
//   or within the bf16 bounds below (docs/fsdp2_peer.md says how they were measured).
// - PyTorchLoadsOurCheckpoint...: a consolidated checkpoint after 15 steps, read by `safetensors`
//   into the peer's GPT, gives the validation loss fsdp-train logged for that step within 1e-6.
//
// The peer needs FSDP_PEER_PYTHON (tests/fsdp2_peer.cmake) with torch 2.15 and safetensors
// (scripts/torch_pip.sh installs both); without them the tests fail, saying so.
#include <fsdp/checkpoint.h>
#include <gtest/gtest.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness.h"
#include "train/metrics.h"

namespace fsdp::train {
namespace {

using fsdp::testing::ProcResult;
namespace fs = std::filesystem;

constexpr int kSteps = 30;
constexpr int kEvalEvery = 15;  // also the checkpoint of the load test
// bf16 (docs/fsdp2_peer.md). The peer runs with --adamw libtorch (torch::optim::AdamW's order of
// operations; PyTorch's AdamW uses lerp_, whose last-bit differences in the fp32 weights bf16 casts
// and AdamW amplify to a few 1e-4 in 30 steps). Then N = 2 agrees to the CSV's 9 digits at every
// step (measured 1.5e-9). At N = 4 Gloo sums the four bf16 gradients in bf16 with intermediate
// roundings where fsdp-cpp sums them in fp32 and rounds once (30% of step 1's gradient elements
// round differently), and the losses drift from step 2: measured max 4.2e-4 over 30 steps; the
// bound leaves about 5x room (bf16 against fp32 differs by 4e-4 to 8e-4, so at N = 4 only step 1
// tells the policies apart: measured 2.4e-10, fp32's step 1 differs from bf16's by 1.3e-5).
constexpr double kBf16SameOrderRel = 1e-7;
constexpr double kBf16Rel = 2e-3;
// fsdp-train built against another LibTorch than the peer's torch 2.15 (Debian's 1.13): its bf16
// CPU kernels round differently, and how differently depends on the CPU they dispatch for. Step 1
// is no longer the same bits: measured 5.1e-7 / 6.4e-7 at N = 2 / 4 on one machine, 3.0e-6 /
// 3.1e-6 on an AVX2-only one, still 2x below fp32-against-bf16's 1.3e-5, so step 1 still tells
// the policies apart. The steps drift: max 6.8e-4 / 8.6e-4 over 30 steps there, 5.6e-3 / 5.5e-3
// on the AVX2 machine (a bf16 ulp is 3.9e-3).
constexpr double kBf16OtherKernelsFirstRel = 6e-6;
constexpr double kBf16OtherKernelsRel = 1.5e-2;
constexpr bool kSameKernelsAsPeer = TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 15;

const std::string& scratch() {
  static const std::string d = [] {
    std::string p = ::testing::TempDir() + "fsdp2_peer_" + std::to_string(::getpid());
    fs::remove_all(p);
    fs::create_directories(p);
    return p;
  }();
  return d;
}

class RemoveScratch : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(scratch(), ec);
  }
};
const auto* const kRemoveScratch = ::testing::AddGlobalTestEnvironment(new RemoveScratch);

std::string data_file() { return std::string(FSDP_SOURCE_DIR) + "/data/corpus.txt"; }

// The settings both programs get: a small model with a non-last (resharded) block.
std::vector<std::string> shared_flags() {
  return {"--layers",       "2",  "--heads", "2",        "--width",      "32",
          "--seq",          "16", "--batch", "8",        "--steps",      std::to_string(kSteps),
          "--warmup",       "5",  "--lr",    "1e-2",     "--eval-every", std::to_string(kEvalEvery),
          "--eval-batches", "2",  "--data",  data_file()};
}

ProcResult run(const std::vector<std::string>& argv) {
  return fsdp::testing::run_process(argv, std::chrono::seconds(120));
}

// FSDP_PEER_PYTHON imports torch 2.15 and safetensors; checked once (a few seconds).
const std::string& peer_python_problem() {
  static const std::string problem = [] {
    const std::string py = FSDP_PEER_PYTHON;
    if (!fs::exists(py))
      return "FSDP_PEER_PYTHON " + py +
             " does not exist; run scripts/torch_pip.sh (it installs torch 2.15 and safetensors "
             "there) or configure with -DFSDP_PEER_PYTHON=<python with torch 2.15>";
    const auto r = run({py, "-c",
                        "import sys, torch, safetensors; "
                        "sys.exit(not torch.__version__.startswith('2.15'))"});
    if (r.exit_code != 0)
      return "FSDP_PEER_PYTHON " + py +
             " lacks torch 2.15 or safetensors; run scripts/torch_pip.sh. Output:\n" + r.output;
    return std::string();
  }();
  return problem;
}

#define REQUIRE_PEER_PYTHON() ASSERT_EQ(peer_python_problem(), "") << "the PyTorch peer cannot run"

// One consolidated init file for every run: fsdp-train's step-0 checkpoint (one rank: the quickest
// start) under another seed than the runs' (1337), so the losses match only if both programs
// really load it.
const std::string& init_file() {
  static const std::string file = [] {
    const std::string dir = scratch() + "/init_run", out = scratch() + "/init.safetensors";
    auto argv = std::vector<std::string>{fsdp::testing::bin_dir() + "/fsdp-train"};
    for (const auto& f : shared_flags()) argv.push_back(f);
    argv.insert(argv.end(),
                {"--steps", "1", "--save-every", "1", "--seed", "7", "--nproc", "1", "--eval-every",
                 "0", "--sample-tokens", "0", "--peak-tflops", "1", "--quiet", "--run-dir", dir});
    const auto r = run(argv);
    if (r.exit_code != 0) return "fsdp-train failed making the init file:\n" + r.output;
    checkpoint::consolidate(dir + "/step_00000000", out);
    return out;
  }();
  return file;
}

struct Losses {
  std::vector<double> loss;
  std::map<int, double> val_loss;  // by step
  std::string error;               // non-empty: the run failed, with its output
  double seconds = 0;
};

// fsdp-train at N local ranks (fsdp-run), from the init file.
Losses train(int n, const std::string& precision, const std::string& dir,
             const std::vector<std::string>& extra = {}) {
  auto argv = std::vector<std::string>{fsdp::testing::bin_dir() + "/fsdp-train"};
  for (const auto& f : shared_flags()) argv.push_back(f);
  argv.insert(argv.end(), {"--nproc", std::to_string(n), "--mixed-precision", precision,
                           "--init-from", init_file(), "--sample-tokens", "0", "--peak-tflops", "1",
                           "--quiet", "--run-dir", dir});
  argv.insert(argv.end(), extra.begin(), extra.end());
  const auto r = run(argv);
  Losses out;
  out.seconds = r.seconds;
  if (r.exit_code != 0) {
    out.error = r.output;
    return out;
  }
  for (const auto& row : read_metrics(dir + "/metrics.csv")) {
    out.loss.push_back(row.loss);
    if (!std::isnan(row.val_loss)) out.val_loss[static_cast<int>(row.step)] = row.val_loss;
  }
  return out;
}

// The peer under torchrun at N ranks; `flags` come after the shared ones (argparse: last wins).
Losses peer(int n, const std::vector<std::string>& flags) {
  const std::string json = scratch() + "/peer_" + std::to_string(n) + ".json";
  std::vector<std::string> argv = {FSDP_PEER_PYTHON,
                                   "-m",
                                   "torch.distributed.run",
                                   "--standalone",
                                   "--nproc_per_node",
                                   std::to_string(n),
                                   std::string(FSDP_SOURCE_DIR) + "/bench/fsdp2_peer.py"};
  for (const auto& f : shared_flags()) argv.push_back(f);
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), {"--json", json});
  fs::remove(json);
  const auto r = run(argv);
  Losses out;
  out.seconds = r.seconds;
  if (r.exit_code != 0 || !fs::exists(json)) {
    out.error = r.output;
    return out;
  }
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in);
  for (const auto& row : j["steps"]) {
    out.loss.push_back(row["loss"].get<double>());
    if (row.contains("val_loss")) out.val_loss[row["step"].get<int>()] = row["val_loss"];
  }
  if (j.contains("val_loss")) out.val_loss[0] = j["val_loss"].get<double>();
  return out;
}

// Largest |a - b| / |b| over the steps; fails on a length mismatch.
double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
  return worst;
}

// One world size: `tol` bounds every step's relative difference (and the validation losses'),
// `first_tol` the first step's.
struct Case {
  int n;
  double tol;
  double first_tol;
};

void expect_match(const std::string& precision, const std::vector<std::string>& peer_flags,
                  const std::vector<Case>& cases, const std::vector<std::string>& our_flags = {}) {
  REQUIRE_PEER_PYTHON();
  ASSERT_TRUE(fs::exists(init_file())) << init_file();
  for (const auto& [n, tol, first_tol] : cases) {
    const std::string what = precision + " N=" + std::to_string(n);
    const auto ours = train(n, precision,
                            scratch() + "/" + precision + std::to_string(n) +
                                (our_flags.empty() ? "" : "_" + our_flags.back()),
                            our_flags);
    ASSERT_EQ(ours.error, "") << what << ": fsdp-train failed";
    auto flags = peer_flags;
    flags.insert(flags.end(), {"--init", init_file(), "--mixed-precision", precision});
    const auto theirs = peer(n, flags);
    ASSERT_EQ(theirs.error, "") << what << ": fsdp2_peer.py failed";
    ASSERT_EQ(ours.loss.size(), static_cast<size_t>(kSteps)) << what;
    const double loss_diff = max_rel_diff(ours.loss, theirs.loss);
    std::vector<double> ours_val, theirs_val;
    for (const auto& [step, v] : ours.val_loss) {
      ours_val.push_back(v);
      theirs_val.push_back(theirs.val_loss.count(step) ? theirs.val_loss.at(step) : NAN);
    }
    const double val_diff = max_rel_diff(ours_val, theirs_val);
    std::printf(
        "[fsdp2 peer] %s: max relative loss difference over %d steps %.3g (step 1: %.3g), "
        "validation %.3g (fsdp-train %.1f s, peer %.1f s)\n",
        what.c_str(), kSteps, loss_diff, std::abs(ours.loss[0] - theirs.loss[0]) / theirs.loss[0],
        val_diff, ours.seconds, theirs.seconds);
    EXPECT_LE(loss_diff, tol) << what << " per-step losses";
    EXPECT_LE(std::abs(ours.loss[0] - theirs.loss[0]), first_tol * std::abs(theirs.loss[0]))
        << what << " step 1 (the same forward of the same weights): fsdp-train " << ours.loss[0]
        << ", FSDP2 " << theirs.loss[0];
    EXPECT_LE(val_diff, tol) << what << " validation losses";
    for (size_t i = 0; i < ours.loss.size() && i < theirs.loss.size(); ++i)
      EXPECT_LE(std::abs(ours.loss[i] - theirs.loss[i]), tol * std::abs(theirs.loss[i]))
          << what << " step " << i + 1 << ": fsdp-train " << ours.loss[i] << ", FSDP2 "
          << theirs.loss[i];
  }
}

// PyTorch as its users run it: torch.optim.AdamW.
TEST(Fsdp2Peer, Fp32LossesMatchPyTorchFsdp2AtTwoAndFourRanks) {
  expect_match("none", {}, {{2, 1e-5, 1e-5}, {4, 1e-5, 1e-5}});
}

TEST(Fsdp2Peer, Bf16LossesMatchPyTorchFsdp2AtTwoAndFourRanks) {
  if (kSameKernelsAsPeer)
    expect_match("bf16", {"--adamw", "libtorch"},
                 {{2, kBf16SameOrderRel, kBf16SameOrderRel}, {4, kBf16Rel, kBf16SameOrderRel}});
  else
    expect_match("bf16", {"--adamw", "libtorch"},
                 {{2, kBf16OtherKernelsRel, kBf16OtherKernelsFirstRel},
                  {4, kBf16OtherKernelsRel, kBf16OtherKernelsFirstRel}});
}

// reshard_after_forward=2 at N=4 (hpZ) on both sides: blocks keep half of their parameters after
// forward and gather them within pairs of ranks in backward; the same losses as FSDP2's.
TEST(Fsdp2Peer, ReshardAfterForwardToTwoRanksMatchesPyTorchFsdp2AtFourRanks) {
  const std::vector<std::string> flags = {"--reshard-after-forward-world", "2"};
  expect_match("none", flags, {{4, 1e-5, 1e-5}}, flags);
}

// shard_placement_fn giving Shard(1) to every weight and embedding, on both sides (FSDP2 needs
// the columns to divide evenly: width 32 at N = 2 and 4): the same losses as FSDP2's.
// The placement changes no value, so the checkpoint of the last step shows that it took effect:
// every parameter of two dims is stored as column slices, the vectors as rows.
TEST(Fsdp2Peer, ShardOnDimOneMatchesPyTorchFsdp2AtTwoAndFourRanks) {
  const std::vector<std::string> peer_flags = {"--shard-dim", "1"};
  const std::vector<std::string> flags = {"--shard-dim", "1", "--save-every",
                                          std::to_string(kSteps)};
  expect_match("none", peer_flags, {{2, 1e-5, 1e-5}, {4, 1e-5, 1e-5}}, flags);
  for (int n : {2, 4}) {
    const auto dir = scratch() + "/none" + std::to_string(n) + "_" + flags.back();
    const auto ckpt = checkpoint::latest(dir);
    ASSERT_TRUE(ckpt.has_value()) << dir;
    int columns = 0;
    std::ifstream in(*ckpt + "/" + checkpoint::kIndexFile);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (const auto& e : checkpoint::parse_index(text, *ckpt).tensors) {
      if (e.replicated) continue;
      EXPECT_EQ(e.dim, e.global_shape.size() >= 2 ? 1 : 0) << e.name;
      columns += e.dim == 1;
    }
    EXPECT_GT(columns, 0);
  }
}

// ignored_params on both sides, in the root (the final norm, the position embedding) and in a
// block: never reduced, so every rank steps them with its own gradient and the ranks' values
// drift apart; the losses (the mean over ranks) still equal FSDP2's.
TEST(Fsdp2Peer, IgnoredParamsMatchPyTorchFsdp2AtTwoAndFourRanks) {
  const std::vector<std::string> flags = {"--ignored-params",
                                          "ln_f.weight,ln_f.bias,wpe.weight,h.1.ln_2.bias"};
  expect_match("none", flags, {{2, 1e-5, 1e-5}, {4, 1e-5, 1e-5}}, flags);
}

// Custom collectives on both sides (set_custom_all_gather / set_custom_reduce_scatter on every
// group): an all-gather and a reduce-scatter that put their input on the wire rounded to bf16, so
// forward and backward compute with rounded weights and the gradients are sums of rounded ones.
// The same losses as FSDP2's; and not those of the communicator's own collectives, so a custom
// collective that went unused (in forward, in backward's gathers or in the reductions) would show:
// the rounding moves the losses by 2.2e-4 over the 30 steps.
// The rounding turns the last-bit differences of two programs' weights into whole bf16 steps, so
// the peer runs with --adamw libtorch (as for bf16): with LibTorch 2.15's kernels the two then
// agree to metrics.csv's 9 digits at N = 2 and 4 (measured 1.5e-9, 1.4e-9). fsdp-train built
// against Debian's 1.13 computes fp32 with other kernels, whose last bits the roundings amplify
// over the steps (measured 2.1e-5 and 1.3e-5), so the bound there is 1e-4, still under the
// rounding's effect; its step 1 stays within 1e-7 (measured 3.2e-10 and 6.0e-10, where the
// rounding moves step 1 by 2.7e-6).
TEST(Fsdp2Peer, CustomCollectivesMatchPyTorchFsdp2AtTwoAndFourRanks) {
  const std::vector<std::string> flags = {"--custom-collectives", "bf16-round"};
  auto peer_flags = flags;
  peer_flags.insert(peer_flags.end(), {"--adamw", "libtorch"});
  const double tol = kSameKernelsAsPeer ? 1e-7 : 1e-4;
  expect_match("none", peer_flags, {{2, tol, 1e-7}, {4, tol, 1e-7}}, flags);
  const auto plain = train(2, "none", scratch() + "/custom_off");
  const auto rounded = train(2, "none", scratch() + "/custom_on", flags);
  ASSERT_EQ(plain.error + rounded.error, "");
  const double effect = max_rel_diff(plain.loss, rounded.loss);
  std::printf(
      "[fsdp2 peer] bf16-rounding collectives change fsdp-train's losses by up to %.3g (step 1: "
      "%.3g)\n",
      effect, std::abs(plain.loss[0] - rounded.loss[0]) / plain.loss[0]);
  EXPECT_GT(effect, 1.5e-4);
}

// HSDP on both sides (FSDP2's fully_shard over a 2-D mesh, 2 replicas x 2 shards) with two
// micro-batches, gradient sync off for the first (set_requires_gradient_sync): the same losses
// as FSDP2's.
TEST(Fsdp2Peer, HsdpWithMicroBatchesMatchesPyTorchFsdp2AtFourRanks) {
  const std::vector<std::string> flags = {"--grad-accum", "2", "--hsdp", "2"};
  expect_match("none", flags, {{4, 1e-5, 1e-5}}, flags);
}

// bf16 compute with fp32 reductions (MixedPrecisionPolicy::reduce_dtype unset on both sides: the
// parameters' fp32, the default of fsdp-cpp and of torch 2.15) and two micro-batches without
// gradient sync, at N = 2 and with HSDP 2x2 at N = 4: each rank's bf16 gradients of the two
// micro-batches sum in fp32 before the reduce-scatter, and the first one's two uses of the tied
// embedding are cast to fp32 before they are summed, as FSDP2 has autograd do ([Note:
// accumulating without gradient sync]). Measured 1.5e-9 and 1.6e-9; with the micro-batches summed
// in bf16, 1.8e-4 and 3.2e-4; with only the embedding's uses summed in bf16, 3.7e-4 and 2.2e-4.
// LibTorch 1.13's autograd has no gradient dtype (the uses sum in bf16) and its bf16 kernels
// differ: the bounds there are those of bf16 with other kernels (measured on the AVX2 machine
// 5.9e-3 / 5.1e-3, step 1 3.1e-6 / 1.8e-6).
TEST(Fsdp2Peer, Bf16WithFp32ReductionsAndMicroBatchesMatchPyTorchFsdp2) {
  const std::vector<std::string> flags = {"--grad-accum", "2", "--mixed-precision-reduce", "fp32"};
  auto peer_flags = flags;
  peer_flags.insert(peer_flags.end(), {"--adamw", "libtorch"});
  const double tol = kSameKernelsAsPeer ? 1e-5 : kBf16OtherKernelsRel;
  const double first = kSameKernelsAsPeer ? 1e-7 : kBf16OtherKernelsFirstRel;
  expect_match("bf16", peer_flags, {{2, tol, first}}, flags);
  auto hsdp = flags;
  hsdp.insert(hsdp.begin(), {"--hsdp", "2"});
  auto peer_hsdp = peer_flags;
  peer_hsdp.insert(peer_hsdp.end(), {"--hsdp", "2"});
  expect_match("bf16", peer_hsdp, {{4, tol, first}}, hsdp);
}

// Item 5: PyTorch reads fsdp-cpp's consolidated checkpoint of step 15 (trained, not the init) with
// `safetensors` into its own GPT and evaluates the validation batches to the loss fsdp-train
// logged for that step.
TEST(Fsdp2Peer, PyTorchLoadsOurConsolidatedCheckpointToTheSameValLoss) {
  REQUIRE_PEER_PYTHON();
  ASSERT_TRUE(fs::exists(init_file())) << init_file();
  const std::string dir = scratch() + "/ckpt_run";
  const auto ours = train(2, "none", dir, {"--save-every", std::to_string(kEvalEvery)});
  ASSERT_EQ(ours.error, "") << "fsdp-train failed";
  ASSERT_TRUE(ours.val_loss.count(kEvalEvery)) << "no validation loss at step " << kEvalEvery;
  char step_dir[32];
  std::snprintf(step_dir, sizeof step_dir, "/step_%08d", kEvalEvery);
  const std::string file = scratch() + "/step15.safetensors";
  checkpoint::consolidate(dir + step_dir, file);
  const auto theirs = peer(2, {"--init", file, "--steps", "0"});
  ASSERT_EQ(theirs.error, "") << "fsdp2_peer.py failed";
  ASSERT_TRUE(theirs.val_loss.count(0)) << "the peer printed no validation loss";
  const double want = ours.val_loss.at(kEvalEvery), got = theirs.val_loss.at(0);
  std::printf(
      "[fsdp2 peer] step-%d checkpoint: fsdp-train val_loss %.17g, PyTorch %.17g, "
      "relative difference %.3g\n",
      kEvalEvery, want, got, std::abs(got - want) / want);
  EXPECT_LE(std::abs(got - want), 1e-6 * want);
  // A checkpoint after training, not the init: the loss moved well below the first step's.
  EXPECT_LT(got, ours.loss.front() - 0.5);
}

}  // namespace
}  // namespace fsdp::train
