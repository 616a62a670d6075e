// The loss curve of a run as a self-contained SVG (no fonts or scripts beyond SVG text).
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
  double smoothing = 0.9;  // EMA weight of the smoothed curve; 0 = none
};

// (step, loss) points, in step order; non-finite losses are skipped. Returns the SVG text.
std::string loss_curve_svg(const std::vector<std::pair<int64_t, double>>& points,
                           const PlotOptions& options = {});

// Writes the SVG to `path` (through a temporary file and rename). Throws fsdp::Error naming it.
void write_text_file_atomic(const std::string& path, const std::string& text);

}  // namespace fsdp::train
