// fsdp-gpu-check: what only a CUDA device can check (built with FSDP_CUDA=ON; bench/gpu_run.sh
// runs it on an accelerator machine). One rank per GPU over NCCL; with one GPU that is world size
// 1, where every collective is a local copy, so these checks cover the CUDA tensors, buffers,
// streams and storage handling of the library, not NCCL's transfers.
//
//   fsdp-gpu-check                 the correctness checks; exit status 1 if one fails
//   fsdp-gpu-check --bench [sizes] step time, tokens/s, MFU and peak GPU memory of one GPT
//
// Checks (each prints one line, `check NAME: pass|FAIL ...`):
//   fp64_parity_*   GPT trained 4 steps (2 micro-batches, clip, AdamW) sharded and unsharded in
//   fp64
//                   on the GPU: losses, clip norms and final parameters within 1e-9 (relative);
//                   with reshard after forward on and off, and with activation checkpointing.
//   bf16            param_dtype bf16, reduce_dtype fp32 against the fp64 model: losses within 2%.
//   *_placed_list_finalize  the same with 2-d parameters sharded on dim 1, the last two blocks
//                   one group (a module list), and micro-batches reduced by finalize_backward.
//   graph_replay    set_keep_unsharded_storage: a CUDA graph captured over a block's forward,
//                   replayed after an optimizer step and a new gather, equals the eager forward
//                   with the new values (and differs from the captured step's output).
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <fsdp/checkpoint.h>
#include <fsdp/fsdp.h>
#include <fsdp/models/gpt.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>

namespace {

using fsdp::models::GPT;
using fsdp::models::GPTConfig;

const torch::Device kCuda(torch::kCUDA);

double rel(double a, double b) { return std::abs(a - b) / std::max(1e-12, std::abs(b)); }

// Rank r's micro-batch m of step s: the same on every rank's reference.
std::pair<torch::Tensor, torch::Tensor> batch(const GPTConfig& cfg, int s, int m, int r) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * s + 10 * m + r + 1));
  auto tok = torch::randint(cfg.vocab_size, {4, cfg.seq_len + 1}, gen, torch::kLong);
  return {tok.narrow(1, 0, cfg.seq_len).to(kCuda), tok.narrow(1, 1, cfg.seq_len).to(kCuda)};
}

// The checks' GPT: 96 tokens, 32 positions, width 64, 4 heads.
GPTConfig small_gpt(int64_t layers) {
  GPTConfig cfg;
  cfg.vocab_size = 96;
  cfg.seq_len = 32;
  cfg.n_layer = layers;
  cfg.n_head = 4;
  cfg.n_embd = 64;
  return cfg;
}

struct Outcome {
  double loss = 0, norm = 0, params = 0;  // largest relative differences
  std::string placement;                  // CPUOffloadPolicy: where shards and gradients were
};

// Where the local shards and their gradients live: "cpu pinned", "cpu", "cuda:0", ... (with a
// count where they differ).
std::string where(const fsdp::FSDPModule& root) {
  std::map<std::string, int> shards, grads;
  for (const auto& p : root.parameters()) {
    ++shards[p.device().str() + (p.is_cpu() && p.is_pinned() ? " pinned" : "")];
    ++grads[p.grad().defined() ? p.grad().device().str() : "none"];
  }
  auto list = [](const std::map<std::string, int>& m) {
    std::string out;
    for (const auto& [k, n] : m)
      out += (out.empty() ? "" : " + ") + k + (m.size() > 1 ? " x" + std::to_string(n) : "");
    return out;
  };
  return "shards " + list(shards) + ", gradients " + list(grads);
}

