#include "train/model_size.h"

#include <fsdp/error.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace fsdp::train {
namespace {

constexpr double kFloat = 4;  // fp32 bytes

double block_parameters(const TrainConfig& c) {
  const double C = static_cast<double>(c.width);
  if (c.model == "llama") {  // the decoder layers' share of LlamaConfig::parameter_count
    auto m = llama_config_of(c);
    const double all = static_cast<double>(m.parameter_count());
    m.num_hidden_layers = 0;
    return (all - static_cast<double>(m.parameter_count())) / static_cast<double>(c.layers);
  }
  return 12 * C * C + 13 * C;
}

double root_parameters(const TrainConfig& c) {
  const double C = static_cast<double>(c.width);
  if (c.model == "llama") {  // embedding, final norm, head: no position table
    auto m = llama_config_of(c);
    m.num_hidden_layers = 0;
    return static_cast<double>(m.parameter_count());
  }
  return (static_cast<double>(c.vocab) + static_cast<double>(c.seq)) * C + 2 * C;
}

}  // namespace

double parameter_count(const TrainConfig& c) {
  return static_cast<double>(c.layers) * block_parameters(c) + root_parameters(c);
}

double flops_per_token(const TrainConfig& c) {
  const double C = static_cast<double>(c.width), T = static_cast<double>(c.seq);
  // The GPT's position embedding is a lookup (the Llama has none).
  const double n = parameter_count(c) - (c.model == "llama" ? 0 : T * C);
  return 6 * n + 12 * static_cast<double>(c.layers) * C * T;
}

MemoryEstimate estimate_memory(const TrainConfig& c, int world_size) {
  const bool sharded = !c.no_shard && world_size > 1;
  const double n = sharded ? static_cast<double>(world_size) : 1.0;
  // Under --hsdp the state is sharded over one replica's ranks only.
  const double shards = sharded ? static_cast<double>(std::max(1, world_size / c.hsdp)) : 1.0;
  MemoryEstimate m;
  // Parameter, gradient and two AdamW moments per (sharded) parameter (fp32 with bf16 too).
  m.state_bytes = 4 * kFloat * parameter_count(c) / shards;
  // Gathered: the root and up to two blocks (prefetch), each with its unsharded gradients and a
  // reduce-scatter buffer.
  if (sharded) m.gathered_bytes = kFloat * (3 * root_parameters(c) + 6 * block_parameters(c));
  // Saved for backward per token and block: about 29 C values (LayerNorms, q/k/v, projections,
  // the 4C MLP and its GELU) and 3 H T attention scores; the logits (V per token) three times.
  const double rows = static_cast<double>(c.batch) / n / static_cast<double>(c.grad_accum);
  const double tokens = rows * static_cast<double>(c.seq);
  const double C = static_cast<double>(c.width);
  const double per_block = 29 * C + 3 * static_cast<double>(c.heads) * static_cast<double>(c.seq);
  m.activation_bytes =
      kFloat * tokens *
      (static_cast<double>(c.layers) * per_block + 3 * static_cast<double>(c.vocab));
  m.runtime_bytes = 200.0 * (1 << 20);
  return m;
}

double mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream ss(line.substr(13));
    double kib = 0;
    ss >> kib;
    return kib * 1024;
  }
  return 0;
}

std::string format_bytes(double b) {
  char buf[48];
  if (b >= 1024.0 * 1024 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f TiB", b / (1024.0 * 1024 * 1024 * 1024));
  else if (b >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f GiB", b / (1024.0 * 1024 * 1024));
  else
    std::snprintf(buf, sizeof buf, "%.0f MiB", b / (1024.0 * 1024));
  return buf;
}

void check_memory_bounds(const TrainConfig& c, int world_size, int local_ranks, double available) {
  if (available <= 0) return;
  const MemoryEstimate m = estimate_memory(c, world_size);
  const double need = m.total() * local_ranks;
  if (need <= available) return;
  // The model is what must shrink when even one sequence per rank would not fit.
  TrainConfig one_row = c;
  one_row.batch = world_size;
  one_row.grad_accum = 1;
  const bool model_dominates =
      estimate_memory(one_row, world_size).total() * local_ranks > available;
  char params[32];
  std::snprintf(params, sizeof params, "%.3g", parameter_count(c));
  std::ostringstream os;
  os << "the settings need about " << format_bytes(m.total()) << " per rank (parameters and AdamW "
     << "state " << format_bytes(m.state_bytes + m.gathered_bytes) << " for " << params
     << " parameters from --layers " << c.layers << ", --width " << c.width << ", --vocab "
     << c.vocab << "; activations " << format_bytes(m.activation_bytes) << " from --batch "
     << c.batch << ", --seq " << c.seq << ", --grad-accum " << c.grad_accum << "), " << local_ranks
     << " rank" << (local_ranks == 1 ? "" : "s") << " on this machine need " << format_bytes(need)
     << ", but only " << format_bytes(available) << " are available (MemAvailable); ";
  if (model_dominates)
    os << "lower --layers or --width (even one sequence per rank would not fit)";
  else
    os << "lower --batch or --seq, or raise --grad-accum (the activations are too large)";
  throw Error(os.str());
}

}  // namespace fsdp::train
