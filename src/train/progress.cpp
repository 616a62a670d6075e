#include "train/progress.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "util/env.h"

namespace fsdp::train {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = static_cast<int64_t>(std::llround(s));
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(t / 3600),
                  static_cast<long long>(t / 60 % 60));
  else if (t >= 60)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(t / 60),
                  static_cast<long long>(t % 60));
  else
    std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(t));
  return buf;
}

std::string format_count(double v) {
  char buf[32];
  if (v >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

Progress::Progress(bool quiet, int64_t total_steps, int64_t log_every) : total_(total_steps) {
  log_every_ = log_every > 0 ? log_every : std::max<int64_t>(1, total_steps / 25);
  if (quiet) {
    mode_ = ProgressMode::kNone;
  } else if (::isatty(1)) {
    mode_ = ProgressMode::kInPlace;
  } else if (detail::env_string(kTtyEnv) == "1") {
    const int fd = ::open("/dev/tty", O_WRONLY | O_CLOEXEC | O_NOCTTY);
    if (fd >= 0) {
      mode_ = ProgressMode::kInPlace;
      fd_ = fd;
      own_fd_ = true;
    }
  }
}

Progress::~Progress() {
  finish();
  if (own_fd_) ::close(fd_);
}

void Progress::emit(const std::string& text) {
  if (mode_ == ProgressMode::kLines) {
    std::fputs(text.c_str(), stdout);
    std::fflush(stdout);
    return;
  }
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
}

void Progress::update(const MetricsRow& r, double eta_s) {
  if (mode_ == ProgressMode::kNone) return;
  const bool last = r.step >= total_;
  char buf[256];
  if (mode_ == ProgressMode::kLines) {
    if (!(last || r.step == 1 || r.step % log_every_ == 0)) return;
    std::snprintf(
        buf, sizeof buf, "step %lld/%lld  loss %.4f  lr %.2e  %s tok/s  %.3f s/step  ETA %s\n",
        static_cast<long long>(r.step), static_cast<long long>(total_), r.loss, r.lr,
        format_count(r.tokens_per_s).c_str(), r.step_time_s, format_duration(eta_s).c_str());
    emit(buf);
    return;
  }
  const double t = now_s();
  if (!last && last_draw_s_ >= 0 && t - last_draw_s_ < 0.1) return;  // at most 10 redraws/s
  last_draw_s_ = t;
  constexpr int kBar = 24;
  const int filled = static_cast<int>(kBar * static_cast<double>(r.step) / total_);
  std::string bar(static_cast<size_t>(std::clamp(filled, 0, kBar)), '=');
  bar.resize(kBar, ' ');
  std::snprintf(buf, sizeof buf,
                "\r\x1b[2Kstep %lld/%lld [%s] loss %.4f | %s tok/s | lr %.2e | ETA %s",
                static_cast<long long>(r.step), static_cast<long long>(total_), bar.c_str(), r.loss,
                format_count(r.tokens_per_s).c_str(), r.lr, format_duration(eta_s).c_str());
  emit(buf);
  drawn_ = true;
}

void Progress::finish() {
  if (mode_ == ProgressMode::kInPlace && drawn_) emit("\n");
  drawn_ = false;
}

}  // namespace fsdp::train