// Sharded (blocks and root) against the unsharded model, both on the GPU in `dtype`. `placed`:
// every 2-d parameter sharded on dim 1 (shard_placement_fn), the last two blocks one group (a
// module list), and the micro-batches accumulated without sync, then finalize_backward.
Outcome train_against_reference(const std::shared_ptr<fsdp::Communicator>& world,
                                const fsdp::ShardOptions& block_options, torch::Dtype dtype,
                                int steps, bool async_unshard = false, bool placed = false) {
  const GPTConfig cfg = small_gpt(3);
  const int micro = 2, ranks = world->size(), me = world->rank();
  torch::manual_seed(0);
  fsdp::Sharded<GPT> model(cfg);
  torch::manual_seed(0);
  GPT ref(cfg);
  model->to(kCuda, dtype);
  ref->to(kCuda, torch::kDouble);
  fsdp::ShardOptions root_options, bo = block_options;
  root_options.mixed_precision = block_options.mixed_precision;
  root_options.offload_policy = block_options.offload_policy;
  if (placed)
    bo.shard_placement_fn = root_options.shard_placement_fn =
        [](const std::string&, const at::Tensor& p) -> std::optional<fsdp::Shard> {
      if (p.dim() >= 2) return fsdp::Shard{1};
      return std::nullopt;
    };
  std::vector<fsdp::FSDPModule> blocks;
  auto& mb = model->blocks;
  for (size_t i = 0; i < mb.size(); ++i) {
    if (placed && i + 2 == mb.size()) {
      blocks.push_back(fsdp::fully_shard({mb[i], mb[i + 1]}, world, bo));
      blocks.push_back(blocks.back());
      break;
    }
    blocks.push_back(fsdp::fully_shard(mb[i], world, bo));
  }
  auto root = fsdp::fully_shard(model, world, root_options);
  if (async_unshard) {  // FSDP2's manual forward prefetch: unshard(async_op=True) of the next block
    for (auto& b : blocks) b.set_modules_to_forward_prefetch({});
    root.set_modules_to_forward_prefetch({});
    model->before_block = [blocks](size_t i) mutable {
      if (i + 1 < blocks.size()) blocks[i + 1].unshard(/*async_op=*/true);
    };
  }
  torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(3e-3));
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(3e-3));
  Outcome o;
  for (int s = 0; s < steps; ++s) {
    for (int m = 0; m < micro; ++m) {
      root.set_requires_gradient_sync(!placed && m == micro - 1);
      auto [x, y] = batch(cfg, s, m, me);
      auto loss = model(x, y);
      (loss / micro).backward();
      double ref_mine = 0;
      for (int r = 0; r < ranks; ++r) {
        auto [rx, ry] = batch(cfg, s, m, r);
        auto l = ref->forward(rx, ry);
        (l / (micro * ranks)).backward();
        if (r == me) ref_mine = l.item<double>();
      }
      o.loss = std::max(o.loss, rel(loss.item<double>(), ref_mine));
    }
    if (placed) {
      root.set_requires_gradient_sync(true);
      root.finalize_backward();
    }
    if (s == steps - 1) o.placement = where(root);
    const double norm = fsdp::clip_grad_norm_(root, 0.5);
    const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
    o.norm = std::max(o.norm, rel(norm, ref_norm));
    opt.step();
    ref_opt.step();
    opt.zero_grad();
    ref_opt.zero_grad();
  }
  auto full = fsdp::full_state_dict(root);
  for (const auto& p : ref->named_parameters()) {
    const auto got = full[p.key()].to(torch::kDouble);
    const auto want = p.value().detach().cpu();
    o.params = std::max(
        o.params, ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item<double>());
  }
  return o;
}

bool report(const char* name, const Outcome& o, double tol) {
  const bool ok = o.loss <= tol && o.norm <= tol && o.params <= tol;
  std::printf(
      "check %s: %s (largest relative difference: loss %.2e, clip norm %.2e, parameters "
      "%.2e; tolerance %.0e; %s)\n",
      name, ok ? "pass" : "FAIL", o.loss, o.norm, o.params, tol, o.placement.c_str());
  return ok;
}

