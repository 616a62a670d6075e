// fsdp-checkpoint: offline tools for fsdp-cpp's sharded checkpoints (docs/checkpoint.md), one
// process, no ranks:
//   fsdp-checkpoint consolidate CKPT OUT.safetensors   every parameter whole in one file
//   fsdp-checkpoint export CKPT OUT_DIR                a Llama as a transformers directory
// CKPT is a step directory (RUN/step_00000300) or a run directory (its newest complete
// checkpoint, as --resume takes it).
#include <fsdp/checkpoint.h>
#include <fsdp/error.h>
#include <fsdp/hf.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace {

namespace fs = std::filesystem;

// A step directory as given, or a run directory's newest complete checkpoint.
std::string checkpoint_dir(const std::string& path) {
  std::error_code ec;
  FSDP_CHECK(fs::is_directory(path, ec), "'", path,
             "' is not a directory; pass a checkpoint (RUN/step_00000300) or a run directory");
  if (fs::exists(fs::path(path) / fsdp::checkpoint::kIndexFile, ec)) return path;
  const auto scan = fsdp::checkpoint::scan(path);
  for (const auto& s : scan.skipped)
    std::fprintf(stderr, "fsdp-checkpoint: skipping %s: %s\n", s.path.c_str(), s.reason.c_str());
  FSDP_CHECK(scan.latest.has_value(), "'", path,
             "' holds no complete checkpoint (no index.json, no complete step_* directory)");
  std::fprintf(stderr, "fsdp-checkpoint: using %s\n", scan.latest->c_str());
  return *scan.latest;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  FSDP_CHECK(in.good(), "--config '", path, "' cannot be opened");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int run(int argc, char** argv) {
  CLI::App app{"fsdp-checkpoint: offline tools for fsdp-cpp's sharded checkpoints",
               "fsdp-checkpoint"};
  app.require_subcommand(1);
  std::string ckpt, out, config;
  double max_shard_mb = 5 * 1024;

  auto* consolidate = app.add_subcommand(
      "consolidate",
      "write every parameter and buffer of a checkpoint whole into one safetensors file (no "
      "optimizer state), which PyTorch's safetensors loads");
  consolidate->add_option("checkpoint", ckpt, "step directory, or a run directory (its newest)")
      ->required();
  consolidate->add_option("output", out, "the .safetensors file to write")->required();

  auto* exporter = app.add_subcommand(
      "export",
      "write a checkpoint of a Llama as a Hugging Face directory (config.json, "
      "model*.safetensors, fp32) that transformers' AutoModelForCausalLM.from_pretrained loads");
  exporter->add_option("checkpoint", ckpt, "step directory, or a run directory (its newest)")
      ->required();
  exporter->add_option("output", out, "the directory to create (must not exist, or be empty)")
      ->required();
  exporter->add_option("--config", config,
                       "the model's config.json, for a checkpoint that carries none (fsdp-train's "
                       "checkpoints of --model llama carry theirs)");
  exporter
      ->add_option("--max-shard-mb", max_shard_mb,
                   "largest safetensors file in MiB; more make model-0000K-of-0000N files")
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const std::string dir = checkpoint_dir(ckpt);
  if (consolidate->parsed()) {
    fsdp::checkpoint::consolidate(dir, out);
    std::printf("fsdp-checkpoint: wrote %s from %s\n", out.c_str(), dir.c_str());
    return 0;
  }
  FSDP_CHECK(max_shard_mb > 0, "--max-shard-mb is ", max_shard_mb, "; it must be positive");
  std::string text =
      config.empty() ? fsdp::hf::checkpoint_config(dir).value_or("") : read_file(config);
  FSDP_CHECK(!text.empty(), "checkpoint '", dir,
             "' carries no model configuration (it was not saved by fsdp-train --model llama); "
             "pass the model's config.json with --config FILE");
  const auto cfg = fsdp::models::LlamaConfig::from_hf_json(text, config.empty() ? dir : config);
  fsdp::hf::ExportOptions options;
  options.max_shard_bytes = static_cast<uint64_t>(max_shard_mb * 1024 * 1024);
  fsdp::hf::export_llama(dir, out, cfg, text, options);
  std::printf("fsdp-checkpoint: wrote %s from %s (Llama, %lld layers, %.2fM parameters)\n",
              out.c_str(), dir.c_str(), static_cast<long long>(cfg.num_hidden_layers),
              static_cast<double>(cfg.parameter_count()) / 1e6);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "fsdp-checkpoint: error: %s\n", e.what());
    return 1;
  }
}
