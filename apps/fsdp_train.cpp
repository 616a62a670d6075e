// fsdp-train: the reference trainer of fsdp-cpp and its main job (docs/trainer.md).
//
// Every input is checked here, before any rank starts work: flags and config file, the data file
// and its length, the batch split. Then either
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
#include "train/launch.h"
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
  TrainConfig cfg = std::move(*parsed.config);
  if (cfg.data.empty()) cfg.data = default_data_path();
  const Corpus corpus = Corpus::load(cfg.data, cfg.seq);

  const fsdp::RendezvousInfo rv = fsdp::parse_rendezvous_env();
  const bool launched = rv.source != "none";
  if (cfg.no_shard) {
    FSDP_CHECK(rv.world_size == 1, "--no-shard trains in one process, but the launcher (",
               rv.source, ") started ", rv.world_size,
               " ranks; run it directly, without the launcher");
    cfg.validate_world(1);
    install_stop_handlers();
    return run_training(cfg, corpus, nullptr);
  }
  if (!launched && cfg.nproc > 1) {
    cfg.validate_world(cfg.nproc);
    std::vector<std::string> args(argv + 1, argv + argc);
    if (!cfg.was_set("run-dir")) {
      // One run directory for all ranks, chosen before they start.
      args.push_back("--run-dir");
      args.push_back(cfg.resume.empty() ? default_run_dir() : cfg.resume);
    }
    exec_local_ranks(cfg.nproc, args);
  }
  cfg.validate_world(rv.world_size);
  install_stop_handlers();
  auto comm = fsdp::init_process_group();
  return run_training(cfg, corpus, comm);
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
