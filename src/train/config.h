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

namespace fsdp::train {

struct TrainConfig {
  // ---- processes ----
  int nproc = 2;          // local ranks started when no launcher variables are set
  int threads = 0;        // intra-op threads per rank; 0 = cores / local ranks (at least 1)
  bool no_shard = false;  // one process, plain LibTorch (the parity reference)
  bool reshard_after_forward = true;  // blocks free gathered parameters after forward
  // ---- model ----
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 128;  // n_embd
  int64_t seq = 64;     // context length T
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
  uint64_t seed = 1337;
  // ---- data ----
  std::string data;                   // empty = the shipped corpus (data/corpus.txt)
  std::string data_order = "random";  // "random" or "sequential" (docs/trainer.md, Data order)
  // ---- outputs ----
  std::string run_dir;    // empty = runs/<timestamp>
  int64_t log_every = 0;  // plain progress line every k steps; 0 = about 25 lines per run
  bool quiet = false;
  int64_t sample_tokens = 200;  // bytes generated at the end; 0 = none
  std::string prompt = "And God said";
  double temperature = 0.8;
  // ---- checkpoints (issue 6) ----
  int64_t save_every = 0;  // 0 = never
  std::string resume;      // run directory to resume from (its latest complete checkpoint)
  std::string init_from;   // full safetensors file to initialise the model from
  // ---- bookkeeping ----
  std::string config_file;                 // --config, for the record
  std::vector<std::string> explicit_keys;  // keys given by flag or file (not defaults)

  bool was_set(const std::string& key) const;
  // Throws fsdp::Error naming the first invalid setting (value, expectation, fix). Does not touch
  // the file system (see data.h for the corpus checks).
  void validate() const;
  // The checks that need the number of ranks: the batch must split evenly.
  void validate_world(int world_size) const;
  // The resolved settings as JSON text with the same keys (loadable again with --config).
  std::string to_json() const;
};

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
