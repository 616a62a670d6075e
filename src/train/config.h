// TrainConfig: every setting of fsdp-train, from flags and/or a JSON or TOML config file.
//
// One schema: the CLI11 options are the list of keys. A config file holds the same keys as the long
// flags (without "--"; "-" and "_" are interchangeable); flags given on the command line win over
// the file. An unknown flag or key is an error naming it. Free of torch headers. Thread-safety:
// plain values; parse_args is not reentrant (CLI11 app per call, no globals).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "train/model_select.h"

namespace fsdp::train {

struct TrainConfig {
  // ---- processes ----
  int nproc = 2;          // local ranks started when no launcher variables are set
  int threads = 0;        // intra-op threads per rank; 0 = cores / local ranks (at least 1)
  bool no_shard = false;  // one process, plain LibTorch (the parity reference)
  // glibc malloc in every rank: "steady" (fixed thresholds, train/malloc.h), "default", or "auto"
  // (steady; default in a sanitizer build, whose allocator has no thresholds)
  std::string malloc_policy = "auto";
  bool reshard_after_forward = true;  // blocks free gathered parameters after forward
  // >= 2: blocks keep 1/K after forward, gathered within K ranks in backward (hpZ); 0: off
  int reshard_after_forward_world = 0;
  // How a block's gather is started ahead of its forward: "auto" (FSDP2's implicit prefetch of
  // the next block), "off", or "unshard" (the model calls unshard(true) on block i + 1 before
  // block i: FSDP2's manual prefetch with async_op=True).
  std::string forward_prefetch = "auto";
  // 1: every parameter of two dims (the weights and embeddings) is sharded on dim 1 instead of 0
  // (ShardOptions::shard_placement_fn returning Shard{1}); 0: dim 0.
  int shard_dim = 0;
  // Comma-separated parameter names left whole and unmanaged on every rank
  // (ShardOptions::ignored_params): each rank steps them with its own gradient.
  std::string ignored_params;
  // "bf16-round": every group's all-gathers and reduce-scatters go through custom collectives
  // that round their input to bf16 (FSDPModule::set_custom_all_gather / _reduce_scatter;
  // rounding_collectives.h); "none": the communicator's own.
  std::string custom_collectives = "none";
  // Quantized collectives (fsdp/quantized.h): "bf16" or "int8" (a scale per block of 128 values)
  // gathers the weights on a quantized wire (ShardOptions::gather_transform_fn =
  // quantized_gather), reduce-scatters the gradients on one summed in fp32 in rank order
  // (set_quantized_reduce_scatter); "none": exactly. The shards and AdamW stay fp32.
  std::string quantize_gather = "none";
  std::string quantize_reduce = "none";
  // Verified collectives (RuntimeOptions::verify_collectives): "on" checks a rotating 1/8 of each
  // collective's bytes per step (every byte within 8 steps), "full" every byte of every step
  // (verify_period 1), "off" none.
  std::string verify_collectives = "on";
  bool activation_checkpointing = false;  // blocks recompute their activations in backward
  std::string mixed_precision = "none";   // "none", "bf16" (gather and compute) or "fp16" (CUDA)
  // The reductions' dtype under mixed_precision: "param" (bf16, set explicitly) or "fp32"
  // (MixedPrecisionPolicy::reduce_dtype unset: the parameters' fp32, torch 2.15's default;
  // unsynced micro-batches then accumulate in fp32 too).
  std::string mixed_precision_reduce = "param";
  int hsdp = 1;  // replicas of HSDP (init_mesh); 1 = plain FSDP over all ranks
  // ---- model ----
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 128;  // n_embd
  int64_t seq = 64;     // context length T
  int64_t vocab = 256;  // tokens; a text corpus is bytes (256), a .bin file needs its tokenizer's
  std::string model = "gpt";  // "gpt" or "llama" (train/model_select.h)
  LlamaFlags llama;           // --kv-heads, --ffn, --rope-theta, --norm-eps, --tie-embeddings
  // ---- optimisation ----
  int64_t steps = 300;
  int64_t batch = 16;         // global batch in sequences, split evenly over ranks
  double lr = 3e-3;           // peak learning rate
  int64_t warmup = 30;        // linear warmup steps
  double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio at the last step
  double weight_decay = 0.1;  // AdamW decoupled decay on 2-D weights only
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  // "fused": fsdp::optim::AdamW (one vectorised pass per group's flat shard, include/fsdp/optim.h;
  // the same results as LibTorch's); "torch": torch::optim::AdamW.
  std::string optimizer = "fused";
  uint64_t seed = 1337;
  int64_t grad_accum =
      1;            // micro-batches per optimizer step (batch / ranks / grad_accum rows each)
  double clip = 0;  // largest global gradient 2-norm before the step; 0 = no clipping
  // ---- data ----
  std::string data;                   // empty = the shipped corpus (data/corpus.txt)
  std::string data_order = "random";  // "random" or "sequential" (docs/trainer.md, Data order)
  double val_fraction = 0.05;         // the last fraction of the corpus is held out for evaluation
  // ---- evaluation ----
  int64_t eval_every = 50;   // validation loss every k steps and after the last; 0 = never
  int64_t eval_batches = 4;  // global batches of the validation split per evaluation
  // ---- outputs ----
  std::string run_dir;    // empty = runs/<timestamp>
  int64_t log_every = 0;  // plain progress line every k steps; 0 = about 25 lines per run
  bool quiet = false;
  int64_t sample_tokens = 200;  // bytes generated at the end; 0 = none
  std::string prompt = "And God said";
  double temperature = 0.8;
  double peak_tflops = 0;  // peak FLOP/s per rank for MFU (TFLOP/s); 0 = measured at start
  std::string tokenizer;   // tokenizer.json: the closing sample of token data shown as text
  // ---- checkpoints (issue 6) ----
  int64_t save_every = 0;   // 0 = never
  int64_t keep_last = 0;    // keep the newest k checkpoints, remove older ones; 0 = keep all
  bool async_save = false;  // write checkpoints in the background (checkpoint::AsyncSaver)
  std::string resume;       // RUN_DIR (its latest checkpoint), RUN_DIR/step_K (that one), or
                            // "auto" (--run-dir's latest checkpoint if it has one, else start)
  std::string init_from;    // full safetensors file to initialise the model from
  // ---- bookkeeping ----
  std::string config_file;                 // --config, for the record
  std::vector<std::string> explicit_keys;  // keys given by flag or file (not defaults)
  // A Llama's transformers config.json (text): from --init-from's model directory, or the
  // checkpoint a run resumes from; empty: the Llama comes from the flags.
  std::string hf_config;

