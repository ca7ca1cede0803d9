// Kernel coefficients fitted to measured calls (see calibration.h).
#include "schedules/calibration.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dsl/error.h"

namespace halyard {
namespace {

// The root node of a label "<op> %<id> ...": its id, or -1.
long root_of(const std::string& label) {
  const size_t at = label.find('%');
  if (at == std::string::npos || at + 1 >= label.size() || !std::isdigit(static_cast<unsigned char>(label[at + 1])))
    return -1;
  return std::strtol(label.c_str() + at + 1, nullptr, 10);
}

}  // namespace

KernelCoefficients fit_kernel(const std::vector<KernelSample>& s, double* rms_rel_error) {
  KernelCoefficients best;
  double best_err = INFINITY;
  *rms_rel_error = 0;
  for (int mask = 1; mask < 8; ++mask) {
    std::vector<int> cols;
    for (int c = 0; c < 3; ++c)
      if (mask & (1 << c)) cols.push_back(c);
    const size_t n = cols.size();
    std::vector<double> ata(n * n, 0), atb(n, 0);
    for (const KernelSample& x : s) {
      const double w = 1 / std::max(x.t, 1e-9);
      const double f[3] = {x.flops * w, x.bytes * w, w};
      for (size_t i = 0; i < n; ++i) {
        atb[i] += f[cols[i]];  // x.t * w
        for (size_t j = 0; j < n; ++j) ata[i * n + j] += f[cols[i]] * f[cols[j]];
      }
    }
    // Gaussian elimination (n <= 3) on the columns scaled to unit length, so
    // that columns that cannot be told apart (calls of one shape) leave a
    // pivot of rounding noise and are refused, whatever their units.
    std::vector<double> d(n), a(n * n), b(n);
    bool ok = true;
    for (size_t i = 0; i < n; ++i) d[i] = std::sqrt(ata[i * n + i]), ok = ok && d[i] > 0;
    if (!ok) continue;  // a column of zeros (no bytes, say)
    for (size_t i = 0; i < n; ++i) {
      b[i] = atb[i] / d[i];
      for (size_t j = 0; j < n; ++j) a[i * n + j] = ata[i * n + j] / (d[i] * d[j]);
    }
    for (size_t i = 0; i < n && ok; ++i) {
      size_t p = i;
      for (size_t r = i + 1; r < n; ++r)
        if (std::abs(a[r * n + i]) > std::abs(a[p * n + i])) p = r;
      if (std::abs(a[p * n + i]) < 1e-9) {
        ok = false;
        break;
      }
      for (size_t c = 0; c < n; ++c) std::swap(a[i * n + c], a[p * n + c]);
      std::swap(b[i], b[p]);
      for (size_t r = 0; r < n; ++r) {
        if (r == i) continue;
        const double m = a[r * n + i] / a[i * n + i];
        for (size_t c = 0; c < n; ++c) a[r * n + c] -= m * a[i * n + c];
        b[r] -= m * b[i];
      }
    }
    if (!ok) continue;
    double coef[3] = {0, 0, 0};
    for (size_t i = 0; i < n; ++i) coef[cols[i]] = b[i] / a[i * n + i] / d[i];
    if (coef[0] < 0 || coef[1] < 0 || coef[2] < 0) continue;
    double err = 0;
    for (const KernelSample& x : s) {
      const double rel = (coef[0] * x.flops + coef[1] * x.bytes + coef[2] - x.t) / std::max(x.t, 1e-9);
      err += rel * rel;
    }
    // Calls of one shape fit every single coefficient equally well; rounding
    // would pick among them by chance. A tie (within rounding) keeps the
    // first, s_per_flop, which carries a compute-bound kernel to other lengths.
    if (err < best_err * (1 - 1e-9) - 1e-15) {
      best_err = err;
      best = {coef[0], coef[1], coef[2]};
      *rms_rel_error = std::sqrt(err / static_cast<double>(s.size()));
    }
  }
  return best;
}

double fit_collective_lag(const std::vector<StepBeyondKernels>& steps) {
  double behind = 0, lags = 0;
  for (const StepBeyondKernels& s : steps) behind += s.measured_s - s.planned_s, lags += s.lags;
  return lags > 0 ? std::max(0.0, behind / lags) : 0.0;
}

std::map<std::string, std::vector<KernelSample>> pair_profile(const std::string& plan_json, const std::string& profile,
                                                              const std::string& what) {
  nlohmann::json plan;
  try {
    plan = nlohmann::json::parse(plan_json);
  } catch (const nlohmann::json::exception& e) {
    throw UserError("error: " + what + ": the plan is not JSON (" + e.what() + ").\nfix: pass the <name>.plan.json "
                    "that halyard_add_model wrote next to the library.");
  }
  if (!plan.contains("stages") || !plan["stages"].is_array())
    throw UserError("error: " + what + ": the plan has no \"stages\".\nfix: pass the <name>.plan.json that "
                    "halyard_add_model wrote next to the library (the whole plan, not its summary).");
  // Seconds and scratch by root node; "wait" lines (a collective finishing)
  // time no kernel.
  std::map<long, double> seconds, scratch;
  std::istringstream lines(profile);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::string ms, unit, kernel;
    if (!(words >> ms >> unit >> kernel) || unit != "ms" || kernel == "wait") continue;
    std::string rest;
    std::getline(words, rest);
    const long root = root_of(rest);
    if (root < 0) continue;
    seconds[root] += std::atof(ms.c_str()) / 1e3;
    if (const size_t at = rest.rfind("  scratch "); at != std::string::npos)
      scratch[root] = std::max(scratch[root], std::atof(rest.c_str() + at + 10));
  }
  std::map<std::string, std::vector<KernelSample>> samples;
  for (const nlohmann::json& st : plan["stages"]) {
    const std::string label = st.value("label", "");
    const auto it = seconds.find(root_of(label));
    if (it == seconds.end())
      throw UserError("error: " + what + ": the profile has no call of stage \"" + label + "\" of the plan.\nfix: pass "
                      "the profile (Model::profile() with HALYARD_PROFILE set) of a step of the library this plan built.");
    samples[st.value("kind", "pointwise")].push_back(
        {st.value("charged_flops", st.value("flops", 0.0)), st.value("bytes", 0.0), it->second, scratch[it->first]});
  }
  return samples;
}

}  // namespace halyard
