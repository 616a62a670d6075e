// Writing a transformers directory from a sharded checkpoint of a Llama (fsdp/hf.h).
#include <ATen/ATen.h>
#include <fsdp/checkpoint.h>
#include <fsdp/error.h>
#include <fsdp/hf.h>
#include <fsdp/safetensors_torch.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/atomic_file.h"
#include "checkpoint/checkpoint_common.h"
#include "checkpoint/reader.h"
#include "hf/hf_internal.h"

namespace fsdp::hf {

namespace fs = std::filesystem;
namespace st = fsdp::safetensors;
using checkpoint::internal::CheckpointReader;
using checkpoint::internal::join;
using checkpoint::internal::shape_str;
using detail::cat;

namespace {

// The checkpoint's parameters must be exactly the Llama of `cfg`, in shape; returns them in
// transformers' order, each with its byte size as fp32.
std::vector<std::pair<std::string, uint64_t>> planned_tensors(const CheckpointReader& rd,
                                                              const models::LlamaConfig& cfg) {
  std::vector<std::pair<std::string, uint64_t>> out;
  std::vector<std::string> missing, unexpected;
  std::set<std::string> wanted;
  for (const auto& [name, shape] : llama_tensors(cfg)) {
    wanted.insert(name);
    const checkpoint::IndexEntry* e = rd.index().find(name);
    if (!e) {
      missing.push_back(name);
      continue;
    }
    FSDP_CHECK(e->global_shape == shape, "checkpoint '", rd.dir(), "': '", name, "' has shape ",
               shape_str(e->global_shape), ", the Llama of the config needs ", shape_str(shape),
               "; export the checkpoint with the config of the run that saved it");
    uint64_t numel = 1;
    for (int64_t d : shape) numel *= static_cast<uint64_t>(d);
    out.push_back({name, 4 * numel});
  }
  for (const auto& e : rd.index().tensors)
    if (e.name.find("::") == std::string::npos && !wanted.count(e.name))
      unexpected.push_back(e.name);
  FSDP_CHECK(missing.empty() && unexpected.empty(), "checkpoint '", rd.dir(),
             "' is not the Llama of the config: ",
             missing.empty() ? "" : cat("missing ", join(missing), "; "),
             unexpected.empty() ? "" : cat("not in a Llama: ", join(unexpected), "; "),
             "export a checkpoint of fsdp::models::Llama with the config it was trained with");
  return out;
}

// Consecutive runs of tensors of at most max_bytes each (a larger tensor alone).
std::vector<std::vector<std::pair<std::string, uint64_t>>> split_files(
    const std::vector<std::pair<std::string, uint64_t>>& tensors, uint64_t max_bytes) {
  std::vector<std::vector<std::pair<std::string, uint64_t>>> files(1);
  uint64_t bytes = 0;
  for (const auto& t : tensors) {
    if (!files.back().empty() && bytes + t.second > max_bytes) {
      files.emplace_back();
      bytes = 0;
    }
    files.back().push_back(t);
    bytes += t.second;
  }
  return files;
}

std::string shard_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buf;
}

// One output file: its tensors read whole from the checkpoint, as fp32.
void write_file(CheckpointReader& rd, const std::vector<std::pair<std::string, uint64_t>>& tensors,
                const std::string& path) {
  std::vector<at::Tensor> keep;
  std::vector<st::TensorView> views;
  for (const auto& [name, bytes] : tensors) {
    const checkpoint::IndexEntry& e = *rd.index().find(name);
    rd.check_pieces(e);
    at::Tensor full = at::empty(
        e.global_shape, at::TensorOptions().dtype(st::scalar_type(e.dtype, rd.dir(), e.name)));
    rd.fill(e, full, 0, 0);
    keep.push_back(full.to(at::kFloat).contiguous());
    views.push_back(st::view_of(name, keep.back()));
  }
  st::write(path, views, {{"format", "pt"}});
}

void write_all_files(CheckpointReader& rd, const std::string& tmp, const models::LlamaConfig& cfg,
                     const ExportOptions& options) {
  const auto files = split_files(planned_tensors(rd, cfg), options.max_shard_bytes);
  if (files.size() == 1) {
    write_file(rd, files[0], tmp + "/model.safetensors");
    return;
  }
  nlohmann::ordered_json index;
  uint64_t total = 0;
  for (size_t k = 0; k < files.size(); ++k) {
    write_file(rd, files[k], tmp + "/" + shard_name(k, files.size()));
    for (const auto& [name, bytes] : files[k]) {
      index["weight_map"][name] = shard_name(k, files.size());
      total += bytes;
    }
  }
  index["metadata"] = {{"total_size", total}};
  write_text_atomic(tmp + "/model.safetensors.index.json", index.dump(2) + "\n");
}

}  // namespace

std::optional<std::string> checkpoint_config(const std::string& ckpt_dir) {
  CheckpointReader rd(ckpt_dir);
  const auto& extra = rd.index().state.extra;
  if (!extra.is_object() || !extra.contains("hf_config") || !extra["hf_config"].is_object())
    return std::nullopt;
  return extra["hf_config"].dump(2) + "\n";
}

void export_llama(const std::string& ckpt_dir, const std::string& out_dir,
                  const models::LlamaConfig& cfg, const std::string& base_config,
                  const ExportOptions& options) {
  cfg.validate();
  FSDP_CHECK(options.max_shard_bytes > 0, "export: max_shard_bytes must be positive");
  std::error_code ec;
  FSDP_CHECK(
      !fs::exists(out_dir, ec) || (fs::is_directory(out_dir, ec) && fs::is_empty(out_dir, ec)),
      "export: '", out_dir,
      "' exists and is not an empty directory; choose a new directory (nothing is "
      "overwritten)");
  CheckpointReader rd(ckpt_dir);
  std::string parent = fs::path(out_dir).lexically_normal().parent_path().string();
  if (parent.empty()) parent = ".";
  fs::create_directories(parent, ec);
  const std::string tmp = cat(fs::path(out_dir).lexically_normal().string(), ".tmp.", ::getpid());
  fs::remove_all(tmp, ec);
  FSDP_CHECK(fs::create_directory(tmp, ec), "export: cannot create '", tmp, "' (", ec.message(),
             "); check that '", parent, "' is writable");
  try {
    write_all_files(rd, tmp, cfg, options);
    write_text_atomic(tmp + "/config.json", cfg.to_hf_json(base_config));
    if (fs::exists(out_dir, ec)) fs::remove(out_dir, ec);  // the empty directory it replaces
    fs::rename(tmp, out_dir, ec);
    FSDP_CHECK(!ec, "export: cannot rename '", tmp, "' to '", out_dir, "' (", ec.message(),
               "); nothing was written to '", out_dir, "'");
    fsync_dir(parent);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

}  // namespace fsdp::hf
