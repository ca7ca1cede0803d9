// halyard-plot-metrics: turns a training run's --metrics JSONL into one PNG of
// what a person checks first: train and validation loss, tokens/s, and each
// rank's peak memory against the plan's prediction, all against step.
//
//   halyard-plot-metrics run.jsonl run.png
//
// Reads the lines llama_train writes: an optional head {"plan": {...},
// "launch": {...}} and one object per step with "step", "loss",
// "tokens_per_s", "peak_rss_mib" (one per rank) and, on validation steps,
// "val_loss". A resumed run appends to the same file; a step seen twice keeps
// its last line.
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "examples/llama/plot_png.h"

namespace {

struct Step {
  double loss = 0, tokens_per_s = 0, val_loss = -1;
  std::vector<double> peak_mib;
};

int usage() {
  std::fprintf(stderr, "usage: halyard-plot-metrics METRICS.jsonl OUT.png\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf("usage: halyard-plot-metrics METRICS.jsonl OUT.png\n"
                "Plots loss (train, mean of 10, validation), tokens/s and per-rank peak memory against step.\n");
    return 0;
  }
  if (argc != 3) return usage();
  const std::string in_path = argv[1], out_path = argv[2];
  std::ifstream in(in_path);
  if (!in) {
    std::fprintf(stderr, "error: cannot open metrics file \"%s\".\nfix: pass the file llama_train --metrics wrote.\n",
                 in_path.c_str());
    return 2;
  }
  std::map<int64_t, Step> steps;
  double predicted_mib = 0;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object()) {
      std::fprintf(stderr, "error: \"%s\" line %d is not a JSON object: %.80s\nfix: pass a --metrics file of llama_train.\n",
                   in_path.c_str(), n, line.c_str());
      return 2;
    }
    if (j.contains("plan") && j["plan"].is_object()) {
      const auto& p = j["plan"];
      if (p.contains("predicted_peak_bytes_per_rank") && p["predicted_peak_bytes_per_rank"].is_number())
        predicted_mib = p["predicted_peak_bytes_per_rank"].get<double>() / (1 << 20);
      continue;
    }
    if (!j.contains("step") || !j["step"].is_number_integer() || !j.contains("loss") || !j["loss"].is_number()) {
      std::fprintf(stderr, "error: \"%s\" line %d has no integer \"step\" and numeric \"loss\": %.80s\n"
                   "fix: pass a --metrics file of llama_train.\n", in_path.c_str(), n, line.c_str());
      return 2;
    }
    Step s;
    s.loss = j["loss"].get<double>();
    if (j.contains("tokens_per_s") && j["tokens_per_s"].is_number()) s.tokens_per_s = j["tokens_per_s"].get<double>();
    if (j.contains("val_loss") && j["val_loss"].is_number()) s.val_loss = j["val_loss"].get<double>();
    if (j.contains("peak_rss_mib") && j["peak_rss_mib"].is_array())
      for (const auto& v : j["peak_rss_mib"])
        if (v.is_number()) s.peak_mib.push_back(v.get<double>());
    steps[j["step"].get<int64_t>()] = s;
  }
  if (steps.empty()) {
    std::fprintf(stderr, "error: \"%s\" holds no step lines.\nfix: run llama_train with --metrics for at least one step.\n",
                 in_path.c_str());
    return 2;
  }

  halyard::PlotSeries train{"train loss", {}, {}}, mean{"train loss, mean of 10 steps", {}, {}},
      val{"validation loss (held out)", {}, {}}, tps{"tokens/s", {}, {}};
  std::vector<halyard::PlotSeries> ranks;
  std::vector<double> window;
  for (const auto& [step, s] : steps) {
    const double x = static_cast<double>(step);
    train.x.push_back(x), train.y.push_back(s.loss);
    window.push_back(s.loss);
    if (window.size() > 10) window.erase(window.begin());
    double sum = 0;
    for (double v : window) sum += v;
    mean.x.push_back(x), mean.y.push_back(sum / static_cast<double>(window.size()));
    if (s.val_loss >= 0) val.x.push_back(x), val.y.push_back(s.val_loss);
    tps.x.push_back(x), tps.y.push_back(s.tokens_per_s);
    for (size_t r = 0; r < s.peak_mib.size(); ++r) {
      if (ranks.size() <= r) ranks.push_back({"rank " + std::to_string(r), {}, {}});
      ranks[r].x.push_back(x), ranks[r].y.push_back(s.peak_mib[r]);
    }
  }
  auto chart = [](const char* title, const char* y_label, std::vector<halyard::PlotSeries> series) {
    halyard::PlotSpec p;
    p.title = title, p.x_label = "step", p.y_label = y_label, p.series = std::move(series), p.height = 400;
    return p;
  };
  halyard::PlotSpec loss = chart("loss", "cross-entropy (nats/token)", {train, mean});
  if (!val.x.empty()) loss.series.push_back(val);
  halyard::PlotSpec speed = chart("throughput (all ranks, mean since the first step)", "tokens/s", {tps});
  halyard::PlotSpec memory = chart("peak resident memory per rank", "MiB", ranks);
  if (predicted_mib > 0) {
    memory.hline = predicted_mib;
    char label[64];
    std::snprintf(label, sizeof label, "plan: %.1f MiB", predicted_mib);
    memory.hline_label = label;
  }
  try {
    halyard::write_line_plots_png(out_path, {loss, speed, memory});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\nfix: pass an OUT.png in a directory this user can write.\n", e.what());
    return 2;
  }
  std::printf("wrote %s: loss, tokens/s and peak memory of %zu rank(s) over %zu steps\n", out_path.c_str(),
              ranks.size(), steps.size());
  return 0;
}
