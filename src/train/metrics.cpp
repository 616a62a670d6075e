#include "train/metrics.h"

#include <fsdp/error.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/atomic_file.h"
#include "train/plot.h"

namespace fsdp::train {
namespace {

std::string csv_line(const MetricsRow& r) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%lld,%.9g,%.9g,%.6g,%.6g,%.1f,", static_cast<long long>(r.step),
                r.loss, r.lr, r.tokens_per_s, r.step_time_s, r.peak_rss_mb);
  std::string s = buf;
  if (std::isfinite(r.val_loss)) {
    std::snprintf(buf, sizeof buf, "%.9g", r.val_loss);
    s += buf;
  }
  s += ",";
  if (std::isfinite(r.mfu)) {
    std::snprintf(buf, sizeof buf, "%.6g", r.mfu);
    s += buf;
  }
  s += ",";
  if (std::isfinite(r.grad_norm)) {
    std::snprintf(buf, sizeof buf, "%.9g", r.grad_norm);
    s += buf;
  }
  return s + "\n";
}

std::string json_line(const MetricsRow& r) {
  nlohmann::ordered_json j;
  j["step"] = r.step;
  j["loss"] = r.loss;
  j["lr"] = r.lr;
  j["tokens_per_s"] = r.tokens_per_s;
  j["step_time_s"] = r.step_time_s;
  j["peak_rss_mb"] = r.peak_rss_mb;
  if (std::isfinite(r.val_loss)) j["val_loss"] = r.val_loss;
  if (std::isfinite(r.mfu)) j["mfu"] = r.mfu;
  if (std::isfinite(r.grad_norm)) j["grad_norm"] = r.grad_norm;
  return j.dump() + "\n";
}

// Empty or unparsable field -> NaN for the optional columns.
bool parse_field(const std::string& text, double& out) {
  if (text.empty()) {
    out = NAN;
    return true;
  }
  char* end = nullptr;
  out = std::strtod(text.c_str(), &end);
  return end != text.c_str() && *end == '\0';
}

std::FILE* open_append(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "a");
  FSDP_CHECK(f != nullptr, "metrics file '", path, "' cannot be written (", std::strerror(errno),
             "); check that the run directory is writable");
  return f;
}

}  // namespace

std::string jsonl_path(const std::string& csv_path) {
  const auto dot = csv_path.rfind(".csv");
  return (dot == std::string::npos ? csv_path : csv_path.substr(0, dot)) + ".jsonl";
}

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
  // The kept rows (or just the header) replace the files atomically: a crash here leaves either
  // the old files or the new ones.
  std::string csv = std::string(kMetricsHeader) + "\n", jsonl;
  for (const auto& r : kept) {
    csv += csv_line(r);
    jsonl += json_line(r);
  }
  fsdp::write_text_atomic(path, csv);
  fsdp::write_text_atomic(jsonl_path(path), jsonl);
  csv_ = open_append(path);
  jsonl_ = open_append(jsonl_path(path));
}

MetricsWriter::~MetricsWriter() {
  if (csv_) std::fclose(csv_);
  if (jsonl_) std::fclose(jsonl_);
}

void MetricsWriter::write(const MetricsRow& r) {
  std::fputs(csv_line(r).c_str(), csv_);
  std::fflush(csv_);
  std::fputs(json_line(r).c_str(), jsonl_);
  std::fflush(jsonl_);
}

std::vector<MetricsRow> read_metrics(const std::string& path) {
  std::ifstream in(path);
  FSDP_CHECK(in.good(), "metrics file '", path, "' cannot be opened (", std::strerror(errno), ")");
  std::string line;
  std::getline(in, line);
  const bool v1 = line == kMetricsHeaderV1, v2 = line == kMetricsHeaderV2;
  FSDP_CHECK(v1 || v2 || line == kMetricsHeader, "metrics file '", path, "' line 1 is '", line,
             "'; expected the header '", kMetricsHeader, "'");
  const size_t columns = v1 ? 6 : v2 ? 8 : 9;
  const char* header = v1 ? kMetricsHeaderV1 : v2 ? kMetricsHeaderV2 : kMetricsHeader;
  std::vector<MetricsRow> rows;
  for (int lineno = 2; std::getline(in, line); ++lineno) {
    if (line.empty()) continue;
    std::vector<std::string> fields;
    std::stringstream ss(line);
    for (std::string f; std::getline(ss, f, ',');) fields.push_back(f);
    if (!line.empty() && line.back() == ',') fields.emplace_back();
    std::vector<double> v(columns, NAN);
    bool ok = fields.size() == columns;
    for (size_t i = 0; ok && i < columns; ++i)
      ok = parse_field(fields[i], v[i]) && (i >= 6 || std::isfinite(v[i]) || fields[i] != "");
    FSDP_CHECK(ok, "metrics file '", path, "' line ", lineno, " ('", line, "') does not have the ",
               columns, " columns ", header);
    MetricsRow r;
    r.step = static_cast<int64_t>(v[0]);
    r.loss = v[1];
    r.lr = v[2];
    r.tokens_per_s = v[3];
    r.step_time_s = v[4];
    r.peak_rss_mb = v[5];
    if (!v1) {
      r.val_loss = v[6];
      r.mfu = v[7];
    }
    if (columns > 8) r.grad_norm = v[8];
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
