// Flags and config files of fsdp-train. The CLI11 app below is the one list of settings: --help,
// the config-file keys and the "unknown key" check all come from it.
#include "train/config.h"

#include <fsdp/error.h>
#include <toml++/toml.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "train/cli_integers.h"
#include "train/config_file.h"

#ifndef FSDP_SOURCE_DIR
#define FSDP_SOURCE_DIR "."
#endif

namespace fsdp::train {
namespace {

// Flag name of a config key: "data_order" and "data-order" both mean --data-order.
std::string normalise_key(std::string key) {
  std::replace(key.begin(), key.end(), '_', '-');
  return key;
}

struct App {
  CLI::App app{
      "fsdp-train: trains a GPT-2-style byte-level language model with fully sharded data "
      "parallelism (fsdp-cpp).\nWith no arguments: the shipped corpus on 2 local ranks. Under "
      "torchrun, mpirun, srun or fsdp-run: one rank per process.",
      "fsdp-train"};
  std::string config_file;
};

void add_training_options(CLI::App& app, TrainConfig& c) {
  app.add_option("--steps", c.steps, "total optimizer steps")->group("Optimisation");
  app.add_option("--batch", c.batch, "global batch in sequences, split evenly over the ranks")
      ->group("Optimisation");
  app.add_option("--lr", c.lr, "peak learning rate (after warmup)")->group("Optimisation");
  app.add_option("--warmup", c.warmup, "linear warmup steps")->group("Optimisation");
  app.add_option("--min-lr-ratio", c.min_lr_ratio,
                 "cosine schedule ends at lr * min-lr-ratio at the last step")
      ->group("Optimisation");
  app.add_option("--weight-decay", c.weight_decay, "AdamW weight decay (2-D weights only)")
      ->group("Optimisation");
  app.add_option("--beta1", c.beta1, "AdamW beta1")->group("Optimisation");
  app.add_option("--beta2", c.beta2, "AdamW beta2")->group("Optimisation");
  app.add_option("--eps", c.eps, "AdamW epsilon")->group("Optimisation");
  app.add_option("--optimizer", c.optimizer,
                 "fused (fsdp::optim::AdamW: one vectorised pass per group's flat shard) or torch "
                 "(torch::optim::AdamW); the same update and checkpoints")
      ->group("Optimisation");
  app.add_option("--seed", c.seed, "seeds initialisation, data order and sampling")
      ->group("Optimisation");
  app.add_option("--grad-accum", c.grad_accum,
                 "micro-batches per optimizer step (gradient accumulation; the batch is unchanged)")
      ->group("Optimisation");
  app.add_option("--clip", c.clip,
                 "clip the global gradient 2-norm to NORM before each step (0: no clipping); the "
                 "norm before clipping is logged as grad_norm")
      ->group("Optimisation");

  app.add_option(
         "--data", c.data,
         "text (one byte per token), or tokens: .bin/.u16 of uint16, .u32 of uint32 (empty: "
         "the shipped corpus)")
      ->group("Data");
  app.add_option("--val-fraction", c.val_fraction,
                 "last fraction of the data held out for the validation loss (0: none)")
      ->group("Data");
  app.add_option("--data-order", c.data_order,
                 "random: hashed window offsets; sequential: batch k takes consecutive windows "
                 "(docs/trainer.md)")
      ->check(CLI::IsMember({"random", "sequential"}))
      ->group("Data");
}

void add_output_options(CLI::App& app, TrainConfig& c) {
  app.add_option("--eval-every", c.eval_every,
                 "validation loss every k steps and after the last (0: never)")
      ->group("Evaluation");
  app.add_option("--eval-batches", c.eval_batches, "global batches per validation loss")
      ->group("Evaluation");

  app.add_option("--run-dir", c.run_dir, "output directory (empty: runs/<timestamp>)")
      ->group("Outputs");
  app.add_option("--log-every", c.log_every, "plain progress line every k steps (0: ~25 lines)")
      ->group("Outputs");
  app.add_flag("--quiet,-q", c.quiet, "no progress output (the summary is still printed)")
      ->group("Outputs");
  app.add_option("--sample-tokens", c.sample_tokens, "bytes of text generated at the end (0: none)")
      ->group("Outputs");
  app.add_option("--prompt", c.prompt, "prompt of the generated sample")->group("Outputs");
  app.add_option("--temperature", c.temperature, "sampling temperature of the generated sample")
      ->group("Outputs");
  app.add_option("--peak-tflops", c.peak_tflops,
                 "peak TFLOP/s of one rank for the MFU figure (0: measured once at start)")
      ->group("Outputs");

  app.add_option("--save-every", c.save_every, "checkpoint every k steps into the run directory")
      ->group("Checkpoints");
  app.add_option("--keep-last", c.keep_last,
                 "keep the newest k checkpoints, remove older ones (0: keep all)")
      ->group("Checkpoints");
  app.add_flag("--async-save", c.async_save,
               "write checkpoints in the background: a save holds the step only while the shards "
               "and optimizer state are copied to host memory (docs/checkpoint.md)")
      ->group("Checkpoints");
  app.add_option("--resume", c.resume,
                 "RUN_DIR: continue from its latest checkpoint with its settings; RUN_DIR/step_K: "
                 "from that one; auto: --run-dir's latest if it has one, else start")
      ->group("Checkpoints");
  app.add_option("--init-from", c.init_from,
                 "full safetensors file (e.g. a consolidated checkpoint) to initialise from, or a "
                 "Hugging Face Llama directory (config.json, model*.safetensors: --model llama)")
      ->group("Checkpoints");
}

void add_options(App& a, TrainConfig& c) {
  CLI::App& app = a.app;
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);
  app.footer(
      "A --config FILE (.json or .toml) holds the same keys as the long flags, e.g. "
      "{\"steps\": 500, \"data-order\": \"sequential\"}; flags on the command line win. "
      "Details: docs/trainer.md.");
  app.set_version_flag("--version", "fsdp-train 0.1");
  app.add_option("--config", a.config_file,
                 "JSON or TOML file of settings (same keys as the flags)");

