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

std::string format_double(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string file_extension(const std::string& path) {
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return "";
  std::string ext = path.substr(dot + 1);
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  return ext;
}

std::string read_text_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  FSDP_CHECK(in.good(), what, " '", path, "' cannot be opened (", std::strerror(errno),
             "); check the path");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The text CLI11 parses for one JSON setting; throws naming `where` for arrays and objects.
std::string json_setting_text(const nlohmann::json& value, const std::string& where,
                              const std::string& key) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "true" : "false";
  if (value.is_number_integer() || value.is_number_unsigned()) return value.dump();
  if (value.is_number_float()) return format_double(value.get<double>());
  throw Error(detail::cat(where, ": key '", key, "' has a ", value.type_name(),
                          " value; every setting is a string, number or boolean"));
}

// A config file flattened to key -> value text, in file order. Nested tables and arrays are errors:
// every setting is a scalar.
std::vector<std::pair<std::string, std::string>> load_config_file(const std::string& path) {
  const std::string text = read_text_file(path, "config file");
  const std::string ext = file_extension(path);
  std::vector<std::pair<std::string, std::string>> out;
  if (ext == "json") {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      throw Error(detail::cat("config file '", path, "' is not valid JSON: ", e.what()));
    }
    FSDP_CHECK(j.is_object(), "config file '", path,
               "' must hold one JSON object of settings, got ", j.type_name());
    for (const auto& [key, value] : j.items())
      out.emplace_back(key, json_setting_text(value, "config file '" + path + "'", key));
  } else if (ext == "toml") {
    toml::table tbl;
    try {
      tbl = toml::parse(text, path);
    } catch (const toml::parse_error& e) {
      std::ostringstream os;
      os << e.description() << " at line " << e.source().begin.line << ", column "
         << e.source().begin.column;
      throw Error(detail::cat("config file '", path, "' is not valid TOML: ", os.str()));
    }
    for (const auto& [k, node] : tbl) {
      const std::string key(k.str());
      std::string v;
      if (auto s = node.value_exact<std::string>()) {
        v = *s;
      } else if (auto b = node.value_exact<bool>()) {
        v = *b ? "true" : "false";
      } else if (auto i = node.value_exact<int64_t>()) {
        v = std::to_string(*i);
      } else if (auto d = node.value_exact<double>()) {
        v = format_double(*d);
      } else {
        throw Error(detail::cat("config file '", path, "': key '", key,
                                "' is a table, array or date; every setting is a string, number or "
                                "boolean"));
      }
      out.emplace_back(key, v);
    }
  } else {
    throw Error(detail::cat("config file '", path, "' has extension '.", ext,
                            "'; expected .json or .toml (the format is chosen by extension)"));
  }
  return out;
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
  app.add_option("--seed", c.seed, "seeds initialisation, data order and sampling")
      ->group("Optimisation");
  app.add_option("--grad-accum", c.grad_accum,
                 "micro-batches per optimizer step (gradient accumulation; the batch is unchanged)")
      ->group("Optimisation");
  app.add_option("--clip", c.clip,
                 "clip the global gradient 2-norm to NORM before each step (0: no clipping); the "
                 "norm before clipping is logged as grad_norm")
      ->group("Optimisation");

  app.add_option("--data", c.data,
                 "text (one byte per token) or .bin of uint16 tokens (empty: the shipped corpus)")
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
  app.add_option("--resume", c.resume,
                 "RUN_DIR: continue from its latest checkpoint with its settings; RUN_DIR/step_K: "
                 "from that one; auto: --run-dir's latest if it has one, else start")
      ->group("Checkpoints");
  app.add_option("--init-from", c.init_from,
                 "full safetensors file (e.g. a consolidated checkpoint) to initialise from")
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
  add_training_options(app, c);
  add_output_options(app, c);
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