  bool was_set(const std::string& key) const;
  // Throws fsdp::Error naming the first invalid setting (value, expectation, fix). Does not touch
  // the file system (see data.h for the corpus checks).
  void validate() const;
  // The checks that need the number of ranks: the batch must split evenly.
  void validate_world(int world_size) const;
  // The resolved settings as JSON text with the same keys (loadable again with --config).
  std::string to_json() const;
  // Local ranks x micro-batch rows: the rows of one micro-batch on one rank.
  int64_t micro_batch(int world_size) const { return batch / world_size / grad_accum; }
};

// The settings of `saved` (a to_json() object, e.g. a checkpoint's) with the keys in
// `overrides` taken from `given` instead. Throws fsdp::Error naming an unknown key or bad value.
TrainConfig merge_settings(const std::string& saved_json, const TrainConfig& given,
                           const std::vector<std::string>& overrides);
// Keys a resumed run may change (docs/trainer.md, "Resuming"); the others come from the
// checkpoint, and giving another value for them is an error.
const std::vector<std::string>& resumable_keys();

// Outcome of parse_args: either a config to run, or a message to print and an exit code
// (--help, --version, or a usage error). Usage errors are also thrown as fsdp::Error by validate().
struct ParseResult {
  std::optional<TrainConfig> config;
  int exit_code = 0;
  std::string message;  // --help text or the CLI11 error
};

// Parses argv (argv[0] included) and the --config file, then validates.
ParseResult parse_args(int argc, const char* const* argv);
ParseResult parse_args(const std::vector<std::string>& args);

// The default corpus: data/corpus.txt of the source tree (compiled in), or next to the binary's
// share directory when installed.
std::string default_data_path();

}  // namespace fsdp::train
