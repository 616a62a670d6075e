#include "train/plot.h"

#include <fsdp/error.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace fsdp::train {
namespace {

std::string escape_xml(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// About `target` round tick values (1, 2 or 5 times a power of ten) covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int target) {
  const double span = std::max(hi - lo, 1e-12);
  const double raw = span / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (span / step <= target) break;
  }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step)
    ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  return ticks;
}

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string fmt4(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4f", v);
  return buf;
}

std::string polyline(const std::vector<std::pair<double, double>>& xy, const char* stroke,
                     double width, double opacity) {
  std::ostringstream os;
  os << "<polyline fill=\"none\" stroke=\"" << stroke << "\" stroke-width=\"" << width
     << "\" stroke-opacity=\"" << opacity << "\" stroke-linejoin=\"round\" points=\"";
  char buf[48];
  for (const auto& [x, y] : xy) {
    std::snprintf(buf, sizeof buf, "%.1f,%.1f ", x, y);
    os << buf;
  }
  os << "\"/>\n";
  return os.str();
}

}  // namespace

std::string loss_curve_svg(const std::vector<std::pair<int64_t, double>>& points,
                           const PlotOptions& o) {
  std::vector<std::pair<int64_t, double>> pts;
  for (const auto& p : points)
    if (std::isfinite(p.second)) pts.push_back(p);

  const double left = 70, right = 20, top = o.subtitle.empty() ? 40 : 58, bottom = 50;
  const double pw = o.width - left - right, ph = o.height - top - bottom;
  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << o.width << "\" height=\""
     << o.height << "\" viewBox=\"0 0 " << o.width << " " << o.height
     << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  os << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  os << "<text x=\"" << o.width / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"16\">"
     << escape_xml(o.title) << "</text>\n";
  if (!o.subtitle.empty())
    os << "<text x=\"" << o.width / 2 << "\" y=\"42\" text-anchor=\"middle\" fill=\"#555\">"
       << escape_xml(o.subtitle) << "</text>\n";
  if (pts.empty()) {
    os << "<text x=\"" << o.width / 2 << "\" y=\"" << o.height / 2
       << "\" text-anchor=\"middle\">no finite losses recorded</text>\n</svg>\n";
    return os.str();
  }

  double x0 = static_cast<double>(pts.front().first), x1 = static_cast<double>(pts.back().first);
  if (x1 <= x0) x1 = x0 + 1;
  double y0 = pts.front().second, y1 = y0;
  for (const auto& p : pts) {
    y0 = std::min(y0, p.second);
    y1 = std::max(y1, p.second);
  }
  const double pad = std::max((y1 - y0) * 0.05, 1e-3);
  y0 = std::max(0.0, y0 - pad);
  y1 += pad;
  auto sx = [&](double x) { return left + (x - x0) / (x1 - x0) * pw; };
  auto sy = [&](double y) { return top + (1.0 - (y - y0) / (y1 - y0)) * ph; };

  // Grid, ticks and labels.
  for (double t : nice_ticks(y0, y1, 6)) {
    os << "<line x1=\"" << left << "\" x2=\"" << left + pw << "\" y1=\"" << sy(t) << "\" y2=\""
       << sy(t) << "\" stroke=\"#e5e5e5\"/>\n";
    os << "<text x=\"" << left - 6 << "\" y=\"" << sy(t) + 4 << "\" text-anchor=\"end\">" << fmt(t)
       << "</text>\n";
  }
  for (double t : nice_ticks(x0, x1, 8)) {
    os << "<line x1=\"" << sx(t) << "\" x2=\"" << sx(t) << "\" y1=\"" << top << "\" y2=\""
       << top + ph << "\" stroke=\"#f0f0f0\"/>\n";
    os << "<text x=\"" << sx(t) << "\" y=\"" << top + ph + 18 << "\" text-anchor=\"middle\">"
       << fmt(t) << "</text>\n";
  }
  os << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
     << "\" fill=\"none\" stroke=\"#888\"/>\n";
  os << "<text x=\"" << left + pw / 2 << "\" y=\"" << o.height - 10
     << "\" text-anchor=\"middle\">step</text>\n";
  os << "<text transform=\"translate(16," << top + ph / 2
     << ") rotate(-90)\" text-anchor=\"middle\">loss (cross-entropy, nats per byte)</text>\n";

  std::vector<std::pair<double, double>> raw, smooth;
  // Exponential moving average from zero, divided by (1 - smoothing^n) so it does not lag the
  // first steps (TensorBoard's debiased smoothing).
  double ema = 0, weight = 1;
  for (const auto& [step, loss] : pts) {
    raw.emplace_back(sx(static_cast<double>(step)), sy(loss));
    ema = o.smoothing * ema + (1.0 - o.smoothing) * loss;
    weight *= o.smoothing;
    smooth.emplace_back(sx(static_cast<double>(step)), sy(ema / (1.0 - weight)));
  }
  os << polyline(raw, "#1f77b4", 1.0, o.smoothing > 0 ? 0.35 : 1.0);
  if (o.smoothing > 0) os << polyline(smooth, "#1f77b4", 2.0, 1.0);
  os << "<text x=\"" << left + pw - 6 << "\" y=\"" << top + 16
     << "\" text-anchor=\"end\" fill=\"#1f77b4\">final loss " << fmt4(pts.back().second)
     << "</text>\n";
  os << "</svg>\n";
  return os.str();
}

void write_text_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  FSDP_CHECK(f != nullptr, "cannot write '", tmp, "' (", std::strerror(errno),
             "); check that the run directory is writable");
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = std::fclose(f) == 0;
  FSDP_CHECK(ok && closed, "writing '", tmp, "' failed (", std::strerror(errno), ")");
  FSDP_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "renaming '", tmp, "' to '", path,
             "' failed (", std::strerror(errno), ")");
}

}  // namespace fsdp::train
