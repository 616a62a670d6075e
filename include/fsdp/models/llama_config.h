// The shape of a Llama-architecture model (fsdp::models::Llama), and its Hugging Face form: the
// `config.json` of a transformers LlamaForCausalLM directory, read (refusing what the model does
// not implement, naming the key) and written back. Torch-free, so that programs can check a model
// directory before any rank starts. Thread-safety: plain values.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace fsdp::models {

// Rotary embedding frequencies (transformers' rope_type): "default" (inv_freq = theta^(-2i/d)),
// "linear" (inv_freq / factor) or "llama3" (Llama 3.1's: low frequencies / factor, high ones kept,
// a smooth ramp between, from the original context length).
struct RopeScaling {
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3
};

struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t hidden_size = 128;               // C
  int64_t intermediate_size = 0;           // the SwiGLU width; 0: ffn_default(hidden_size)
  int64_t num_hidden_layers = 4;           // L
  int64_t num_attention_heads = 4;         // H
  int64_t num_key_value_heads = 0;         // Hkv, dividing H (grouped-query attention); 0: H
  int64_t head_dim = 0;                    // D; 0: C / H
  int64_t max_position_embeddings = 2048;  // recorded for transformers; RoPE has no table
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;  // the output head is the token embedding (no lm_head)
  // The padding token: its embedding row gets no gradient (torch's padding_idx), as in
  // transformers. None: every row trains.
  std::optional<int64_t> pad_token_id;

  int64_t kv_heads() const {
    return num_key_value_heads > 0 ? num_key_value_heads : num_attention_heads;
  }
  int64_t dim_per_head() const {
    return head_dim > 0 ? head_dim : hidden_size / num_attention_heads;
  }
  int64_t ffn() const {
    return intermediate_size > 0 ? intermediate_size : ffn_default(hidden_size);
  }
  // Llama's rule for the SwiGLU width: 8C/3, rounded up to a multiple of 64.
  static int64_t ffn_default(int64_t hidden);
  // Parameters of the whole model (the tied head counted once).
  int64_t parameter_count() const;

  // Throws fsdp::Error naming the field: non-positive sizes, C not divisible by H (without an
  // explicit head_dim), H not a multiple of Hkv, an odd head_dim (RoPE rotates pairs), an unknown
  // rope type or its parameters out of range.
  void validate() const;

  // From the text of a transformers config.json (`source` names it in messages). Accepts
  // transformers 4's `rope_theta`/`rope_scaling` and 5's `rope_parameters`. Refuses, naming the
  // key and its value: an architecture other than LlamaForCausalLM / model_type other than llama,
  // hidden_act other than silu, attention_bias or mlp_bias, partial_rotary_factor other than 1, a
  // rope type other than default, linear or llama3, a missing size.
  static LlamaConfig from_hf_json(const std::string& text, const std::string& source);
  // config.json for transformers: `base` (the original file's text, or empty) with every key the
  // model defines set from this config (both rope spellings, dtype float32), other keys kept
  // (bos/eos token ids, ...).
  std::string to_hf_json(const std::string& base = "") const;
};

}  // namespace fsdp::models
