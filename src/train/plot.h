// The loss curves of a run as a self-contained SVG (no fonts or scripts beyond SVG text): the
// training loss (raw, and smoothed by a centred moving average, which does not lag), the
// validation loss, and the learning rate on a second (right) axis, with a legend.
// Thread-safety: stateless.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::train {

struct PlotOptions {
  std::string title = "fsdp-train loss";
  std::string subtitle;  // e.g. the model and world size
  int width = 800;
  int height = 450;
  // Steps on each side of the centred moving average; -1 = about 2% of the steps; 0 = none.
  int64_t smooth_half_width = -1;
};

struct PlotSeries {
  std::vector<std::pair<int64_t, double>> loss;      // (step, training loss), step order
  std::vector<std::pair<int64_t, double>> val_loss;  // (step, validation loss); may be empty
  std::vector<std::pair<int64_t, double>> lr;        // (step, learning rate); may be empty
};

// Non-finite values are skipped. Returns the SVG text.
std::string loss_curve_svg(const PlotSeries& series, const PlotOptions& options = {});

// Centred moving average: point i is the mean of points [i - w, i + w], with w shrunk to
// min(half_width, i, n - 1 - i) near the ends so that the window stays centred (no lag).
std::vector<double> centred_mean(const std::vector<double>& values, int64_t half_width);

}  // namespace fsdp::train