// set_keep_unsharded_storage(true) keeps each full parameter's address across reshard and
// unshard, so a CUDA graph captured over the block's forward replays with later values.
// One rank in bf16: every gather goes through a gathered block (no borrowed shard), so the
// address is the kept block's; without keep_unsharded_storage it is a new block each time.
bool graph_replay(const std::shared_ptr<fsdp::Communicator>& world) {
  const GPTConfig cfg = small_gpt(2);
  torch::manual_seed(0);
  fsdp::Sharded<GPT> model(cfg);
  model->to(kCuda);
  fsdp::ShardOptions o;
  o.mixed_precision.param_dtype = torch::kBFloat16;
  std::vector<fsdp::FSDPModule> blocks;
  for (auto& b : model->blocks) blocks.push_back(fsdp::fully_shard(b, world, o));
  auto root = fsdp::fully_shard(model, world, o);
  blocks[0].set_keep_unsharded_storage(true);
  // The control: block 1 without kept storage, gathered twice with a gather of block 0 between.
  blocks[1].unshard();
  const void* first = model->blocks[1]->c_fc->weight.data_ptr();
  blocks[1].reshard();
  blocks[0].unshard();
  blocks[1].unshard();
  const bool control_moved = model->blocks[1]->c_fc->weight.data_ptr() != first;
  blocks[1].reshard();
  blocks[0].reshard();
  torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-2));
  auto x = torch::randn({4, cfg.seq_len, cfg.n_embd}, kCuda).to(torch::kBFloat16);
  auto& inner = model->blocks[0];
  at::cuda::CUDAGraph graph;
  torch::Tensor captured;
  blocks[0].unshard();
  const void* address = inner->c_fc->weight.data_ptr();
  {
    torch::NoGradGuard no_grad;
    auto side = c10::cuda::getStreamFromPool();
    side.synchronize();
    c10::cuda::CUDAStreamGuard on_side(side);
    for (int i = 0; i < 3; ++i) inner->forward(x);  // warm-up on the capture stream
    graph.capture_begin();
    captured = inner->forward(x);
    graph.capture_end();
  }
  torch::cuda::synchronize();
  graph.replay();
  torch::cuda::synchronize();
  const auto before = captured.clone();
  blocks[0].reshard();
  auto [idx, tgt] = batch(cfg, 0, 0, world->rank());
  model(idx, tgt).backward();
  opt.step();
  opt.zero_grad();
  blocks[0].unshard();
  const bool same_address = inner->c_fc->weight.data_ptr() == address;
  graph.replay();
  torch::cuda::synchronize();
  torch::Tensor eager;
  {
    torch::NoGradGuard no_grad;
    eager = inner->forward(x);
  }
  blocks[0].reshard();
  const double diff = (captured - eager).abs().max().item<double>();
  const double moved = (before - eager).abs().max().item<double>();
  const bool ok = same_address && diff == 0 && moved > 0;
  std::printf(
      "check graph_replay: %s (same address after the step: %s; replay vs eager: %.2e; "
      "output moved by the step: %.2e; without kept storage the address %s)\n",
      ok ? "pass" : "FAIL", same_address ? "yes" : "no", diff, moved,
      control_moved ? "moved" : "stayed");
  return ok;
}

// fsdp::checkpoint::save of a CUDA model after two steps, loaded into a model built from another
// seed: the next two steps' losses are the same bits as the saved run's.
bool checkpoint_roundtrip(const std::shared_ptr<fsdp::Communicator>& world) {
  const GPTConfig cfg = small_gpt(2);
  const std::string dir = "/tmp/fsdp-gpu-check-ckpt";
  std::filesystem::remove_all(dir);
  auto train = [&](int seed, int first, int last, bool save, const std::string& load) {
    torch::manual_seed(seed);
    fsdp::Sharded<GPT> model(cfg);
    model->to(kCuda);
    auto root = fsdp::models::shard_gpt(model, world);
    torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(3e-3));
    if (!load.empty()) fsdp::checkpoint::load(load, root, &opt, *world);
    std::vector<double> losses;
    std::string saved;
    for (int s = first; s < last; ++s) {
      auto [x, y] = batch(cfg, s, 0, world->rank());
      auto loss = model(x, y);
      loss.backward();
      opt.step();
      opt.zero_grad();
      losses.push_back(loss.item<double>());
      if (save && s == 1) {
        fsdp::checkpoint::TrainState st;
        st.step = s + 1;
        saved = fsdp::checkpoint::save(dir, root, &opt, st, *world);
      }
    }
    return std::make_pair(losses, saved);
  };
  auto [straight, saved] = train(0, 0, 4, true, "");
  auto [resumed, unused] = train(7, 2, 4, false, saved);
  const bool ok = resumed.size() == 2 && resumed[0] == straight[2] && resumed[1] == straight[3];
  std::printf(
      "check checkpoint: %s (steps 3-4 after loading: %.9g %.9g; without a break: %.9g "
      "%.9g)\n",
      ok ? "pass" : "FAIL", resumed[0], resumed[1], straight[2], straight[3]);
  return ok;
}