  app.add_option("--nproc", c.nproc, "local ranks to start when no launcher variables are set")
      ->group("Processes");
  app.add_option("--threads", c.threads, "intra-op threads per rank (0 = cores / local ranks)")
      ->group("Processes");
  app.add_option("--malloc", c.malloc_policy,
                 "glibc malloc: steady (fixed thresholds: blocks up to 32 MiB from the heap, which "
                 "keeps up to 256 MiB free; a step reuses its pages instead of faulting in fresh "
                 "ones), default (glibc's own, which move with what the process freed) or auto "
                 "(steady; default in a sanitizer build)")
      ->check(CLI::IsMember({"auto", "steady", "default"}))
      ->capture_default_str()
      ->group("Processes");
  app.add_flag("--no-shard", c.no_shard,
               "train in one process with plain LibTorch, no fsdp-cpp (the parity reference)")
      ->group("Processes");
  app.add_flag("--reshard-after-forward,!--no-reshard-after-forward", c.reshard_after_forward,
               "blocks free their gathered parameters after forward and gather again in backward "
               "(default on, all but the last block, which backward needs first; off: keep them "
               "until after backward, ZeRO-2-like)")
      ->group("Processes");
  app.add_option("--reshard-after-forward-world", c.reshard_after_forward_world,
                 "K: blocks keep 1/K of their gathered parameters after forward and gather them "
                 "within K consecutive ranks in backward (FSDP2's reshard_after_forward=K, hpZ: K "
                 "ranks per host keep the backward's all-gathers on the host); K divides the "
                 "ranks of a shard group; 0: off")
      ->group("Processes");
  app.add_option("--forward-prefetch", c.forward_prefetch,
                 "how forward starts the next block's all-gather: auto (the implicit prefetch), "
                 "off, or unshard (an explicit FSDPModule::unshard(true) of block i + 1 before "
                 "block i runs)")
      ->check(CLI::IsMember({"auto", "off", "unshard"}))
      ->capture_default_str()
      ->group("Processes");
  app.add_option("--ignored-params", c.ignored_params,
                 "comma-separated parameter names (e.g. ln_f.weight,ln_f.bias) left whole and "
                 "unmanaged on every rank (FSDP2's ignored_params): never gathered or reduced, "
                 "so each rank steps them with its own gradient and they drift apart; the model "
                 "is then built eagerly, not under deferred_init")
      ->group("Processes");
  app.add_option("--custom-collectives", c.custom_collectives,
                 "bf16-round: every group's all-gathers and reduce-scatters round their input to "
                 "bf16 on the wire (FSDP2's set_custom_all_gather / set_custom_reduce_scatter "
                 "with a compressing collective; the shards and the optimizer stay fp32); none: "
                 "the communicator's own")
      ->check(CLI::IsMember({"none", "bf16-round"}))
      ->capture_default_str()
      ->group("Processes");
  app.add_option("--quantize-gather", c.quantize_gather,
                 "bf16 or int8: all-gather the weights on a quantized wire (int8: one fp32 scale "
                 "per block of 128 values, ZeRO++'s qwZ; 0.5 and 0.26 of fp32's bytes), decoded "
                 "on every rank; the shards and AdamW stay fp32. none: exact")
      ->check(CLI::IsMember({"none", "bf16", "int8"}))
      ->capture_default_str()
      ->group("Processes");
  app.add_option("--quantize-reduce", c.quantize_reduce,
                 "bf16 or int8: reduce-scatter the gradients on a quantized wire, decoded and "
                 "summed in fp32 in rank order (Megatron's bf16 communication, ZeRO++'s qgZ). "
                 "none: exact")
      ->check(CLI::IsMember({"none", "bf16", "int8"}))
      ->capture_default_str()
      ->group("Processes");
  app.add_option("--verify-collectives", c.verify_collectives,
                 "check the contents of every all-gather and reduce-scatter (docs/"
                 "verified_collectives.md): on (a rotating 1/8 of each per step, every byte "
                 "within 8 steps), full (every byte of every step) or off")
      ->check(CLI::IsMember({"on", "full", "off"}))
      ->capture_default_str()
      ->group("Processes");
  app.add_option("--shard-dim", c.shard_dim,
                 "1: shard every weight and embedding on dim 1 (columns) instead of dim 0 "
                 "(FSDP2's shard_placement_fn returning Shard(1)); 0: dim 0")
      ->capture_default_str()
      ->group("Processes");
  app.add_flag("--activation-checkpointing", c.activation_checkpointing,
               "blocks keep no activations after forward and recompute them in backward (less "
               "memory, about one more forward of compute; sharded runs only)")
      ->group("Processes");
  app.add_option("--mixed-precision", c.mixed_precision,
                 "bf16: gather parameters and compute in bfloat16 (half the all-gather and "
                 "reduce-scatter bytes; shards, optimizer state and the loss stay fp32); fp16 "
                 "needs CUDA; none: fp32")
      ->check(CLI::IsMember({"none", "bf16", "fp16"}))
      ->group("Processes");
  app.add_option("--mixed-precision-reduce", c.mixed_precision_reduce,
                 "with --mixed-precision bf16: the gradients' reduce-scatter (and the sum of "
                 "micro-batches without gradient sync) in fp32 instead of bf16 (FSDP2's "
                 "reduce_dtype, fp32 by default since torch 2.15); param: in the compute dtype")
      ->check(CLI::IsMember({"param", "fp32"}))
      ->capture_default_str()
      ->group("Processes");
  app.add_option("--hsdp", c.hsdp,
                 "HSDP: R replicas of N/R ranks each shard the model within their replica and "
                 "average gradients across replicas (R must divide the ranks; 1: plain FSDP)")
      ->group("Processes");

