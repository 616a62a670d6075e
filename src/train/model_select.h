// Which model fsdp-train trains (--model gpt | llama) and the Llama's own settings: their flags,
// their keys in config.json, their checks, and the fsdp::models::LlamaConfig they make (from the
// flags, or from a Hugging Face config.json when --init-from names a model directory or a resumed
// checkpoint carries one). Torch-free. Thread-safety: plain values.
#pragma once

#include <fsdp/models/llama_config.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace CLI {
class App;
}

namespace fsdp::train {

struct TrainConfig;

// The Llama's settings that the GPT does not have (--model llama). Sizes shared with the GPT
// (--layers, --heads, --width, --vocab) keep their flags.
struct LlamaFlags {
  int64_t kv_heads = 0;         // key/value heads (grouped-query attention); 0: --heads
  int64_t ffn = 0;              // SwiGLU width; 0: LlamaConfig::ffn_default(--width)
  double rope_theta = 10000.0;  // RoPE base
  double norm_eps = 1e-5;       // RMSNorm epsilon
  bool tie_embeddings = false;  // the output head is the token embedding
};

// --model and the Llama's flags, in the "Model" group.
void add_model_options(CLI::App& app, TrainConfig& c);
// Their keys in the settings JSON (TrainConfig::to_json).
void add_model_settings(nlohmann::ordered_json& j, const TrainConfig& c);
// --model's name and the Llama flags' ranges; throws fsdp::Error naming the flag.
void check_model(const TrainConfig& c);

// The Llama of the settings: cfg.hf_config (a transformers config.json) when set, else the flags.
models::LlamaConfig llama_config_of(const TrainConfig& cfg);

// --init-from DIR naming a Hugging Face model directory (one with config.json): whether it does.
bool is_model_directory(const std::string& path);
// Takes the model from a model directory's config.json text (`source` names it): --model llama,
// the sizes, the Llama flags and cfg.hf_config. A flag given explicitly with another value than
// the file's is an error naming both (the model comes from the directory); --model gpt too.
void take_model_from_config(TrainConfig& cfg, const std::string& config_text,
                            const std::string& source);

}  // namespace fsdp::train