int checks(const std::shared_ptr<fsdp::Communicator>& world) {
  int failed = 0;
  auto run = [&](const char* name, auto&& fn) {
    try {
      if (!fn()) ++failed;
    } catch (const std::exception& e) {
      ++failed;
      std::printf("check %s: FAIL (threw: %s)\n", name, e.what());
    }
    std::fflush(stdout);
  };
  fsdp::ShardOptions o;
  run("fp64_parity", [&] {
    return report("fp64_parity", train_against_reference(world, o, torch::kDouble, 4), 1e-9);
  });
  run("fp64_parity_no_reshard", [&] {
    auto n = o;
    n.reshard_after_forward = false;
    return report("fp64_parity_no_reshard", train_against_reference(world, n, torch::kDouble, 4),
                  1e-9);
  });
  run("fp64_parity_checkpointing", [&] {
    auto c = o;
    c.activation_checkpointing = true;
    return report("fp64_parity_checkpointing", train_against_reference(world, c, torch::kDouble, 4),
                  1e-9);
  });
  run("bf16", [&] {
    auto b = o;
    b.mixed_precision.param_dtype = torch::kBFloat16;
    b.mixed_precision.reduce_dtype = torch::kFloat;
    auto r = train_against_reference(world, b, torch::kFloat, 4);
    const bool ok = r.loss < 2e-2;
    std::printf(
        "check bf16: %s (largest relative loss difference against fp64 %.2e; tolerance "
        "2e-2)\n",
        ok ? "pass" : "FAIL", r.loss);
    return ok;
  });
  run("fp64_parity_async_unshard", [&] {
    return report("fp64_parity_async_unshard",
                  train_against_reference(world, o, torch::kDouble, 4, /*async_unshard=*/true),
                  1e-9);
  });
  run("fp64_parity_offload", [&] {
    auto c = o;
    c.offload_policy = fsdp::CPUOffloadPolicy{};
    auto r = train_against_reference(world, c, torch::kDouble, 4);
    const bool placed = r.placement == "shards cpu pinned, gradients cpu";
    return report("fp64_parity_offload", r, 1e-9) && placed;
  });
  run("bf16_offload", [&] {
    auto b = o;
    b.mixed_precision.param_dtype = torch::kBFloat16;
    b.mixed_precision.reduce_dtype = torch::kFloat;
    b.offload_policy = fsdp::CPUOffloadPolicy{false};
    auto r = train_against_reference(world, b, torch::kFloat, 4);
    const bool ok = r.loss < 2e-2 && r.placement == "shards cpu, gradients cpu";
    std::printf(
        "check bf16_offload: %s (largest relative loss difference against fp64 %.2e; "
        "%s)\n",
        ok ? "pass" : "FAIL", r.loss, r.placement.c_str());
    return ok;
  });
  run("fp64_parity_placed_list_finalize", [&] {
    return report("fp64_parity_placed_list_finalize",
                  train_against_reference(world, o, torch::kDouble, 4, false, /*placed=*/true),
                  1e-9);
  });
  run("bf16_placed_list_finalize", [&] {
    auto b = o;
    b.mixed_precision.param_dtype = torch::kBFloat16;
    b.mixed_precision.reduce_dtype = torch::kFloat;
    auto r = train_against_reference(world, b, torch::kFloat, 4, false, /*placed=*/true);
    const bool ok = r.loss < 2e-2;
    std::printf(
        "check bf16_placed_list_finalize: %s (largest relative loss difference against fp64 "
        "%.2e; tolerance 2e-2)\n",
        ok ? "pass" : "FAIL", r.loss);
    return ok;
  });
  run("checkpoint", [&] { return checkpoint_roundtrip(world); });
  run("graph_replay", [&] { return graph_replay(world); });
  std::printf("checks failed: %d\n", failed);
  return failed == 0 ? 0 : 1;
}