  app.add_option("--layers", c.layers, "transformer blocks")->group("Model");
  app.add_option("--heads", c.heads, "attention heads per block")->group("Model");
  app.add_option("--width", c.width, "embedding width (n_embd), divisible by --heads")
      ->group("Model");
  app.add_option("--seq", c.seq, "context length in tokens")->group("Model");
  app.add_option("--vocab", c.vocab,
                 "vocabulary size (256 for text; a .bin file needs its tokenizer's, e.g. 50257)")
      ->group("Model");
  add_model_options(app, c);
  add_training_options(app, c);
  add_output_options(app, c);
  check_integer_ranges(app);
}

// Sets one option from text as if it came from a config file.
void set_option(CLI::Option* opt, const std::string& where, const std::string& raw_key,
                const std::string& value) {
  opt->clear();
  opt->add_result(value);
  try {
    opt->run_callback();
  } catch (const CLI::Error& e) {
    throw Error(detail::cat(where, ": key '", raw_key, "' = '", value, "' is invalid: ", e.what()));
  }
}

// Applies the file's settings to the options the command line did not set.
void apply_config_file(App& a, const std::string& path) {
  for (const auto& [raw_key, value] : load_config_file(path)) {
    const std::string key = normalise_key(raw_key);
    CLI::Option* opt = key == "config" ? nullptr : a.app.get_option_no_throw("--" + key);
    FSDP_CHECK(opt != nullptr, "config file '", path, "': unknown key '", raw_key,
               "'; the keys are the long flags of fsdp-train without '--' (see fsdp-train --help)");
    if (opt->count() > 0) continue;  // the command line wins
    set_option(opt, "config file '" + path + "'", raw_key, value);
  }
}

}  // namespace

