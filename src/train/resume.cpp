// Finding the checkpoint to resume from and --keep-last retention (resume.h).
#include "train/resume.h"

#include <fsdp/checkpoint_index.h>
#include <fsdp/error.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fsdp::train {
namespace fs = std::filesystem;
namespace {

// step_<digits> -> the step; -1 otherwise.
int64_t step_of(const std::string& name) {
  if (name.rfind("step_", 0) != 0 || name.size() <= 5 || name.size() > 5 + 18) return -1;
  if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stoll(name.substr(5));
}

std::string read_index_text(const std::string& step_dir) {
  const std::string path = step_dir + "/" + checkpoint::kIndexFile;
  std::error_code ec;
  FSDP_CHECK(fs::exists(path, ec), "incomplete: no ", checkpoint::kIndexFile,
             " (a save that did not finish)");
  const auto bytes = fs::file_size(path, ec);
  FSDP_CHECK(!ec && bytes <= checkpoint::kMaxIndexBytes, checkpoint::kIndexFile, " of ", bytes,
             " bytes is unreadable or larger than ", checkpoint::kMaxIndexBytes);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  FSDP_CHECK(in.good() || in.eof(), checkpoint::kIndexFile, " cannot be read");
  return ss.str();
}

checkpoint::Index read_checked_index(const std::string& step_dir) {
  checkpoint::Index idx = checkpoint::parse_index(read_index_text(step_dir), step_dir);
  checkpoint::check_index_step(idx, step_dir);
  for (const auto& f : idx.files) {
    const fs::path p = fs::path(step_dir) / f.name;
    std::error_code ec;
    FSDP_CHECK(fs::is_regular_file(p, ec), f.name, " is missing");
    const auto size = fs::file_size(p, ec);
    FSDP_CHECK(!ec && size == f.sums.file_bytes, f.name, " has ", size, " bytes, the index says ",
               f.sums.file_bytes, " (truncated or replaced)");
  }
  return idx;
}

// --resume auto: the checksum of every file of the checkpoint, read whole, so that a damaged newest
// checkpoint is skipped here (reported) instead of stopping the load.
void verify_checksums(const std::string& step_dir, const checkpoint::Index& idx) {
  for (const auto& f : idx.files)
    safetensors::File::open_verified(step_dir + "/" + f.name, f.sums)->verify_all();
}

ResumePoint point_from(const std::string& step_dir, const checkpoint::Index& idx) {
  ResumePoint p;
  p.checkpoint = step_dir;
  p.step = idx.state.step;
  const nlohmann::json& extra = idx.state.extra;
  // fsdp-train writes {"settings": ..., "schedule": ...}; older versions wrote the settings alone.
  if (extra.is_object() && extra.contains("settings")) {
    p.settings = extra["settings"];
    if (extra.contains("schedule")) p.schedule = extra["schedule"];
    if (extra.contains("hf_config")) p.hf_config = extra["hf_config"].dump(2);
  } else {
    p.settings = extra;
  }
  FSDP_CHECK(p.settings.is_object(), "checkpoint '", step_dir,
             "' holds no fsdp-train settings (saved by another program?); start a new run with "
             "--init-from on a consolidated file instead");
  return p;
}

bool is_step_dir(const std::string& path) {
  return step_of(fs::path(path).lexically_normal().filename().string()) >= 0 ||
         fs::exists(fs::path(path) / checkpoint::kIndexFile);
}

std::string strip_slash(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

// The message without the "fsdp: " prefix of fsdp::Error, for nesting in another message.
std::string reason(const Error& e) {
  const std::string m = e.what();
  return m.rfind("fsdp: ", 0) == 0 ? m.substr(6) : m;
}

}  // namespace

void check_checkpoint(const std::string& step_dir) {
  try {
    read_checked_index(step_dir);
  } catch (const Error& e) {
    throw Error(detail::cat("checkpoint '", step_dir, "' is damaged: ", reason(e)));
  }
}

std::vector<std::string> step_dirs(const std::string& run_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) return {};
  for (const auto& ent : fs::directory_iterator(run_dir, ec)) {
    const int64_t step = step_of(ent.path().filename().string());
    if (step >= 0 && ent.is_directory(ec)) found.emplace_back(step, ent.path().string());
  }
  std::sort(found.rbegin(), found.rend());
  std::vector<std::string> out;
  for (auto& [step, path] : found) out.push_back(std::move(path));
  return out;
}

