// A transformers model directory: config.json, which safetensors file holds which tensor, and the
// check of its tensors against a LlamaConfig by their headers (fsdp/hf.h).
#include <fsdp/error.h>
#include <fsdp/hf.h>
#include <fsdp/safetensors.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/checkpoint_common.h"
#include "hf/hf_internal.h"

namespace fsdp::hf {

namespace fs = std::filesystem;
using checkpoint::internal::join;
using checkpoint::internal::shape_str;
using detail::cat;

namespace internal {

bool skipped_name(const std::string& name, const models::LlamaConfig& cfg) {
  if (cfg.tie_word_embeddings && name == "lm_head.weight") return true;  // the embedding again
  const std::string rotary = "rotary_emb.inv_freq";  // older files: computed here
  return name.size() >= rotary.size() &&
         name.compare(name.size() - rotary.size(), rotary.size(), rotary) == 0;
}

bool readable_dtype(const std::string& dtype) {
  return dtype == "F32" || dtype == "BF16" || dtype == "F16" || dtype == "F64";
}

safetensors::File& Files::open(const std::string& path) {
  auto& f = open_[path];
  if (!f) f = safetensors::File::open(path);
  return *f;
}

}  // namespace internal

std::string read_config_text(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::error_code ec;
  FSDP_CHECK(fs::is_directory(dir, ec), "Hugging Face model directory '", dir,
             "' is not a directory; pass the directory save_pretrained wrote (config.json and "
             "model*.safetensors)");
  FSDP_CHECK(fs::exists(path, ec), "'", dir,
             "' has no config.json; pass the directory transformers' save_pretrained wrote");
  return safetensors::read_text(path, 1 << 20);
}

models::LlamaConfig read_llama_config(const std::string& dir) {
  return models::LlamaConfig::from_hf_json(read_config_text(dir), dir + "/config.json");
}

std::map<std::string, std::string> weight_files(const std::string& dir) {
  std::map<std::string, std::string> out;
  const std::string index = dir + "/model.safetensors.index.json";
  const std::string single = dir + "/model.safetensors";
  std::error_code ec;
  if (fs::exists(index, ec)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(safetensors::read_text(index, 64 << 20));
    } catch (const nlohmann::json::parse_error& e) {
      throw Error(cat(index, " is not valid JSON: ", e.what()));
    }
    FSDP_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), index,
               " has no 'weight_map' object (tensor name -> file name)");
    for (const auto& [name, file] : j["weight_map"].items()) {
      FSDP_CHECK(file.is_string(), index, ": weight_map['", name, "'] is ", file.dump(),
                 "; expected a file name");
      const std::string f = file.get<std::string>();
      // A file of this directory only: no path that leaves it.
      FSDP_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..", index,
                 ": weight_map['", name, "'] is '", f,
                 "'; expected the name of a file in the same directory");
      FSDP_CHECK(fs::exists(dir + "/" + f, ec), index, " puts '", name, "' in '", f,
                 "', which is missing from ", dir, "; copy the whole directory");
      out[name] = dir + "/" + f;
    }
    return out;
  }
  FSDP_CHECK(fs::exists(single, ec), "'", dir,
             "' holds neither model.safetensors nor model.safetensors.index.json; fsdp-cpp reads "
             "safetensors weights (save_pretrained's default; convert a pytorch_model.bin with "
             "transformers: model.save_pretrained(dir, safe_serialization=True))");
  const auto file = safetensors::File::open(single);
  for (const auto& t : file->header().tensors) out[t.name] = single;
  return out;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> llama_tensors(
    const models::LlamaConfig& cfg) {
  const int64_t c = cfg.hidden_size, q = cfg.num_attention_heads * cfg.dim_per_head(),
                kv = cfg.kv_heads() * cfg.dim_per_head(), f = cfg.ffn();
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  out.push_back({"model.embed_tokens.weight", {cfg.vocab_size, c}});
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    const std::string p = cat("model.layers.", i, ".");
    out.push_back({p + "self_attn.q_proj.weight", {q, c}});
    out.push_back({p + "self_attn.k_proj.weight", {kv, c}});
    out.push_back({p + "self_attn.v_proj.weight", {kv, c}});
    out.push_back({p + "self_attn.o_proj.weight", {c, q}});
    out.push_back({p + "mlp.gate_proj.weight", {f, c}});
    out.push_back({p + "mlp.up_proj.weight", {f, c}});
    out.push_back({p + "mlp.down_proj.weight", {c, f}});
    out.push_back({p + "input_layernorm.weight", {c}});
    out.push_back({p + "post_attention_layernorm.weight", {c}});
  }
  out.push_back({"model.norm.weight", {c}});
  if (!cfg.tie_word_embeddings) out.push_back({"lm_head.weight", {cfg.vocab_size, c}});
  return out;
}

namespace internal {

void check_names(const std::string& dir, const std::map<std::string, std::string>& files,
                 const std::set<std::string>& wanted, const models::LlamaConfig& cfg) {
  std::vector<std::string> missing, unexpected;
  for (const auto& name : wanted)
    if (!files.count(name)) missing.push_back(name);
  for (const auto& [name, file] : files)
    if (!wanted.count(name) && !skipped_name(name, cfg)) unexpected.push_back(name);
  FSDP_CHECK(missing.empty(), "Hugging Face model '", dir, "' lacks ", missing.size(), " of the ",
             wanted.size(), " tensors of its config.json's Llama: ", join(missing),
             "; the weights do not belong to this config (or a save was interrupted)");
  FSDP_CHECK(unexpected.empty(), "Hugging Face model '", dir,
             "' holds tensors the Llama of its "
             "config.json does not have: ",
             join(unexpected),
             "; it is another architecture or variant (biases, a vision tower, ...), which "
             "fsdp::models::Llama does not implement");
}

void check_tensor(const std::string& path, const safetensors::TensorMeta& m,
                  const std::vector<int64_t>& shape) {
  FSDP_CHECK(readable_dtype(m.dtype), path, ": tensor '", m.name, "' is ", m.dtype,
             "; fsdp-cpp reads F32, BF16, F16 and F64 weights");
  FSDP_CHECK(m.shape == shape, path, ": tensor '", m.name, "' has shape ", shape_str(m.shape),
             ", the model of config.json needs ", shape_str(shape),
             "; the weights do not belong to this config");
}

}  // namespace internal

void check_llama_weights(const std::string& dir, const models::LlamaConfig& cfg) {
  const auto files = weight_files(dir);
  const auto tensors = llama_tensors(cfg);
  std::set<std::string> wanted;
  for (const auto& [name, shape] : tensors) wanted.insert(name);
  internal::check_names(dir, files, wanted, cfg);
  internal::Files open;
  for (const auto& [name, shape] : tensors) {
    const std::string& path = files.at(name);
    internal::check_tensor(path, open.open(path).tensor(name), shape);
  }
}

}  // namespace fsdp::hf
