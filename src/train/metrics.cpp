#include "train/metrics.h"

#include <fsdp/error.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace fsdp::train {

MetricsWriter::MetricsWriter(const std::string& path, bool append, int64_t keep_until)
    : path_(path) {
  std::vector<MetricsRow> kept;
  if (append) {
    std::ifstream probe(path);
    if (probe.good() && probe.peek() != std::ifstream::traits_type::eof()) {
      for (const auto& r : read_metrics(path))
        if (r.step <= keep_until) kept.push_back(r);
    }
  }
  f_ = std::fopen(path.c_str(), "w");
  FSDP_CHECK(f_ != nullptr, "metrics file '", path, "' cannot be written (", std::strerror(errno),
             "); check that the run directory is writable");
  std::fprintf(f_, "%s\n", kMetricsHeader);
  for (const auto& r : kept) write(r);
  std::fflush(f_);
}

MetricsWriter::~MetricsWriter() {
  if (f_) std::fclose(f_);
}

void MetricsWriter::write(const MetricsRow& r) {
  std::fprintf(f_, "%lld,%.9g,%.9g,%.6g,%.6g,%.1f\n", static_cast<long long>(r.step), r.loss, r.lr,
               r.tokens_per_s, r.step_time_s, r.peak_rss_mb);
  std::fflush(f_);
}

std::vector<MetricsRow> read_metrics(const std::string& path) {
  std::ifstream in(path);
  FSDP_CHECK(in.good(), "metrics file '", path, "' cannot be opened (", std::strerror(errno), ")");
  std::string line;
  std::getline(in, line);
  FSDP_CHECK(line == kMetricsHeader, "metrics file '", path, "' line 1 is '", line,
             "'; expected the header '", kMetricsHeader, "'");
  std::vector<MetricsRow> rows;
  for (int lineno = 2; std::getline(in, line); ++lineno) {
    if (line.empty()) continue;
    MetricsRow r;
    long long step = 0;
    const int n = std::sscanf(line.c_str(), "%lld,%lf,%lf,%lf,%lf,%lf", &step, &r.loss, &r.lr,
                              &r.tokens_per_s, &r.step_time_s, &r.peak_rss_mb);
    FSDP_CHECK(n == 6, "metrics file '", path, "' line ", lineno, " ('", line,
               "') does not have the 6 numeric columns ", kMetricsHeader);
    r.step = step;
    rows.push_back(r);
  }
  return rows;
}

double peak_rss_mb() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // Linux: KiB
}

}  // namespace fsdp::train