// --bench: one GPT, the step's time, tokens/s, model FLOPs utilisation against `peak_tflops` and
// the GPU's peak allocated memory; sharded (world size 1) or not, fp32 or bf16 mixed precision.
int bench(const std::shared_ptr<fsdp::Communicator>& world, int argc, char** argv) {
  GPTConfig cfg;
  cfg.vocab_size = 32768;
  cfg.seq_len = 1024;
  cfg.n_layer = 12;
  cfg.n_head = 16;
  cfg.n_embd = 1024;
  int64_t batch_rows = 8;
  int steps = 10;
  bool shard = true, bf16 = false, offload = false;
  double peak_tflops = 0;  // default: an H100/H200's dense bf16 (989) or plain fp32 (67) rate
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return std::atoll(argv[++i]); };
    if (a == "--layers")
      cfg.n_layer = next();
    else if (a == "--width")
      cfg.n_embd = next();
    else if (a == "--heads")
      cfg.n_head = next();
    else if (a == "--seq")
      cfg.seq_len = next();
    else if (a == "--vocab")
      cfg.vocab_size = next();
    else if (a == "--batch")
      batch_rows = next();
    else if (a == "--steps")
      steps = static_cast<int>(next());
    else if (a == "--none")
      shard = false;
    else if (a == "--bf16")
      bf16 = true;
    else if (a == "--offload")
      offload = true;
    else if (a == "--peak-tflops")
      peak_tflops = static_cast<double>(next());
    else {
      std::fprintf(stderr, "fsdp-gpu-check --bench: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (peak_tflops <= 0) peak_tflops = bf16 ? 989.0 : 67.0;
  torch::manual_seed(0);
  fsdp::Sharded<GPT> model(cfg);
  model->to(kCuda);
  std::vector<torch::Tensor> params = model->parameters();
  fsdp::FSDPModule root;
  if (shard) {
    fsdp::ShardOptions o;
    if (bf16) {
      o.mixed_precision.param_dtype = torch::kBFloat16;
      o.mixed_precision.reduce_dtype = torch::kFloat;
    }
    if (offload) o.offload_policy = fsdp::CPUOffloadPolicy{};
    root = fsdp::models::shard_gpt(model, world, o, o);
    params = root.parameters();
  } else if (bf16) {
    std::fprintf(stderr, "fsdp-gpu-check --bench: --none runs fp32 only\n");
    return 2;
  }
  int64_t n_params = 0;
  for (const auto& p : model->parameters()) n_params += p.numel();
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-4));
  auto tok = torch::randint(cfg.vocab_size, {batch_rows, cfg.seq_len + 1},
                            torch::TensorOptions(torch::kLong).device(kCuda));
  auto x = tok.narrow(1, 0, cfg.seq_len), y = tok.narrow(1, 1, cfg.seq_len);
  auto step = [&] {
    model(x, y).backward();
    opt.step();
    opt.zero_grad();
  };
  for (int i = 0; i < 3; ++i) step();
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  torch::cuda::synchronize();
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  const double peak_gb = static_cast<double>(stats.allocated_bytes[0].peak) / 1e9;
  const double tokens = static_cast<double>(batch_rows * cfg.seq_len);
  // 6 N per token for the matmuls of forward and backward, plus attention's 12 L T C.
  const double flops =
      tokens * (6.0 * static_cast<double>(n_params) +
                12.0 * static_cast<double>(cfg.n_layer * cfg.seq_len * cfg.n_embd));
  std::printf(
      "bench %s%s %s: layers %lld width %lld seq %lld batch %lld params %.1fM: step %.4f s, "
      "%.0f tokens/s, MFU %.1f%% of %.0f TFLOP/s, peak allocated %.2f GB\n",
      shard ? "fsdp" : "none", offload ? " offload" : "", bf16 ? "bf16" : "fp32",
      static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
      static_cast<long long>(cfg.seq_len), static_cast<long long>(batch_rows),
      static_cast<double>(n_params) / 1e6, s, tokens / s, 100.0 * flops / s / (peak_tflops * 1e12),
      peak_tflops, peak_gb);
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "fsdp-gpu-check: no CUDA device\n");
    return 2;
  }
  auto world = fsdp::init_process_group();
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(world->rank() % torch::cuda::device_count()));
  if (argc > 1 && std::strcmp(argv[1], "--bench") == 0) return bench(world, argc, argv);
  return checks(world);
} catch (const std::exception& e) {
  std::fprintf(stderr, "fsdp-gpu-check: %s\n", e.what());
  return 1;
}
