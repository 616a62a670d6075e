// Finding checkpoints in a run directory: defect / scan / latest, retention (keep_last) and the
// temporaries of killed saves. Local, no collectives, no torch headers beyond checkpoint.h's.
// Format and the reporting contract: docs/checkpoint.md ("Finding the latest checkpoint").
#include <c10/util/Exception.h>
#include <fsdp/checkpoint.h>

#include <algorithm>
#include <filesystem>

#include "checkpoint/atomic_file.h"

namespace fsdp::checkpoint {

namespace fs = std::filesystem;
namespace st = fsdp::safetensors;
using detail::cat;

namespace {

// The step_* directories of `dir`, newest first.
std::vector<std::pair<int64_t, std::string>> step_dirs(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> steps;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return steps;
  for (const auto& ent : fs::directory_iterator(dir, ec)) {
    std::string name = ent.path().filename().string();
    if (name.rfind("step_", 0) != 0 || name.size() <= 5 || name.size() > 5 + 18) continue;
    if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    if (!ent.is_directory(ec)) continue;
    steps.emplace_back(std::stoll(name.substr(5)), ent.path().string());
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

std::string without_prefix(std::string what) {
  return what.rfind("fsdp: ", 0) == 0 ? what.substr(6) : what;
}

}  // namespace

std::optional<std::string> defect(const std::string& ckpt_dir) {
  const std::string index_path = ckpt_dir + "/" + kIndexFile;
  std::error_code ec;
  if (!fs::exists(index_path, ec)) {
    return cat("incomplete: no ", kIndexFile,
               " (the save was interrupted before its index was "
               "written)");
  }
  Index idx;
  try {
    idx = parse_index(st::read_text(index_path, kMaxIndexBytes), index_path);
    check_index_step(idx, ckpt_dir);
  } catch (const Error& e) {
    return cat("damaged: ", without_prefix(e.what()));
  }
  for (const auto& f : idx.files) {
    const auto p = fs::path(ckpt_dir) / f.name;
    if (!fs::is_regular_file(p, ec)) return cat("damaged: ", f.name, " is missing");
    const auto size = fs::file_size(p, ec);
    if (ec || size != f.sums.file_bytes) {
      return cat("damaged: ", f.name, " is ", size, " bytes, the index says ", f.sums.file_bytes,
                 " (truncated or replaced)");
    }
  }
  return std::nullopt;
}

Scan scan(const std::string& dir) {
  Scan out;
  for (const auto& [step, path] : step_dirs(dir)) {
    auto why = defect(path);
    if (!why) {
      out.latest = path;
      break;
    }
    out.skipped.push_back({path, *why});
  }
  return out;
}

std::optional<std::string> latest(const std::string& dir,
                                  const std::function<void(const std::string&)>& report) {
  Scan s = scan(dir);
  for (const auto& k : s.skipped) {
    std::string line = cat("checkpoint '", k.path, "' is unusable (", k.reason, "); ",
                           s.latest ? "falling back to '" + *s.latest + "'"
                                    : std::string("no older complete checkpoint"));
    if (report) {
      report(line);
    } else {
      TORCH_WARN("fsdp: warning: ", line);
    }
  }
  return s.latest;
}

std::vector<std::string> keep_last(const std::string& dir, int keep) {
  FSDP_CHECK(keep >= 1, "checkpoint keep_last: keep = ", keep, " must be at least 1");
  std::vector<std::string> removed;
  int complete = 0;
  for (const auto& [step, path] : step_dirs(dir)) {
    const bool ok = !defect(path).has_value();
    if (complete < keep) {
      complete += ok;  // newer than the oldest kept one: kept, complete or not
      continue;
    }
    std::error_code ec;
    fs::remove_all(path, ec);
    FSDP_CHECK(!ec, "checkpoint keep_last: cannot remove '", path, "': ", ec.message(),
               "; check the permissions of '", dir, "'");
    removed.push_back(path);
  }
  std::reverse(removed.begin(), removed.end());
  return removed;
}

std::vector<std::string> remove_stale_temporaries(const std::string& dir) {
  std::vector<std::string> removed = ::fsdp::remove_stale_temporaries(dir);
  for (const auto& [step, path] : step_dirs(dir)) {
    auto more = ::fsdp::remove_stale_temporaries(path);
    removed.insert(removed.end(), more.begin(), more.end());
  }
  return removed;
}

}  // namespace fsdp::checkpoint
