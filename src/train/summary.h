// The closing summary that rank 0 prints: steps, time, model, losses (training and validation),
// throughput and MFU, peak memory per rank, the generated sample and where the outputs are.
// Torch-free. Thread-safety: stateless.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "train/config.h"

namespace fsdp::train {

struct Summary {
  int64_t steps_done = 0;
  int64_t first_step = 0;
  double first_loss = NAN;
  double final_loss = NAN;
  double mean_last = NAN;  // over the last min(10, steps) steps
  double val_loss = NAN;   // the last evaluation; NaN: none
  int64_t val_step = 0;
  double tokens_per_s = 0;
  double mfu = NAN;
  double peak_tflops = 0;  // per rank, measured or given
  bool peak_measured = false;
  double wall_s = 0;
  std::vector<double> peak_rss_mb;  // per rank
  std::string sample;
  std::string sample_prompt;  // how the prompt is shown; empty: cfg.prompt, text before the sample
  std::string checkpoints;    // the checkpoints' line ("  checkpoints   ...\n"), or empty
};

// "GPT 4 layers x 128 wide, 4 heads, seq 64, vocab 256, 0.83M params" (a Llama also names its
// key/value heads and SwiGLU width).
std::string model_description(const TrainConfig& cfg, int64_t params);

// The summary text (ends with a newline).
std::string format_summary(const TrainConfig& cfg, const Summary& s, int world, int64_t params,
                           bool stopped);

}  // namespace fsdp::train
