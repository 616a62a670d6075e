// --model and the Llama's settings of fsdp-train (model_select.h).
#include "train/model_select.h"

#include <fsdp/error.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <filesystem>
#include <sstream>

#include "train/config.h"

namespace fsdp::train {

void add_model_options(CLI::App& app, TrainConfig& c) {
  app.add_option("--model", c.model,
                 "gpt: the GPT-2-style byte-level model; llama: a Llama (RMSNorm, rotary "
                 "embeddings, SwiGLU, grouped-query attention; --init-from a Hugging Face model "
                 "directory selects it)")
      ->check(CLI::IsMember({"gpt", "llama"}))
      ->capture_default_str()
      ->group("Model");
  app.add_option("--kv-heads", c.llama.kv_heads,
                 "llama: key/value heads, dividing --heads (grouped-query attention); 0: --heads")
      ->group("Model");
  app.add_option("--ffn", c.llama.ffn, "llama: SwiGLU width; 0: 8 x width / 3 rounded up to 64")
      ->group("Model");
  app.add_option("--rope-theta", c.llama.rope_theta, "llama: rotary embedding base")
      ->group("Model");
  app.add_option("--norm-eps", c.llama.norm_eps, "llama: RMSNorm epsilon")->group("Model");
  app.add_flag("--tie-embeddings,!--no-tie-embeddings", c.llama.tie_embeddings,
               "llama: the output head is the token embedding (no lm_head)")
      ->group("Model");
  app.add_option("--tokenizer", c.tokenizer,
                 "tokenizer.json (or a model directory holding one) of the data's tokenizer: the "
                 "closing sample of token data is shown as text too")
      ->group("Outputs");
}

void add_model_settings(nlohmann::ordered_json& j, const TrainConfig& c) {
  j["model"] = c.model;
  j["kv-heads"] = c.llama.kv_heads;
  j["ffn"] = c.llama.ffn;
  j["rope-theta"] = c.llama.rope_theta;
  j["norm-eps"] = c.llama.norm_eps;
  j["tie-embeddings"] = c.llama.tie_embeddings;
  j["tokenizer"] = c.tokenizer;
}

void check_model(const TrainConfig& c) {
  FSDP_CHECK(c.model == "gpt" || c.model == "llama", "--model is '", c.model,
             "'; expected gpt or llama");
  if (c.model == "gpt") return;
  FSDP_CHECK(c.llama.kv_heads >= 0 && c.llama.ffn >= 0, "--kv-heads ", c.llama.kv_heads,
             " / --ffn ", c.llama.ffn, ": use 0 (the default) or a positive size");
  const int64_t kv = c.llama.kv_heads > 0 ? c.llama.kv_heads : c.heads;
  FSDP_CHECK(c.heads % kv == 0, "--heads ", c.heads, " is not a multiple of --kv-heads ", kv,
             "; each key/value head serves the same number of query heads: e.g. --kv-heads ",
             c.heads);
  FSDP_CHECK(c.llama.rope_theta > 0 && std::isfinite(c.llama.rope_theta), "--rope-theta is ",
             c.llama.rope_theta, "; it must be a positive base, e.g. 10000 or 500000");
  FSDP_CHECK(c.llama.norm_eps > 0, "--norm-eps is ", c.llama.norm_eps, "; it must be positive");
  if (c.hf_config.empty())  // a model directory's head_dim may differ from width / heads
    FSDP_CHECK((c.width / c.heads) % 2 == 0, "--width ", c.width, " / --heads ", c.heads, " = ",
               c.width / c.heads,
               " channels per head, an odd number; rotary embeddings rotate pairs: choose an "
               "even width per head");
}

models::LlamaConfig llama_config_of(const TrainConfig& cfg) {
  models::LlamaConfig m;
  if (!cfg.hf_config.empty()) {
    m = models::LlamaConfig::from_hf_json(cfg.hf_config, "the model's config.json");
  } else {
    m.num_hidden_layers = cfg.layers;
    m.num_attention_heads = cfg.heads;
    m.num_key_value_heads = cfg.llama.kv_heads;
    m.intermediate_size = cfg.llama.ffn;
    m.rms_norm_eps = cfg.llama.norm_eps;
    m.rope_theta = cfg.llama.rope_theta;
    m.tie_word_embeddings = cfg.llama.tie_embeddings;
    m.max_position_embeddings = cfg.seq;
  }
  m.vocab_size = cfg.vocab;
  m.hidden_size = cfg.width;
  m.validate();
  return m;
}

bool is_model_directory(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec);
}

namespace {

// The file's value wins; a flag given explicitly with another value is an error.
template <class T>
void take(TrainConfig& cfg, const char* flag, T& setting, T value, const char* key,
          const std::string& source) {
  if (cfg.was_set(flag) && setting != value) {
    std::ostringstream given, file;
    given << setting;
    file << value;
    throw Error(detail::cat("--", flag, " ", given.str(), " differs from ", source, "'s ", key, " ",
                            file.str(), ": the model comes from --init-from ", cfg.init_from,
                            "; drop --", flag));
  }
  setting = value;
}

}  // namespace

void take_model_from_config(TrainConfig& cfg, const std::string& config_text,
                            const std::string& source) {
  const auto m = models::LlamaConfig::from_hf_json(config_text, source);
  FSDP_CHECK(!(cfg.was_set("model") && cfg.model != "llama"), "--model ", cfg.model,
             " with --init-from ", cfg.init_from,
             ", a Hugging Face Llama directory; drop --model "
             "(a model directory is always --model llama)");
  cfg.model = "llama";
  take(cfg, "layers", cfg.layers, m.num_hidden_layers, "num_hidden_layers", source);
  take(cfg, "heads", cfg.heads, m.num_attention_heads, "num_attention_heads", source);
  take(cfg, "width", cfg.width, m.hidden_size, "hidden_size", source);
  take(cfg, "vocab", cfg.vocab, m.vocab_size, "vocab_size", source);
  take(cfg, "kv-heads", cfg.llama.kv_heads, m.kv_heads(), "num_key_value_heads", source);
  take(cfg, "ffn", cfg.llama.ffn, m.ffn(), "intermediate_size", source);
  take(cfg, "rope-theta", cfg.llama.rope_theta, m.rope_theta, "rope_theta", source);
  take(cfg, "norm-eps", cfg.llama.norm_eps, m.rms_norm_eps, "rms_norm_eps", source);
  take(cfg, "tie-embeddings", cfg.llama.tie_embeddings, m.tie_word_embeddings,
       "tie_word_embeddings", source);
  cfg.hf_config = config_text;
}

}  // namespace fsdp::train