void TrainConfig::validate() const {
  auto positive = [](const char* flag, int64_t v, const char* fix) {
    FSDP_CHECK(v > 0, "--", flag, " is ", v, "; it must be a positive integer (", fix, ")");
  };
  positive("nproc", nproc, "e.g. --nproc 2");
  positive("layers", layers, "e.g. --layers 4");
  positive("heads", heads, "e.g. --heads 4");
  positive("width", width, "e.g. --width 128");
  positive("seq", seq, "e.g. --seq 64");
  positive("steps", steps, "e.g. --steps 300");
  positive("batch", batch, "e.g. --batch 16");
  positive("vocab", vocab, "e.g. --vocab 256");
  positive("grad-accum", grad_accum, "1 = no accumulation");
  FSDP_CHECK(std::isfinite(clip) && clip >= 0, "--clip is ", clip,
             "; it must be a finite gradient norm >= 0 (e.g. --clip 1.0; 0 = no clipping)");
  FSDP_CHECK(!(activation_checkpointing && no_shard),
             "--activation-checkpointing applies to the sharded blocks, but --no-shard trains "
             "the plain model; drop one of the two");
  FSDP_CHECK(mixed_precision == "none" || mixed_precision == "bf16" || mixed_precision == "fp16",
             "--mixed-precision is '", mixed_precision, "'; expected bf16, fp16 or none");
  FSDP_CHECK(
      mixed_precision != "fp16",
      "--mixed-precision fp16 computes forward and backward in float16, which LibTorch "
      "1.13's CPU kernels lack (no Half LayerNorm or matmul; it would work on CUDA); this "
      "build trains on CPU: use --mixed-precision bf16 (the same bytes on the wire) or none");
  FSDP_CHECK(!(mixed_precision != "none" && no_shard), "--mixed-precision ", mixed_precision,
             " is a policy of the sharded model, but --no-shard trains the plain model; drop "
             "one of the two");
  FSDP_CHECK(hsdp >= 1, "--hsdp is ", hsdp,
             "; it must be a positive number of replicas that divides the ranks (1: plain FSDP)");
  FSDP_CHECK(!(hsdp > 1 && no_shard), "--hsdp ", hsdp,
             " shards within replicas, but --no-shard trains the plain model in one process; "
             "drop one of the two");
  positive("eval-batches", eval_batches, "e.g. --eval-batches 4");
  FSDP_CHECK(eval_every >= 0, "--eval-every is ", eval_every, "; use 0 (never) or a step count");
  FSDP_CHECK(keep_last >= 0, "--keep-last is ", keep_last, "; use 0 (keep all) or a count");
  FSDP_CHECK(val_fraction >= 0 && val_fraction <= 0.5, "--val-fraction is ", val_fraction,
             "; it must lie in [0, 0.5] (0: no validation split)");
  FSDP_CHECK(peak_tflops >= 0, "--peak-tflops is ", peak_tflops,
             "; use 0 (measured) or the peak of one rank");
  FSDP_CHECK(threads >= 0, "--threads is ", threads, "; use 0 (automatic) or a positive count");
  FSDP_CHECK(malloc_policy == "auto" || malloc_policy == "steady" || malloc_policy == "default",
             "--malloc is '", malloc_policy, "'; expected auto, steady or default");
  FSDP_CHECK(warmup >= 0, "--warmup is ", warmup, "; use 0 (no warmup) or a positive step count");
  FSDP_CHECK(log_every >= 0, "--log-every is ", log_every,
             "; use 0 (automatic) or a positive count");
  FSDP_CHECK(save_every >= 0, "--save-every is ", save_every, "; use 0 (never) or a step count");
  FSDP_CHECK(sample_tokens >= 0, "--sample-tokens is ", sample_tokens, "; use 0 (none) or a count");
  FSDP_CHECK(width % heads == 0, "--width ", width, " is not divisible by --heads ", heads,
             "; each head gets width/heads channels: choose e.g. --width ",
             (width / heads + 1) * heads, " or --heads that divides ", width);
  FSDP_CHECK(lr > 0, "--lr is ", lr, "; it must be positive, e.g. --lr 3e-3");
  FSDP_CHECK(min_lr_ratio >= 0 && min_lr_ratio <= 1, "--min-lr-ratio is ", min_lr_ratio,
             "; it must lie in [0, 1]");
  FSDP_CHECK(weight_decay >= 0, "--weight-decay is ", weight_decay, "; it must be >= 0");
  FSDP_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "--beta1 ", beta1, " / --beta2 ",
             beta2, ": each must lie in [0, 1)");
  FSDP_CHECK(eps > 0, "--eps is ", eps, "; it must be positive, e.g. 1e-8");
  FSDP_CHECK(temperature > 0, "--temperature is ", temperature, "; it must be positive, e.g. 0.8");
  FSDP_CHECK(data_order == "random" || data_order == "sequential", "--data-order is '", data_order,
             "'; expected 'random' or 'sequential'");
  FSDP_CHECK(!(no_shard && was_set("nproc") && nproc != 1),
             "--no-shard runs one process without "
             "fsdp-cpp, but --nproc ",
             nproc, " was given; drop one of the two");
  FSDP_CHECK(!no_shard || (save_every == 0 && resume.empty() && init_from.empty()),
             "--no-shard runs plain LibTorch without fsdp-cpp, so it has no sharded checkpoints; "
             "drop --save-every/--resume/--init-from, or use --nproc 1 for a one-rank sharded run");
  FSDP_CHECK(resume != "auto" || !run_dir.empty(),
             "--resume auto continues the run in --run-dir if it holds a checkpoint, else starts "
             "it there; give --run-dir DIR");
  if (!resume.empty() && resume != "auto" && !run_dir.empty()) {
    namespace fs = std::filesystem;
    const auto norm = [](std::string p) {
      while (p.size() > 1 && p.back() == '/') p.pop_back();
      return fs::path(p).lexically_normal().string();
    };
    const std::string parent = fs::path(norm(resume)).parent_path().string();
    FSDP_CHECK(norm(run_dir) == norm(resume) || norm(run_dir) == parent, "--resume '", resume,
               "' and --run-dir '", run_dir,
               "' differ; a resumed run continues in its own directory: drop --run-dir");
  }
  FSDP_CHECK(resume.empty() || init_from.empty(), "--resume '", resume, "' and --init-from '",
             init_from, "' both given; a resumed run already has its weights: drop --init-from");
}

