// Per-step metrics of fsdp-train and their CSV file, RUN_DIR/metrics.csv:
//   step,loss,lr,tokens_per_s,step_time_s,peak_rss_mb
// step counts optimizer steps taken (1 = after the first update); loss is the mean cross-entropy
// over the global batch (the mean of the equal-sized rank means); tokens_per_s is global tokens
// (batch * seq) per second of that step; peak_rss_mb is the largest peak resident set over ranks.
// Thread-safety: a MetricsWriter is used by one thread.
#pragma once

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
};

inline constexpr const char* kMetricsHeader = "step,loss,lr,tokens_per_s,step_time_s,peak_rss_mb";

class MetricsWriter {
 public:
  // append = false: truncates and writes the header; true: appends (header only if new/empty),
  // after dropping any rows with step > keep_until (rows of a run that outlived its checkpoint).
  MetricsWriter(const std::string& path, bool append, int64_t keep_until = INT64_MAX);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const MetricsRow& row);  // one line, flushed
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

// Reads a metrics.csv written by MetricsWriter. Throws fsdp::Error naming the file and line.
std::vector<MetricsRow> read_metrics(const std::string& path);

// Peak resident set size of this process in MiB (getrusage ru_maxrss).
double peak_rss_mb();

}  // namespace fsdp::train
