#include "train/plot.h"

#include <fsdp/error.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <tuple>

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
                     double width, double opacity, bool dashed) {
  std::ostringstream os;
  os << "<polyline fill=\"none\" stroke=\"" << stroke << "\" stroke-width=\"" << width
     << "\" stroke-opacity=\"" << opacity << "\" stroke-linejoin=\"round\""
     << (dashed ? " stroke-dasharray=\"5,3\"" : "") << " points=\"";
  char buf[48];
  for (const auto& [x, y] : xy) {
    std::snprintf(buf, sizeof buf, "%.1f,%.1f ", x, y);
    os << buf;
  }
  os << "\"/>\n";
  return os.str();
}

}  // namespace

std::vector<double> centred_mean(const std::vector<double>& values, int64_t half_width) {
  const auto n = static_cast<int64_t>(values.size());
  std::vector<double> prefix(values.size() + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + values[i];
  std::vector<double> out(values.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t w = std::min({std::max<int64_t>(half_width, 0), i, n - 1 - i});
    out[i] = (prefix[i + w + 1] - prefix[i - w]) / static_cast<double>(2 * w + 1);
  }
  return out;
}

namespace {

using Points = std::vector<std::pair<int64_t, double>>;

Points finite(const Points& in) {
  Points out;
  for (const auto& p : in)
    if (std::isfinite(p.second)) out.push_back(p);
  return out;
}

std::string legend(double x, double y,
                   const std::vector<std::tuple<std::string, const char*, double, bool>>& entries) {
  std::ostringstream os;
  const double h = 18.0 * static_cast<double>(entries.size()) + 8;
  os << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"250\" height=\"" << h
     << "\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#bbb\"/>\n";
  double ly = y + 16;
  for (const auto& [label, colour, width, dashed] : entries) {
    os << "<line x1=\"" << x + 8 << "\" x2=\"" << x + 36 << "\" y1=\"" << ly - 4 << "\" y2=\""
       << ly - 4 << "\" stroke=\"" << colour << "\" stroke-width=\"" << width << "\""
       << (dashed ? " stroke-dasharray=\"5,3\"" : "") << "/>\n";
    os << "<text x=\"" << x + 44 << "\" y=\"" << ly << "\">" << escape_xml(label) << "</text>\n";
    ly += 18;
  }
  return os.str();
}

// The plot area and its scales: steps to x, losses to y (left axis), learning rates to y (right).
struct Frame {
  double left = 70, right = 20, top = 40, bottom = 50;
  double pw = 0, ph = 0;           // plot width and height
  double x0 = 0, x1 = 1;           // steps
  double y0 = 0, y1 = 1, lr1 = 1;  // losses; the largest learning rate shown
  double sx(double x) const { return left + (x - x0) / (x1 - x0) * pw; }
  double sy(double y) const { return top + (1.0 - (y - y0) / (y1 - y0)) * ph; }
  double sy_lr(double y) const { return top + (1.0 - y / lr1) * ph; }
};

Frame frame_of(const Points& pts, const Points& val, const Points& lr, const PlotOptions& o) {
  Frame f;
  f.right = lr.empty() ? 20 : 75;
  f.top = o.subtitle.empty() ? 40 : 58;
  f.pw = o.width - f.left - f.right;
  f.ph = o.height - f.top - f.bottom;
  f.x0 = static_cast<double>(pts.front().first);
  f.x1 = static_cast<double>(pts.back().first);
  if (f.x1 <= f.x0) f.x1 = f.x0 + 1;
  f.y0 = f.y1 = pts.front().second;
  for (const Points* s : {&pts, &val})
    for (const auto& p : *s) {
      f.y0 = std::min(f.y0, p.second);
      f.y1 = std::max(f.y1, p.second);
    }
  const double pad = std::max((f.y1 - f.y0) * 0.05, 1e-3);
  f.y0 = std::max(0.0, f.y0 - pad);
  f.y1 += pad;
  double lr1 = 0;
  for (const auto& p : lr) lr1 = std::max(lr1, p.second);
  f.lr1 = lr1 > 0 ? lr1 * 1.05 : 1.0;
  return f;
}

// Grid, ticks and labels of both axes (the right one only with a learning rate).
void draw_axes(std::ostringstream& os, const Frame& f, const PlotOptions& o, bool with_lr) {
  for (double t : nice_ticks(f.y0, f.y1, 6)) {
    os << "<line x1=\"" << f.left << "\" x2=\"" << f.left + f.pw << "\" y1=\"" << f.sy(t)
       << "\" y2=\"" << f.sy(t) << "\" stroke=\"#e5e5e5\"/>\n";
    os << "<text x=\"" << f.left - 6 << "\" y=\"" << f.sy(t) + 4 << "\" text-anchor=\"end\">"
       << fmt(t) << "</text>\n";
  }
  for (double t : nice_ticks(f.x0, f.x1, 8)) {
    os << "<line x1=\"" << f.sx(t) << "\" x2=\"" << f.sx(t) << "\" y1=\"" << f.top << "\" y2=\""
       << f.top + f.ph << "\" stroke=\"#f0f0f0\"/>\n";
    os << "<text x=\"" << f.sx(t) << "\" y=\"" << f.top + f.ph + 18 << "\" text-anchor=\"middle\">"
       << fmt(t) << "</text>\n";
  }
  if (with_lr) {
    for (double t : nice_ticks(0, f.lr1, 5))
      os << "<text x=\"" << f.left + f.pw + 6 << "\" y=\"" << f.sy_lr(t) + 4
         << "\" fill=\"#2ca02c\">" << fmt(t) << "</text>\n";
    os << "<text transform=\"translate(" << o.width - 10 << "," << f.top + f.ph / 2
       << ") rotate(90)\" text-anchor=\"middle\" fill=\"#2ca02c\">learning rate</text>\n";
  }
  os << "<rect x=\"" << f.left << "\" y=\"" << f.top << "\" width=\"" << f.pw << "\" height=\""
     << f.ph << "\" fill=\"none\" stroke=\"#888\"/>\n";
  os << "<text x=\"" << f.left + f.pw / 2 << "\" y=\"" << o.height - 10
     << "\" text-anchor=\"middle\">step</text>\n";
  os << "<text transform=\"translate(16," << f.top + f.ph / 2
     << ") rotate(-90)\" text-anchor=\"middle\">loss (cross-entropy, nats per token)</text>\n";
}

// The curves (raw and smoothed training loss, validation loss, learning rate) and the legend.
void draw_curves(std::ostringstream& os, const Frame& f, const Points& pts, const Points& val,
                 const Points& lr, const PlotOptions& o) {
  const int64_t n = static_cast<int64_t>(pts.size());
  const int64_t w = o.smooth_half_width >= 0 ? o.smooth_half_width : n / 50;
  std::vector<double> losses;
  for (const auto& p : pts) losses.push_back(p.second);
  const std::vector<double> smooth = centred_mean(losses, w);
  std::vector<std::pair<double, double>> raw_xy, smooth_xy, val_xy, lr_xy;
  for (int64_t i = 0; i < n; ++i) {
    const double x = f.sx(static_cast<double>(pts[i].first));
    raw_xy.emplace_back(x, f.sy(pts[i].second));
    smooth_xy.emplace_back(x, f.sy(smooth[i]));
  }
  for (const auto& p : val) val_xy.emplace_back(f.sx(static_cast<double>(p.first)), f.sy(p.second));
  for (const auto& p : lr)
    lr_xy.emplace_back(f.sx(static_cast<double>(p.first)), f.sy_lr(p.second));
  std::vector<std::tuple<std::string, const char*, double, bool>> entries;
  if (!lr_xy.empty()) os << polyline(lr_xy, "#2ca02c", 1.2, 0.8, true);
  os << polyline(raw_xy, "#1f77b4", 1.0, w > 0 ? 0.35 : 1.0, false);
  entries.emplace_back("training loss", "#1f77b4", 1.0, false);
  if (w > 0) {
    os << polyline(smooth_xy, "#1f77b4", 2.0, 1.0, false);
    entries.emplace_back("training loss, centred mean of " + std::to_string(2 * w + 1) + " steps",
                         "#1f77b4", 2.0, false);
  }
  if (!val_xy.empty()) {
    os << polyline(val_xy, "#d62728", 2.0, 1.0, false);
    for (const auto& [x, y] : val_xy)
      os << "<circle cx=\"" << x << "\" cy=\"" << y << "\" r=\"3\" fill=\"#d62728\"/>\n";
    entries.emplace_back("validation loss", "#d62728", 2.0, false);
  }
  if (!lr_xy.empty()) entries.emplace_back("learning rate (right axis)", "#2ca02c", 1.2, true);
  std::string final_text = "final loss " + fmt4(pts.back().second);
  if (!val.empty()) final_text += ", validation " + fmt4(val.back().second);
  os << legend(f.left + f.pw - 256, f.top + 6, entries);
  os << "<text x=\"" << f.left + f.pw - 6 << "\" y=\"" << f.top + 34 + 18.0 * entries.size()
     << "\" text-anchor=\"end\" fill=\"#1f77b4\">" << escape_xml(final_text) << "</text>\n";
}

}  // namespace

std::string loss_curve_svg(const PlotSeries& series, const PlotOptions& o) {
  const Points pts = finite(series.loss), val = finite(series.val_loss), lr = finite(series.lr);
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
  const Frame f = frame_of(pts, val, lr, o);
  draw_axes(os, f, o, !lr.empty());
  draw_curves(os, f, pts, val, lr, o);
  os << "</svg>\n";
  return os.str();
}

}  // namespace fsdp::train
