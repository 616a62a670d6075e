// TrainConfig::validate and validate_world: every setting's range, and the combinations that
// exclude each other, each error naming the flag, its value and a fix.
#include <fsdp/error.h>

#include <cmath>
#include <filesystem>

#include "train/config.h"

namespace fsdp::train {
namespace {

// Counts that must be positive, and the ranges of the numeric settings.
void check_ranges(const TrainConfig& c) {
  auto positive = [](const char* flag, int64_t v, const char* fix) {
    FSDP_CHECK(v > 0, "--", flag, " is ", v, "; it must be a positive integer (", fix, ")");
  };
  positive("nproc", c.nproc, "e.g. --nproc 2");
  positive("layers", c.layers, "e.g. --layers 4");
  positive("heads", c.heads, "e.g. --heads 4");
  positive("width", c.width, "e.g. --width 128");
  positive("seq", c.seq, "e.g. --seq 64");
  positive("steps", c.steps, "e.g. --steps 300");
  positive("batch", c.batch, "e.g. --batch 16");
  positive("vocab", c.vocab, "e.g. --vocab 256");
  positive("grad-accum", c.grad_accum, "1 = no accumulation");
  FSDP_CHECK(c.reshard_after_forward_world >= 0, "--reshard-after-forward-world is ",
             c.reshard_after_forward_world, "; use a divisor of a shard group's ranks, or 0 (off)");
  FSDP_CHECK(c.reshard_after_forward_world == 0 || c.reshard_after_forward,
             "--reshard-after-forward-world ", c.reshard_after_forward_world,
             " with --no-reshard-after-forward: the blocks would both keep all and 1/",
             c.reshard_after_forward_world,
             " of their parameters after forward. Fix: drop one of the two flags");
  FSDP_CHECK(c.shard_dim == 0 || c.shard_dim == 1, "--shard-dim is ", c.shard_dim,
             "; the GPT's parameters have at most two dims: use 0 (rows) or 1 (columns)");
  FSDP_CHECK(std::isfinite(c.clip) && c.clip >= 0, "--clip is ", c.clip,
             "; it must be a finite gradient norm >= 0 (e.g. --clip 1.0; 0 = no clipping)");
  positive("eval-batches", c.eval_batches, "e.g. --eval-batches 4");
  FSDP_CHECK(c.eval_every >= 0, "--eval-every is ", c.eval_every,
             "; use 0 (never) or a step count");
  FSDP_CHECK(c.keep_last >= 0, "--keep-last is ", c.keep_last, "; use 0 (keep all) or a count");
  FSDP_CHECK(c.val_fraction >= 0 && c.val_fraction <= 0.5, "--val-fraction is ", c.val_fraction,
             "; it must lie in [0, 0.5] (0: no validation split)");
  FSDP_CHECK(c.peak_tflops >= 0, "--peak-tflops is ", c.peak_tflops,
             "; use 0 (measured) or the peak of one rank");
  FSDP_CHECK(c.threads >= 0, "--threads is ", c.threads, "; use 0 (automatic) or a positive count");
  FSDP_CHECK(c.warmup >= 0, "--warmup is ", c.warmup,
             "; use 0 (no warmup) or a positive step count");
  FSDP_CHECK(c.log_every >= 0, "--log-every is ", c.log_every,
             "; use 0 (automatic) or a positive count");
  FSDP_CHECK(c.save_every >= 0, "--save-every is ", c.save_every,
             "; use 0 (never) or a step count");
  FSDP_CHECK(c.sample_tokens >= 0, "--sample-tokens is ", c.sample_tokens,
             "; use 0 (none) or a count");
}

// The optimiser's settings and the model's shape.
void check_optimisation(const TrainConfig& c) {
  FSDP_CHECK(c.width % c.heads == 0, "--width ", c.width, " is not divisible by --heads ", c.heads,
             "; each head gets width/heads channels: choose e.g. --width ",
             (c.width / c.heads + 1) * c.heads, " or --heads that divides ", c.width);
  FSDP_CHECK(c.lr > 0, "--lr is ", c.lr, "; it must be positive, e.g. --lr 3e-3");
  FSDP_CHECK(c.min_lr_ratio >= 0 && c.min_lr_ratio <= 1, "--min-lr-ratio is ", c.min_lr_ratio,
             "; it must lie in [0, 1]");
  FSDP_CHECK(c.weight_decay >= 0, "--weight-decay is ", c.weight_decay, "; it must be >= 0");
  FSDP_CHECK(c.beta1 >= 0 && c.beta1 < 1 && c.beta2 >= 0 && c.beta2 < 1, "--beta1 ", c.beta1,
             " / --beta2 ", c.beta2, ": each must lie in [0, 1)");
  FSDP_CHECK(c.eps > 0, "--eps is ", c.eps, "; it must be positive, e.g. 1e-8");
  FSDP_CHECK(c.optimizer == "fused" || c.optimizer == "torch", "--optimizer is '", c.optimizer,
             "'; expected fused (fsdp::optim::AdamW) or torch (torch::optim::AdamW)");
  FSDP_CHECK(c.temperature > 0, "--temperature is ", c.temperature,
             "; it must be positive, e.g. 0.8");
}

// The named choices, and the policies of the sharded model that --no-shard excludes.
void check_policies(const TrainConfig& c) {
  FSDP_CHECK(!(c.activation_checkpointing && c.no_shard),
             "--activation-checkpointing applies to the sharded blocks, but --no-shard trains "
             "the plain model; drop one of the two");
  FSDP_CHECK(
      c.mixed_precision == "none" || c.mixed_precision == "bf16" || c.mixed_precision == "fp16",
      "--mixed-precision is '", c.mixed_precision, "'; expected bf16, fp16 or none");
  FSDP_CHECK(
      c.mixed_precision != "fp16",
      "--mixed-precision fp16 computes forward and backward in float16, which LibTorch "
      "1.13's CPU kernels lack (no Half LayerNorm or matmul; it would work on CUDA); this "
      "build trains on CPU: use --mixed-precision bf16 (the same bytes on the wire) or none");
  FSDP_CHECK(!(c.mixed_precision != "none" && c.no_shard), "--mixed-precision ", c.mixed_precision,
             " is a policy of the sharded model, but --no-shard trains the plain model; drop "
             "one of the two");
  FSDP_CHECK(c.mixed_precision_reduce == "param" || c.mixed_precision_reduce == "fp32",
             "--mixed-precision-reduce is '", c.mixed_precision_reduce,
             "'; expected param or fp32");
  FSDP_CHECK(c.mixed_precision_reduce == "param" || c.mixed_precision != "none",
             "--mixed-precision-reduce ", c.mixed_precision_reduce,
             " sets the reductions' dtype of --mixed-precision bf16, but --mixed-precision is "
             "none: every reduction is fp32 already; drop it or add --mixed-precision bf16");
  FSDP_CHECK(c.hsdp >= 1, "--hsdp is ", c.hsdp,
             "; it must be a positive number of replicas that divides the ranks (1: plain FSDP)");
  FSDP_CHECK(!(!c.ignored_params.empty() && c.no_shard), "--ignored-params ", c.ignored_params,
             " leaves parameters of the sharded model unsharded, but --no-shard trains the plain "
             "model; drop one of the two");
  FSDP_CHECK(c.custom_collectives == "none" || c.custom_collectives == "bf16-round",
             "--custom-collectives is '", c.custom_collectives, "'; expected none or bf16-round");
  FSDP_CHECK(!(c.custom_collectives != "none" && c.no_shard), "--custom-collectives ",
             c.custom_collectives,
             " replaces the sharded model's collectives, but --no-shard trains the plain model "
             "without any; drop one of the two");
  for (const auto& [flag, value] :
       {std::pair<const char*, const std::string&>{"--quantize-gather", c.quantize_gather},
        {"--quantize-reduce", c.quantize_reduce}}) {
    FSDP_CHECK(value == "none" || value == "bf16" || value == "int8", flag, " is '", value,
               "'; expected none, bf16 or int8");
    FSDP_CHECK(value == "none" || !c.no_shard, flag, " ", value,
               " quantizes the sharded model's collectives, but --no-shard trains the plain "
               "model without any; drop one of the two");
    FSDP_CHECK(value == "none" || c.custom_collectives == "none", flag, " ", value,
               " and --custom-collectives ", c.custom_collectives,
               " both replace what the collectives put on the wire; keep one of the two");
  }
  FSDP_CHECK(c.verify_collectives == "on" || c.verify_collectives == "full" ||
                 c.verify_collectives == "off",
             "--verify-collectives is '", c.verify_collectives, "'; expected on, full or off");
  FSDP_CHECK(!(c.shard_dim != 0 && c.no_shard), "--shard-dim ", c.shard_dim,
             " places the shards of the sharded model, but --no-shard trains the plain model; "
             "drop one of the two");
  FSDP_CHECK(!(c.hsdp > 1 && c.no_shard), "--hsdp ", c.hsdp,
             " shards within replicas, but --no-shard trains the plain model in one process; "
             "drop one of the two");
  FSDP_CHECK(
      c.malloc_policy == "auto" || c.malloc_policy == "steady" || c.malloc_policy == "default",
      "--malloc is '", c.malloc_policy, "'; expected auto, steady or default");
  FSDP_CHECK(c.data_order == "random" || c.data_order == "sequential", "--data-order is '",
             c.data_order, "'; expected 'random' or 'sequential'");
  FSDP_CHECK(!(c.no_shard && c.was_set("nproc") && c.nproc != 1),
             "--no-shard runs one process without fsdp-cpp, but --nproc ", c.nproc,
             " was given; drop one of the two");
}

// Checkpoints: --resume, --init-from and --run-dir together.
void check_checkpoints(const TrainConfig& c) {
  FSDP_CHECK(!c.no_shard || (c.save_every == 0 && c.resume.empty() && c.init_from.empty()),
             "--no-shard runs plain LibTorch without fsdp-cpp, so it has no sharded checkpoints; "
             "drop --save-every/--resume/--init-from, or use --nproc 1 for a one-rank sharded run");
  // With --resume the checkpoint's settings may hold --save-every: checked after the merge.
  FSDP_CHECK(!c.async_save || c.save_every > 0 || !c.resume.empty(),
             "--async-save writes the checkpoints of --save-every in the background, but "
             "--save-every is 0 (no checkpoints); give --save-every K, or drop --async-save");
  FSDP_CHECK(c.resume != "auto" || !c.run_dir.empty(),
             "--resume auto continues the run in --run-dir if it holds a checkpoint, else starts "
             "it there; give --run-dir DIR");
  if (!c.resume.empty() && c.resume != "auto" && !c.run_dir.empty()) {
    namespace fs = std::filesystem;
    const auto norm = [](std::string p) {
      while (p.size() > 1 && p.back() == '/') p.pop_back();
      return fs::path(p).lexically_normal().string();
    };
    const std::string parent = fs::path(norm(c.resume)).parent_path().string();
    FSDP_CHECK(norm(c.run_dir) == norm(c.resume) || norm(c.run_dir) == parent, "--resume '",
               c.resume, "' and --run-dir '", c.run_dir,
               "' differ; a resumed run continues in its own directory: drop --run-dir");
  }
  FSDP_CHECK(c.resume.empty() || c.init_from.empty(), "--resume '", c.resume, "' and --init-from '",
             c.init_from, "' both given; a resumed run already has its weights: drop --init-from");
}

}  // namespace

void TrainConfig::validate() const {
  check_ranges(*this);
  check_policies(*this);
  check_optimisation(*this);
  check_checkpoints(*this);
  check_model(*this);
}

void TrainConfig::validate_world(int world_size) const {
  FSDP_CHECK(world_size % hsdp == 0, "--hsdp ", hsdp, " does not divide the ", world_size,
             " ranks; each replica must hold the same number of ranks: choose --hsdp that "
             "divides ",
             world_size, " (1: plain FSDP) or an --nproc that is a multiple of ", hsdp);
  FSDP_CHECK(batch % world_size == 0, "--batch ", batch, " is not divisible by the ", world_size,
             " ranks; the global batch is split evenly: use a multiple of ", world_size,
             " (e.g. --batch ", (batch / world_size + 1) * world_size, ") or another --nproc");
  const int shard = world_size / hsdp;
  FSDP_CHECK(reshard_after_forward_world == 0 || shard % reshard_after_forward_world == 0,
             "--reshard-after-forward-world ", reshard_after_forward_world, " does not divide the ",
             shard,
             " ranks of a shard group: blocks gather within that many consecutive ranks in "
             "backward. Fix: choose a divisor of ",
             shard, " (the ranks of one host) or 0 (off)");
  const int64_t split = world_size * grad_accum;
  FSDP_CHECK(batch % split == 0, "--batch ", batch, " is not divisible by ", world_size,
             " ranks x --grad-accum ", grad_accum, " = ", split,
             " micro-batches; use a multiple of ", split, " (e.g. --batch ",
             (batch / split + 1) * split, ") or another --grad-accum");
}

}  // namespace fsdp::train