std::string resume_run_dir(const std::string& resume, const std::string& run_dir) {
  if (resume == "auto") return strip_slash(run_dir);
  const std::string r = strip_slash(resume);
  return is_step_dir(r) ? fs::path(r).parent_path().string() : r;
}

std::optional<ResumePoint> find_resume_point(const std::string& resume,
                                             const std::string& run_dir) {
  const std::string r = strip_slash(resume);
  if (resume != "auto" && is_step_dir(r)) {
    checkpoint::Index idx;
    try {
      idx = read_checked_index(r);
    } catch (const Error& e) {
      throw Error(detail::cat("checkpoint '", r, "' is damaged: ", reason(e), "; --resume ", r,
                              " names this checkpoint, so there is no fallback: pass --resume ",
                              fs::path(r).parent_path().string(),
                              " to continue from the newest complete one"));
    }
    return point_from(r, idx);
  }
  const std::string dir = resume_run_dir(resume, run_dir);
  const auto dirs = step_dirs(dir);
  if (resume == "auto" && dirs.empty()) return std::nullopt;
  std::vector<std::string> skipped;
  for (const auto& d : dirs) {
    try {
      const checkpoint::Index idx = read_checked_index(d);
      if (resume == "auto") verify_checksums(d, idx);
      ResumePoint p = point_from(d, idx);
      p.skipped = std::move(skipped);
      return p;
    } catch (const Error& e) {
      skipped.push_back(detail::cat(d, " is damaged: ", reason(e)));
    }
  }
  std::string why;
  for (const auto& s : skipped) why += "\n  " + s;
  std::error_code ec;
  FSDP_CHECK(fs::is_directory(dir, ec), "--resume '", resume, "': '", dir,
             "' is not a directory; pass the run directory of a run that used --save-every");
  throw Error(detail::cat("--resume '", resume, "': '", dir, "' holds no complete checkpoint",
                          skipped.empty() ? " (no step_* directories)" : ":", why,
                          "\npass the run directory of a run that used --save-every"));
}

std::string with_fallback_hint(const std::string& what, const std::string& resume,
                               const std::string& run_dir) {
  std::string m = what.rfind("fsdp: ", 0) == 0 ? what.substr(6) : what;
  if (resume == "auto") return m;
  return detail::cat(m, "\n--resume ", resume, " stops here; --resume auto --run-dir ",
                     resume_run_dir(resume, run_dir),
                     " reads every checkpoint against its checksums first and falls back to the "
                     "newest one that is whole, naming each one it skips");
}

std::vector<std::string> remove_old_checkpoints(const std::string& run_dir, int64_t keep) {
  std::vector<std::string> removed;
  if (keep <= 0) return removed;
  int64_t complete = 0;
  for (const auto& d : step_dirs(run_dir)) {
    if (complete >= keep) {
      std::error_code ec;
      fs::remove_all(d, ec);
      FSDP_CHECK(!ec, "--keep-last: cannot remove old checkpoint '", d, "' (", ec.message(), ")");
      removed.push_back(d);
      continue;
    }
    try {
      read_checked_index(d);
      ++complete;
    } catch (const Error&) {
      // incomplete or damaged and newer than the kept ones: removed only once older
    }
  }
  return removed;
}

