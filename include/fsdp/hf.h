// Hugging Face model directories in and out of fsdp-cpp (docs/guide.md, "Hugging Face models").
//
// A transformers model directory holds config.json and its weights as safetensors: one
// model.safetensors, or shards model-0000K-of-0000N.safetensors listed by
// model.safetensors.index.json's weight_map. fsdp::models::Llama uses transformers' parameter
// names, so the names map one to one; the exceptions are lm_head.weight, which a tied model does
// not have (a file may hold it anyway: it is the embedding, and is skipped), and the rotary
// tables some older files carry (model.layers.K.self_attn.rotary_emb.inv_freq: computed, skipped).
//
//   auto cfg = fsdp::hf::read_llama_config(dir);
//   auto model = fsdp::deferred_init([&] { return fsdp::Sharded<fsdp::models::Llama>(cfg); });
//   auto root = fsdp::models::shard_llama(model, world);
//   fsdp::materialize(model);
//   fsdp::hf::load_llama(dir, root);     // each rank reads only the rows of its shards
//
// Thread-safety: load_llama on a sharded model is a collective (every rank, the same order);
// the rest is local and reentrant.
#pragma once

#include <fsdp/fully_shard.h>
#include <fsdp/models/llama_config.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace fsdp::hf {

// DIR/config.json as a LlamaConfig (LlamaConfig::from_hf_json's checks: an architecture other
// than LlamaForCausalLM is refused naming the key). Throws fsdp::Error naming the file.
models::LlamaConfig read_llama_config(const std::string& dir);
// DIR/config.json's text (kept for export: token ids and the other keys transformers reads).
std::string read_config_text(const std::string& dir);

// Which file holds each tensor: model.safetensors's, or model.safetensors.index.json's weight_map
// (every file it names must exist). Throws naming what is missing: neither file, or a shard.
std::map<std::string, std::string> weight_files(const std::string& dir);

// Checks, by reading only the headers, that DIR holds every tensor the model of `cfg` needs with
// its shape, in F32, BF16, F16 or F64, and nothing else (but the skipped names above). Throws
// naming each missing or unexpected tensor, or the first of the wrong shape or dtype.
void check_llama_weights(const std::string& dir, const models::LlamaConfig& cfg);

// Fills every parameter fully_shard manages below `root` (a Llama, sharded) from DIR: each rank
// reads only the rows of its own shards (a parameter sharded on another dim: the whole tensor,
// then its slice), converting bf16/fp16 to the parameter's dtype. The model is not materialised
// whole on any rank. Collective over root.communicator(): a failure on any rank (a missing
// tensor, a shape, an unreadable file) is raised on every rank, naming it.
void load_llama(const std::string& dir, const FSDPModule& root);
// The same into an unsharded model (every parameter whole).
void load_llama(const std::string& dir, torch::nn::Module& model);

struct ExportOptions {
  // A file holds at most this many bytes of tensors; more make shards
  // model-0000K-of-0000N.safetensors with model.safetensors.index.json (transformers' layout).
  uint64_t max_shard_bytes = 5ull << 30;
};

// Writes `out_dir` (which must not exist, or be empty) from the sharded checkpoint `ckpt_dir` (a
// step_* directory of fsdp::checkpoint::save of a Llama): config.json (`cfg` over `base_config`,
// LlamaConfig::to_hf_json) and the parameters, whole and fp32, under their transformers names
// (optimizer state left out). transformers' AutoModelForCausalLM.from_pretrained(out_dir) loads
// it unchanged. Written into a temporary directory beside out_dir, renamed when complete: a
// failure leaves no half-written out_dir. Offline, one process; holds one output file's tensors
// at a time. Throws fsdp::Error naming the problem.
void export_llama(const std::string& ckpt_dir, const std::string& out_dir,
                  const models::LlamaConfig& cfg, const std::string& base_config = "",
                  const ExportOptions& options = {});

// The transformers config.json a checkpoint carries in its index's extra object ("hf_config", as
// fsdp-train writes it), or nullopt.
std::optional<std::string> checkpoint_config(const std::string& ckpt_dir);

// The names and shapes of the tensors transformers' LlamaForCausalLM of `cfg` has, in its order.
std::vector<std::pair<std::string, std::vector<int64_t>>> llama_tensors(
    const models::LlamaConfig& cfg);

}  // namespace fsdp::hf
