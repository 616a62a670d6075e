// LlamaConfig: validation and the transformers config.json form (llama_config.h).
#include <fsdp/error.h>
#include <fsdp/models/llama_config.h>

#include <cmath>
#include <nlohmann/json.hpp>

namespace fsdp::models {
namespace {

using nlohmann::json;

// An integer key; `fallback` when absent or null, an error naming the key when required.
int64_t int_key(const json& j, const char* key, std::optional<int64_t> fallback,
                const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) {
    FSDP_CHECK(fallback.has_value(), source, ": '", key,
               "' is missing; a Llama config.json gives every size of the model");
    return *fallback;
  }
  FSDP_CHECK(j[key].is_number_integer(), source, ": '", key, "' is ", j[key].dump(),
             "; expected an integer");
  return j[key].get<int64_t>();
}

double number_key(const json& j, const char* key, double fallback, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  FSDP_CHECK(j[key].is_number(), source, ": '", key, "' is ", j[key].dump(), "; expected a number");
  return j[key].get<double>();
}

// Refuses a key whose value is not the one fsdp-cpp's Llama computes.
void require(const json& j, const char* key, const json& wanted, const std::string& source,
             const char* why) {
  if (!j.contains(key) || j[key].is_null() || j[key] == wanted) return;
  throw Error(detail::cat(source, ": '", key, "' is ", j[key].dump(), "; fsdp::models::Llama ", why,
                          " (", key, " = ", wanted.dump(), ")"));
}

void check_architecture(const json& j, const std::string& source) {
  const bool has_arch = j.contains("architectures") && j["architectures"].is_array();
  FSDP_CHECK(has_arch || j.contains("model_type"), source,
             ": neither 'architectures' nor 'model_type' is given; fsdp-cpp reads the config.json "
             "of a transformers LlamaForCausalLM");
  if (has_arch) {
    bool llama = false;
    for (const auto& a : j["architectures"]) llama = llama || a == "LlamaForCausalLM";
    FSDP_CHECK(llama, source, ": 'architectures' is ", j["architectures"].dump(),
               "; fsdp-cpp implements LlamaForCausalLM only (model_type llama)");
  }
  if (j.contains("model_type"))
    FSDP_CHECK(j["model_type"] == "llama", source, ": 'model_type' is ", j["model_type"].dump(),
               "; fsdp-cpp implements the Llama architecture only (model_type llama)");
}

// transformers 5's rope_parameters, or 4's rope_theta and rope_scaling.
void read_rope(const json& j, LlamaConfig& c, const std::string& source) {
  json params = json::object();
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    params = j["rope_parameters"];
  } else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) {
    params = j["rope_scaling"];
  }
  c.rope_theta =
      number_key(params, "rope_theta", number_key(j, "rope_theta", 10000.0, source), source);
  std::string type = "default";
  for (const char* key : {"rope_type", "type"})
    if (params.contains(key) && params[key].is_string()) type = params[key].get<std::string>();
  FSDP_CHECK(type == "default" || type == "linear" || type == "llama3", source, ": rope type '",
             type,
             "' (rope_parameters / rope_scaling) is not implemented; fsdp::models::Llama has "
             "default, linear and llama3");
  c.rope_scaling.type = type;
  c.rope_scaling.factor = number_key(params, "factor", 1.0, source);
  c.rope_scaling.low_freq_factor = number_key(params, "low_freq_factor", 1.0, source);
  c.rope_scaling.high_freq_factor = number_key(params, "high_freq_factor", 4.0, source);
  c.rope_scaling.original_max_position_embeddings =
      int_key(params, "original_max_position_embeddings", c.max_position_embeddings, source);
  require(params, "partial_rotary_factor", 1.0, source, "rotates every dimension of a head");
  require(j, "partial_rotary_factor", 1.0, source, "rotates every dimension of a head");
}

}  // namespace

int64_t LlamaConfig::ffn_default(int64_t hidden) {
  const int64_t raw = (8 * hidden + 2) / 3;
  return (raw + 63) / 64 * 64;
}

int64_t LlamaConfig::parameter_count() const {
  const int64_t c = hidden_size, d = dim_per_head(), h = num_attention_heads, kv = kv_heads();
  const int64_t attention = c * h * d * 2 + c * kv * d * 2;  // q, o; k, v
  const int64_t block = attention + 3 * c * ffn() + 2 * c;   // + SwiGLU + two norms
  return num_hidden_layers * block + vocab_size * c * (tie_word_embeddings ? 1 : 2) + c;
}

