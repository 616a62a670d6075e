#include "train/hf_init.h"

#include <fsdp/checkpoint.h>
#include <fsdp/hf.h>

#include "train/model_setup.h"

namespace fsdp::train {

void resolve_model_source(TrainConfig& cfg) {
  if (cfg.init_from.empty() || !is_model_directory(cfg.init_from)) return;
  take_model_from_config(cfg, hf::read_config_text(cfg.init_from), cfg.init_from + "/config.json");
  cfg.validate();
  hf::check_llama_weights(cfg.init_from, llama_config_of(cfg));
}

void init_model_from(const TrainConfig& cfg, TrainModel& model) {
  if (is_model_directory(cfg.init_from))
    hf::load_llama(cfg.init_from, model.root);
  else
    checkpoint::init_from(cfg.init_from, model.root);
}

}  // namespace fsdp::train
