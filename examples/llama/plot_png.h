// A small line-chart writer that emits PNG files with no dependencies, so the
// llama examples can plot their reports (peak memory against sequence length,
// say) without linking zlib, libpng or a plotting stack. The PNG holds
// uncompressed (stored) deflate blocks: files are larger but the writer stays
// a few hundred lines. Text uses a built-in 5x7 bitmap font, ASCII only.
#pragma once

#include <string>
#include <vector>

namespace halyard {

// One line of the chart; points in x order. Points whose x or y is not finite
// (or whose x is not positive on a log axis) are skipped and break the line.
struct PlotSeries {
  std::string name;
  std::vector<double> x, y;
};

struct PlotSpec {
  std::string title, x_label, y_label;
  std::vector<PlotSeries> series;
  double hline = 0;         // if > 0: a horizontal dashed line at this y (e.g. the memory budget)
  std::string hline_label;  // drawn next to it
  bool log_x = false;       // x axis log2 scale, ticks labelled 1K, 4K, ..., 1M
  int width = 960, height = 600;  // raised to at least 320x240
};

// Writes an RGB PNG; throws std::runtime_error naming the path when the file cannot be written.
void write_line_plot_png(const std::string& path, const PlotSpec& spec);

// Several charts stacked top to bottom in one PNG (a training run's loss,
// throughput and memory against step, say).
void write_line_plots_png(const std::string& path, const std::vector<PlotSpec>& panels);

}  // namespace halyard