void LlamaConfig::validate() const {
  auto positive = [](const char* name, int64_t v) {
    FSDP_CHECK(v > 0, "Llama config: ", name, " must be positive, got ", v);
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("max_position_embeddings", max_position_embeddings);
  FSDP_CHECK(intermediate_size >= 0 && num_key_value_heads >= 0 && head_dim >= 0,
             "Llama config: intermediate_size ", intermediate_size, ", num_key_value_heads ",
             num_key_value_heads, ", head_dim ", head_dim,
             " must not be negative (0: the default)");
  FSDP_CHECK(head_dim > 0 || hidden_size % num_attention_heads == 0, "Llama config: hidden_size ",
             hidden_size, " is not divisible by num_attention_heads ", num_attention_heads,
             "; choose a width that is a multiple of the heads (or give head_dim)");
  FSDP_CHECK(num_attention_heads % kv_heads() == 0, "Llama config: num_attention_heads ",
             num_attention_heads, " is not a multiple of num_key_value_heads ", kv_heads(),
             "; each key/value head serves the same number of query heads");
  FSDP_CHECK(dim_per_head() % 2 == 0, "Llama config: head_dim ", dim_per_head(),
             " is odd; rotary embeddings rotate pairs of dimensions");
  FSDP_CHECK(rms_norm_eps > 0 && rope_theta > 0, "Llama config: rms_norm_eps ", rms_norm_eps,
             " and rope_theta ", rope_theta, " must be positive");
  const auto& r = rope_scaling;
  FSDP_CHECK(r.type == "default" || r.type == "linear" || r.type == "llama3",
             "Llama config: rope type '", r.type, "'; expected default, linear or llama3");
  FSDP_CHECK(r.factor > 0, "Llama config: rope factor ", r.factor, " must be positive");
  FSDP_CHECK(
      r.type != "llama3" || (r.high_freq_factor > r.low_freq_factor && r.low_freq_factor > 0 &&
                             r.original_max_position_embeddings > 0),
      "Llama config: llama3 rope needs high_freq_factor (", r.high_freq_factor,
      ") > low_freq_factor (", r.low_freq_factor,
      ") > 0 and a positive original_max_position_embeddings");
  FSDP_CHECK(!pad_token_id || (*pad_token_id >= 0 && *pad_token_id < vocab_size),
             "Llama config: pad_token_id ", pad_token_id.value_or(0),
             " is outside the vocabulary of ", vocab_size);
}

LlamaConfig LlamaConfig::from_hf_json(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(detail::cat(source, " is not valid JSON: ", e.what()));
  }
  FSDP_CHECK(j.is_object(), source, " must hold one JSON object, got ", j.type_name());
  check_architecture(j, source);
  require(j, "hidden_act", "silu", source, "computes SwiGLU with SiLU");
  require(j, "attention_bias", false, source, "has no attention biases");
  require(j, "mlp_bias", false, source, "has no MLP biases");
  LlamaConfig c;
  c.vocab_size = int_key(j, "vocab_size", std::nullopt, source);
  c.hidden_size = int_key(j, "hidden_size", std::nullopt, source);
  c.intermediate_size = int_key(j, "intermediate_size", std::nullopt, source);
  c.num_hidden_layers = int_key(j, "num_hidden_layers", std::nullopt, source);
  c.num_attention_heads = int_key(j, "num_attention_heads", std::nullopt, source);
  c.num_key_value_heads = int_key(j, "num_key_value_heads", c.num_attention_heads, source);
  c.head_dim =
      int_key(j, "head_dim", c.hidden_size / std::max<int64_t>(1, c.num_attention_heads), source);
  c.max_position_embeddings = int_key(j, "max_position_embeddings", 2048, source);
  c.rms_norm_eps = number_key(j, "rms_norm_eps", 1e-6, source);
  read_rope(j, c, source);
  if (j.contains("tie_word_embeddings") && !j["tie_word_embeddings"].is_null()) {
    FSDP_CHECK(j["tie_word_embeddings"].is_boolean(), source, ": 'tie_word_embeddings' is ",
               j["tie_word_embeddings"].dump(), "; expected true or false");
    c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  if (j.contains("pad_token_id") && !j["pad_token_id"].is_null())
    c.pad_token_id = int_key(j, "pad_token_id", std::nullopt, source);
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(detail::cat(source, ": ", std::string(e.what()).substr(6)));  // drop "fsdp: "
  }
  return c;
}

std::string LlamaConfig::to_hf_json(const std::string& base) const {
  json j = base.empty() ? json::object() : json::parse(base);
  j["architectures"] = json::array({"LlamaForCausalLM"});
  j["model_type"] = "llama";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = ffn();
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = kv_heads();
  j["head_dim"] = dim_per_head();
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["pad_token_id"] = pad_token_id ? json(*pad_token_id) : json(nullptr);
  // transformers 5 reads rope_parameters; 4 reads rope_theta and rope_scaling (a 4 that found
  // only rope_parameters would silently use theta 10000): both.
  json params = {{"rope_type", rope_scaling.type}, {"rope_theta", rope_theta}};
  if (rope_scaling.type != "default") params["factor"] = rope_scaling.factor;
  if (rope_scaling.type == "llama3") {
    params["low_freq_factor"] = rope_scaling.low_freq_factor;
    params["high_freq_factor"] = rope_scaling.high_freq_factor;
    params["original_max_position_embeddings"] = rope_scaling.original_max_position_embeddings;
  }
  j["rope_parameters"] = params;
  j["rope_theta"] = rope_theta;
  if (rope_scaling.type == "default") {
    j["rope_scaling"] = nullptr;
  } else {
    json scaling = params;
    scaling.erase("rope_theta");
    j["rope_scaling"] = scaling;
  }
  j["dtype"] = "float32";  // the weights fsdp-cpp writes
  j.erase("torch_dtype");
  return j.dump(2) + "\n";
}

}  // namespace fsdp::models
