// Per-step metrics of fsdp-train and their files in the run directory:
//   metrics.csv    step,loss,lr,tokens_per_s,step_time_s,peak_rss_mb,val_loss,mfu,grad_norm
//   metrics.jsonl  one JSON object per step with the same keys (val_loss only where evaluated)
// step counts optimizer steps taken (1 = after the first update); loss is the mean cross-entropy
// over the global batch (the mean of the equal-sized rank means); tokens_per_s is global tokens
// (batch * seq) per second of that step; peak_rss_mb is the largest peak resident set over ranks;
// val_loss the validation loss after that step (empty when not evaluated); mfu the model FLOPs
// utilisation of the step (docs/trainer.md, "Metrics"); grad_norm the global gradient 2-norm
// before clipping (empty without --clip).
// Thread-safety: a MetricsWriter is used by one thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace fsdp::train {

struct MetricsRow {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;
  double tokens_per_s = 0;
  double step_time_s = 0;
  double peak_rss_mb = 0;
  double val_loss = NAN;   // NaN: not evaluated at this step
  double mfu = NAN;        // fraction of the peak FLOP/s; NaN: unknown
  double grad_norm = NAN;  // global gradient 2-norm before clipping (--clip); NaN: not clipped
};

inline constexpr const char* kMetricsHeader =
    "step,loss,lr,tokens_per_s,step_time_s,peak_rss_mb,val_loss,mfu,grad_norm";
// The header of files written before grad_norm existed (still readable).
inline constexpr const char* kMetricsHeaderV2 =
    "step,loss,lr,tokens_per_s,step_time_s,peak_rss_mb,val_loss,mfu";
// The header of files written before val_loss and mfu existed (still readable).
inline constexpr const char* kMetricsHeaderV1 = "step,loss,lr,tokens_per_s,step_time_s,peak_rss_mb";

class MetricsWriter {
 public:
  // Writes `csv_path` and, beside it, the same path with ".jsonl" for ".csv". append = false:
  // new files; true: keeps the rows with step <= keep_until of existing files (rows of a run that
  // outlived its checkpoint are dropped), rewritten atomically, then appends.
  MetricsWriter(const std::string& csv_path, bool append, int64_t keep_until = INT64_MAX);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const MetricsRow& row);  // one line in each file, flushed
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* csv_ = nullptr;
  std::FILE* jsonl_ = nullptr;
};

// Reads a metrics.csv written by MetricsWriter (either header). Throws fsdp::Error naming the
// file and line.
std::vector<MetricsRow> read_metrics(const std::string& path);

// metrics.jsonl beside metrics.csv.
std::string jsonl_path(const std::string& csv_path);

// Peak resident set size of this process in MiB (getrusage ru_maxrss).
double peak_rss_mb();

}  // namespace fsdp::train