bool TrainConfig::was_set(const std::string& key) const {
  return std::find(explicit_keys.begin(), explicit_keys.end(), key) != explicit_keys.end();
}

std::string TrainConfig::to_json() const {
  nlohmann::ordered_json j;
  j["nproc"] = nproc;
  j["threads"] = threads;
  j["malloc"] = malloc_policy;
  j["no-shard"] = no_shard;
  j["reshard-after-forward"] = reshard_after_forward;
  j["reshard-after-forward-world"] = reshard_after_forward_world;
  j["forward-prefetch"] = forward_prefetch;
  j["shard-dim"] = shard_dim;
  j["ignored-params"] = ignored_params;
  j["custom-collectives"] = custom_collectives;
  j["quantize-gather"] = quantize_gather;
  j["quantize-reduce"] = quantize_reduce;
  j["verify-collectives"] = verify_collectives;
  j["activation-checkpointing"] = activation_checkpointing;
  j["mixed-precision"] = mixed_precision;
  j["mixed-precision-reduce"] = mixed_precision_reduce;
  j["hsdp"] = hsdp;
  j["layers"] = layers;
  j["heads"] = heads;
  j["width"] = width;
  j["seq"] = seq;
  j["vocab"] = vocab;
  add_model_settings(j, *this);
  j["steps"] = steps;
  j["batch"] = batch;
  j["lr"] = lr;
  j["warmup"] = warmup;
  j["min-lr-ratio"] = min_lr_ratio;
  j["weight-decay"] = weight_decay;
  j["beta1"] = beta1;
  j["beta2"] = beta2;
  j["eps"] = eps;
  j["seed"] = seed;
  j["grad-accum"] = grad_accum;
  j["clip"] = clip;
  j["optimizer"] = optimizer;
  j["data"] = data;
  j["data-order"] = data_order;
  j["val-fraction"] = val_fraction;
  j["eval-every"] = eval_every;
  j["eval-batches"] = eval_batches;
  j["run-dir"] = run_dir;
  j["log-every"] = log_every;
  j["quiet"] = quiet;
  j["sample-tokens"] = sample_tokens;
  j["prompt"] = prompt;
  j["temperature"] = temperature;
  j["peak-tflops"] = peak_tflops;
  j["save-every"] = save_every;
  j["keep-last"] = keep_last;
  j["async-save"] = async_save;
  j["resume"] = resume;
  j["init-from"] = init_from;
  return j.dump(2) + "\n";
}

