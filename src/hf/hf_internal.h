// Shared by the reading and writing sides of Hugging Face directories (src/hf/). Internal.
// Thread-safety: as fsdp/hf.h.
#pragma once

#include <fsdp/models/llama_config.h>
#include <fsdp/safetensors.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace fsdp::hf::internal {

// Names a file may hold that the model does not need: a tied model's lm_head.weight, computed
// rotary tables.
bool skipped_name(const std::string& name, const models::LlamaConfig& cfg);
bool readable_dtype(const std::string& dtype);  // F32, BF16, F16, F64

// safetensors files opened once each, by path.
class Files {
 public:
  safetensors::File& open(const std::string& path);

 private:
  std::map<std::string, std::unique_ptr<safetensors::File>> open_;
};

// Throws naming every tensor of `wanted` the directory lacks, then every one it holds that is
// neither wanted nor skipped.
void check_names(const std::string& dir, const std::map<std::string, std::string>& files,
                 const std::set<std::string>& wanted, const models::LlamaConfig& cfg);
// Throws naming the tensor when its dtype is not readable or its shape is not `shape`.
void check_tensor(const std::string& path, const safetensors::TensorMeta& m,
                  const std::vector<int64_t>& shape);

}  // namespace fsdp::hf::internal
