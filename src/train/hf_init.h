// fsdp-train's side of Hugging Face model directories: --init-from DIR takes the model from
// DIR/config.json (checked, with every tensor's header, before any rank starts) and its weights,
// each rank reading only its rows (fsdp/hf.h); --init-from FILE loads a full safetensors file
// (fsdp::checkpoint::init_from). Thread-safety: call from the thread that trains.
#pragma once

#include "train/config.h"

namespace fsdp::train {

struct TrainModel;

// With --init-from naming a model directory: the settings of its config.json
// (take_model_from_config), then the check of its tensors against that Llama. Otherwise nothing.
// Throws fsdp::Error naming the directory, the key or the tensor.
void resolve_model_source(TrainConfig& cfg);

// Collective: the weights of --init-from (a model directory or a full safetensors file) into the
// sharded model.
void init_model_from(const TrainConfig& cfg, TrainModel& model);

}  // namespace fsdp::train