void TrainConfig::validate_world(int world_size) const {
  FSDP_CHECK(world_size % hsdp == 0, "--hsdp ", hsdp, " does not divide the ", world_size,
             " ranks; each replica must hold the same number of ranks: choose --hsdp that "
             "divides ",
             world_size, " (1: plain FSDP) or an --nproc that is a multiple of ", hsdp);
  FSDP_CHECK(batch % world_size == 0, "--batch ", batch, " is not divisible by the ", world_size,
             " ranks; the global batch is split evenly: use a multiple of ", world_size,
             " (e.g. --batch ", (batch / world_size + 1) * world_size, ") or another --nproc");
  const int64_t split = world_size * grad_accum;
  FSDP_CHECK(batch % split == 0, "--batch ", batch, " is not divisible by ", world_size,
             " ranks x --grad-accum ", grad_accum, " = ", split,
             " micro-batches; use a multiple of ", split, " (e.g. --batch ",
             (batch / split + 1) * split, ") or another --grad-accum");
}

std::string TrainConfig::to_json() const {
  nlohmann::ordered_json j;
  j["nproc"] = nproc;
  j["threads"] = threads;
  j["malloc"] = malloc_policy;
  j["no-shard"] = no_shard;
  j["reshard-after-forward"] = reshard_after_forward;
  j["activation-checkpointing"] = activation_checkpointing;
  j["mixed-precision"] = mixed_precision;
  j["hsdp"] = hsdp;
  j["layers"] = layers;
  j["heads"] = heads;
  j["width"] = width;
  j["seq"] = seq;
  j["vocab"] = vocab;
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
  static const std::vector<std::string> keys = {"nproc",
                                                "threads",
                                                "malloc",
                                                "reshard-after-forward",
                                                "activation-checkpointing",
                                                "hsdp",
                                                "steps",
                                                "min-lr-ratio",
                                                "grad-accum",
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
                                                "resume",
                                                "init-from",
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