namespace {

LrSchedule schedule_of(const TrainConfig& c) {
  return LrSchedule{c.lr, c.warmup, c.steps, c.min_lr_ratio};
}

// The explicit keys whose value differs from the checkpoint's and may not change on resume.
std::vector<std::string> conflicting_keys(const TrainConfig& given, const nlohmann::json& saved,
                                          std::string& detail_text) {
  const nlohmann::json mine = nlohmann::json::parse(given.to_json());
  const nlohmann::json defaults = nlohmann::json::parse(TrainConfig{}.to_json());
  const auto& allowed = resumable_keys();
  std::vector<std::string> out;
  for (const auto& key : given.explicit_keys) {
    if (!mine.contains(key) || std::find(allowed.begin(), allowed.end(), key) != allowed.end())
      continue;
    const nlohmann::json& theirs = saved.contains(key) ? saved[key] : defaults[key];
    if (mine[key] == theirs) continue;
    out.push_back(key);
    detail_text += detail::cat("\n  --", key, " ", mine[key].dump(), " (the checkpoint has ",
                               theirs.dump(), ")");
  }
  return out;
}

}  // namespace

nlohmann::json checkpoint_extra(const TrainConfig& cfg, const LrSchedule& schedule) {
  nlohmann::json extra;
  extra["settings"] = nlohmann::json::parse(cfg.to_json());
  if (schedule.restart_step >= 0)
    extra["schedule"] = {{"restart-step", schedule.restart_step},
                         {"restart-lr", schedule.restart_lr}};
  // A Llama's transformers config.json: what a resumed run builds and what an export writes.
  if (cfg.model == "llama")
    extra["hf_config"] = nlohmann::json::parse(llama_config_of(cfg).to_hf_json(cfg.hf_config));
  return extra;
}

RunPlan plan_run(const TrainConfig& given) {
  RunPlan plan;
  plan.cfg = given;
  if (!given.resume.empty()) plan.from = find_resume_point(given.resume, given.run_dir);
  if (!plan.from) {
    plan.schedule = schedule_of(plan.cfg);
    return plan;
  }
  const ResumePoint& p = *plan.from;
  std::string details;
  const auto conflicts = conflicting_keys(given, p.settings, details);
  if (!conflicts.empty())
    throw Error(detail::cat(
        "--resume continues the run of '", p.checkpoint, "' with its settings, but ",
        conflicts.size() == 1 ? "this setting differs" : "these settings differ", ":", details,
        "\nthey define the model, the optimizer or the data: drop ",
        conflicts.size() == 1 ? "it" : "them",
        " (a resumed run may change only --steps, --min-lr-ratio, --grad-accum, the number of "
        "ranks, --malloc, --hsdp, the blocks' memory flags, evaluation, logging and checkpoint "
        "flags), or start a new run"));
  std::vector<std::string> overrides = {"resume", "run-dir", "init-from"};
  for (const auto& key : resumable_keys())
    if (given.was_set(key)) overrides.push_back(key);
  plan.cfg = merge_settings(p.settings.dump(), given, overrides);
  plan.cfg.resume = given.resume;
  plan.cfg.hf_config = p.hf_config;
  plan.cfg.run_dir = resume_run_dir(given.resume, given.run_dir);
  plan.cfg.validate();
  FSDP_CHECK(p.step <= plan.cfg.steps, "--resume '", p.checkpoint, "' is at step ", p.step,
             ", beyond --steps ", plan.cfg.steps, "; raise --steps to train further");
  // The schedule the checkpoint's run had, then extended if the end changed.
  TrainConfig saved = merge_settings(p.settings.dump(), TrainConfig{}, {});
  LrSchedule old = schedule_of(saved);
  if (p.schedule.is_object()) {
    old.restart_step = p.schedule.value("restart-step", int64_t{-1});
    old.restart_lr = p.schedule.value("restart-lr", 0.0);
  }
  plan.schedule = old.extended(p.step, plan.cfg.steps, plan.cfg.min_lr_ratio);
  return plan;
}

}  // namespace fsdp::train
