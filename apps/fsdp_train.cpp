// fsdp-train: the reference trainer of fsdp-cpp and its main job (docs/trainer.md).
//
// Every input is checked here, before any rank starts work: flags and config file, the checkpoint
// to resume from and the settings it brings, the data file, the batch split and the memory the
// settings need. Then either
//  - launcher variables are set (torchrun, mpirun, srun, fsdp-run): this process is one rank;
//  - none are set and --nproc > 1: this process becomes `fsdp-run -n N -- fsdp-train ARGS
//    --run-dir DIR`, which starts the ranks (and stops them all on Ctrl-C or a failure);
//  - --no-shard or --nproc 1: one process.
#include <fsdp/error.h>
#include <fsdp/init.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "train/config.h"
#include "train/data.h"
#include "train/hf_init.h"
#include "train/launch.h"
#include "train/malloc.h"
#include "train/model_size.h"
#include "train/resume.h"
#include "train/trainer.h"

namespace {

int run(int argc, char** argv) {
  using namespace fsdp::train;
  ParseResult parsed = parse_args(argc, argv);
  if (!parsed.config) {
    std::fputs(parsed.message.c_str(), parsed.exit_code == 0 ? stdout : stderr);
    std::fputc('\n', parsed.exit_code == 0 ? stdout : stderr);
    return parsed.exit_code;
  }
  RunPlan plan = plan_run(*parsed.config);  // with --resume: the checkpoint's settings
  TrainConfig& cfg = plan.cfg;
  resolve_model_source(cfg);  // --init-from a Hugging Face directory: its config.json's Llama
  // Before the big allocations; the ranks started below inherit it and apply it again. "auto" is
  // steady, but the default malloc in a sanitizer build (an explicit steady is refused there).
  if (resolve_malloc_policy(cfg.malloc_policy) == "steady") use_steady_malloc();
  if (cfg.data.empty()) cfg.data = default_data_path();
  const Corpus corpus = Corpus::load(cfg.data, cfg.seq, cfg.vocab);
  split_validation(corpus, cfg.val_fraction, cfg.seq);  // checks the split sizes

  const fsdp::RendezvousInfo rv = fsdp::parse_rendezvous_env();
  const bool launched = rv.source != "none";
  const int world = cfg.no_shard ? 1 : launched ? rv.world_size : cfg.nproc;
  FSDP_CHECK(!cfg.no_shard || rv.world_size == 1,
             "--no-shard trains in one process, but the launcher (", rv.source, ") started ",
             rv.world_size, " ranks; run it directly, without the launcher");
  cfg.validate_world(world);
  check_memory_bounds(cfg, world, launched ? local_ranks(world) : world, mem_available_bytes());
  if (cfg.no_shard) {
    install_stop_handlers();
    return run_training(plan, corpus, nullptr);
  }
  if (!launched && cfg.nproc > 1) {
    std::vector<std::string> args(argv + 1, argv + argc);
    if (!cfg.was_set("run-dir")) {
      // One run directory for all ranks, chosen before they start.
      args.push_back("--run-dir");
      args.push_back(cfg.run_dir.empty() ? default_run_dir() : cfg.run_dir);
    }
    exec_local_ranks(cfg.nproc, args);
  }
  install_stop_handlers();
  auto comm = fsdp::init_process_group();
  return run_training(plan, corpus, comm);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "fsdp-train: error: %s\n", e.what());
    return 1;
  }
}
