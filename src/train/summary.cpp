#include "train/summary.h"

#include <cstdio>
#include <sstream>

#include "train/generate.h"
#include "train/progress.h"

namespace fsdp::train {

std::string model_description(const TrainConfig& cfg, int64_t params) {
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "%s %lld layers x %lld wide, %lld heads, seq %lld, vocab %lld, %.2fM params",
                cfg.model == "llama" ? "Llama" : "GPT", static_cast<long long>(cfg.layers),
                static_cast<long long>(cfg.width), static_cast<long long>(cfg.heads),
                static_cast<long long>(cfg.seq), static_cast<long long>(cfg.vocab),
                static_cast<double>(params) / 1e6);
  std::string d = buf;
  if (cfg.model == "llama") {
    const auto m = llama_config_of(cfg);
    d += ", " + std::to_string(m.kv_heads()) + " kv heads, SwiGLU " + std::to_string(m.ffn());
  }
  if (cfg.mixed_precision != "none") d += ", " + cfg.mixed_precision + " compute";
  if (cfg.mixed_precision_reduce == "fp32") d += ", fp32 reductions";
  if (cfg.hsdp > 1) d += ", HSDP " + std::to_string(cfg.hsdp) + " replicas";
  return d;
}

std::string format_summary(const TrainConfig& cfg, const Summary& s, int world, int64_t params,
                           bool stopped) {
  std::ostringstream os;
  char buf[320];
  std::snprintf(buf, sizeof buf, "fsdp-train: %s after %s: %lld/%lld steps on %d rank%s%s\n",
                stopped ? "stopped" : "done", format_duration(s.wall_s).c_str(),
                static_cast<long long>(s.first_step + s.steps_done),
                static_cast<long long>(cfg.steps), world, world == 1 ? "" : "s",
                cfg.no_shard ? " (--no-shard: plain LibTorch)" : " (fully sharded)");
  os << buf;
  os << "  model         " << model_description(cfg, params) << "\n";
  std::snprintf(buf, sizeof buf,
                "  final loss    %.4f (mean of the last steps %.4f; first step %.4f)\n",
                s.final_loss, s.mean_last, s.first_loss);
  os << buf;
  if (std::isfinite(s.val_loss)) {
    std::snprintf(buf, sizeof buf,
                  "  val loss      %.4f (after step %lld, %lld batches held out)\n", s.val_loss,
                  static_cast<long long>(s.val_step), static_cast<long long>(cfg.eval_batches));
    os << buf;
  }
  std::snprintf(
      buf, sizeof buf, "  throughput    %s tokens/s (global batch %lld x %lld tokens%s)",
      format_count(s.tokens_per_s).c_str(), static_cast<long long>(cfg.batch),
      static_cast<long long>(cfg.seq),
      cfg.grad_accum > 1 ? (", " + std::to_string(cfg.grad_accum) + " micro-batches").c_str() : "");
  os << buf;
  if (std::isfinite(s.mfu)) {
    std::snprintf(buf, sizeof buf, ", MFU %.1f%% of %.3g TFLOP/s per rank (%s)", 100 * s.mfu,
                  s.peak_tflops, s.peak_measured ? "measured" : "--peak-tflops");
    os << buf;
  }
  os << "\n  peak memory  ";
  for (size_t r = 0; r < s.peak_rss_mb.size(); ++r) {
    std::snprintf(buf, sizeof buf, " rank %zu: %.0f MiB%s", r, s.peak_rss_mb[r],
                  r + 1 < s.peak_rss_mb.size() ? "," : "");
    os << buf;
  }
  os << " (peak resident set)\n";
  os << s.checkpoints;
  if (!s.sample.empty() && !s.sample_prompt.empty()) {
    os << "  sample        " << s.sample_prompt << ", temperature " << cfg.temperature << ":\n";
    std::istringstream lines(s.sample);  // ids, and one_line() text (UTF-8 kept)
    for (std::string line; std::getline(lines, line);) os << "    | " << line << "\n";
  } else if (!s.sample.empty()) {
    os << "  sample        prompt \"" << printable(cfg.prompt) << "\", temperature "
       << cfg.temperature << ":\n";
    std::istringstream lines(printable(cfg.prompt + s.sample));
    for (std::string line; std::getline(lines, line);) os << "    | " << line << "\n";
  }
  os << "  outputs       " << cfg.run_dir
     << "/ (metrics.csv, metrics.jsonl, loss.svg, config.json)\n";
  return os.str();
}

}  // namespace fsdp::train
