// The live progress display of rank 0: one line refreshed in place on a terminal, plain lines
// every k steps otherwise, or nothing (--quiet).
//
// Ranks started by fsdp-train itself run under fsdp-run, whose pipes make stdout a non-terminal;
// the parent then sets FSDP_TRAIN_TTY=1 and rank 0 draws the in-place line on /dev/tty directly
// (fsdp-run prefixes whole lines only, so a carriage-return line could not pass through it).
// Thread-safety: one thread.
#pragma once

#include <cstdint>
#include <string>

#include "train/metrics.h"

namespace fsdp::train {

enum class ProgressMode {
  kNone,     // --quiet
  kLines,    // a plain line every log_every steps (logs, pipes, CI)
  kInPlace,  // one line redrawn with \r on a terminal
};

inline constexpr const char* kTtyEnv = "FSDP_TRAIN_TTY";

class Progress {
 public:
  // Chooses the mode: kNone when quiet; kInPlace when stdout is a terminal, or when kTtyEnv=1 and
  // /dev/tty opens; kLines otherwise. log_every = 0 picks about 25 lines per run.
  Progress(bool quiet, int64_t total_steps, int64_t log_every);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  ProgressMode mode() const { return mode_; }
  // After each step; eta_s = estimated seconds left.
  void update(const MetricsRow& row, double eta_s);
  // Ends the in-place line (newline) so that later output starts on a fresh line.
  void finish();

 private:
  void emit(const std::string& text);

  ProgressMode mode_ = ProgressMode::kLines;
  int fd_ = 1;
  bool own_fd_ = false;
  bool drawn_ = false;
  int64_t total_ = 1;
  int64_t log_every_ = 1;
  double last_draw_s_ = -1;
};

// "1h02m", "3m07s", "12s".
std::string format_duration(double seconds);
// "12.3k", "1.20M".
std::string format_count(double v);

}  // namespace fsdp::train