ParseResult parse_args(const std::vector<std::string>& args) {
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return parse_args(static_cast<int>(argv.size()), argv.data());
}

ParseResult parse_args(int argc, const char* const* argv) {
  TrainConfig c;
  App a;
  add_options(a, c);
  ParseResult r;
  try {
    a.app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    r.message = a.app.help();
    return r;
  } catch (const CLI::CallForVersion& e) {
    r.message = e.what();
    return r;
  } catch (const CLI::ParseError& e) {
    r.exit_code = 2;
    r.message = detail::cat("fsdp-train: ", e.what(), "\nRun fsdp-train --help for the flags.");
    return r;
  }
  if (!a.config_file.empty()) apply_config_file(a, a.config_file);
  for (const CLI::Option* opt : a.app.get_options()) {
    if (opt->count() > 0 && !opt->get_lnames().empty())
      c.explicit_keys.push_back(opt->get_lnames().front());
  }
  c.config_file = a.config_file;
  c.validate();
  r.config = std::move(c);
  return r;
}

const std::vector<std::string>& resumable_keys() {
  // World size and layout (--hsdp: a checkpoint loads into any layout), schedule end,
  // evaluation, logging and outputs: none changes the model, the optimizer state or the training
  // stream (grad-accum splits the same batch differently). --mixed-precision is not here: the
  // shards stay fp32, but it changes the gradients, so a resumed run keeps the checkpoint's.
  // --optimizer: fused or torch, the same update and the same state either way.
  static const std::vector<std::string> keys = {"nproc",
                                                "threads",
                                                "malloc",
                                                "reshard-after-forward",
                                                "reshard-after-forward-world",
                                                "shard-dim",
                                                "activation-checkpointing",
                                                "verify-collectives",
                                                "hsdp",
                                                "steps",
                                                "min-lr-ratio",
                                                "grad-accum",
                                                "optimizer",
                                                "eval-every",
                                                "eval-batches",
                                                "run-dir",
                                                "log-every",
                                                "quiet",
                                                "sample-tokens",
                                                "prompt",
                                                "temperature",
                                                "peak-tflops",
                                                "save-every",
                                                "keep-last",
                                                "async-save",
                                                "resume",
                                                "init-from",
                                                "tokenizer",
                                                "data"};
  return keys;
}

TrainConfig merge_settings(const std::string& saved_json, const TrainConfig& given,
                           const std::vector<std::string>& overrides) {
  nlohmann::json merged;
  try {
    merged = nlohmann::json::parse(saved_json);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(detail::cat("saved settings are not valid JSON: ", e.what()));
  }
  FSDP_CHECK(merged.is_object(), "saved settings must be one JSON object, got ",
             merged.type_name());
  const nlohmann::json mine = nlohmann::json::parse(given.to_json());
  for (const auto& key : overrides)
    if (mine.contains(key)) merged[key] = mine[key];
  TrainConfig c;
  App a;
  add_options(a, c);
  const char* argv0[] = {"fsdp-train"};
  a.app.parse(1, argv0);
  for (const auto& [raw_key, value] : merged.items()) {
    const std::string key = normalise_key(raw_key);
    CLI::Option* opt = a.app.get_option_no_throw("--" + key);
    FSDP_CHECK(opt != nullptr, "saved settings: unknown key '", raw_key,
               "' (written by another version of fsdp-train?)");
    set_option(opt, "saved settings", raw_key, json_setting_text(value, "saved settings", key));
  }
  c.explicit_keys = given.explicit_keys;
  c.config_file = given.config_file;
  return c;
}

std::string default_data_path() {
  // The checkout this binary was built from: build/bin/fsdp-train -> ../../data/corpus.txt.
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    std::string p(exe, static_cast<size_t>(n));
    p = p.substr(0, p.find_last_of('/'));
    const std::string candidate =
        std::filesystem::path(p + "/../../data/corpus.txt").lexically_normal().string();
    if (std::ifstream(candidate).good()) return candidate;
  }
  return std::string(FSDP_SOURCE_DIR) + "/data/corpus.txt";
}

}  // namespace fsdp::train
