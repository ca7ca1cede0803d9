// halyard-fit-kernels: a cluster profile whose kernel coefficients are fitted
// to the kernel calls a GPU measured, for plan() and halyard-plan to predict
// with:
//
//   halyard-fit-kernels --base CLUSTER --out PROFILE.json PLAN.json PROFILE.txt [PLAN.json PROFILE.txt ...]
//
// Each pair is a library's plan (the <name>.plan.json halyard_add_model
// writes next to it) and the profile of one of its steps timed kernel by
// kernel on the device (Model::profile() under HALYARD_PROFILE with
// Model::set_kernel_times_on_device: gpu_step_bench --profile-out). The
// calls are paired with the plans' stages (schedules/calibration.h) and each
// kernel kind's coefficients are fitted as halyard-calibrate fits a CPU's.
// Everything the calls do not show (memory per rank, links, peaks, kinds
// that no call had) is the base cluster's, a preset or profile. It prints,
// per kind, the fitted rates and their share of the base's peaks, and per
// library the kernels' measured time against the base's prediction and the
// fitted one's. scripts/gpu_check.sh runs it on the GPU node.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dsl/error.h"
#include "schedules/calibration.h"
#include "schedules/cluster.h"

using namespace halyard;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UserError("error: cannot read \"" + path + "\".");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Seconds the samples take under `c`.
double predicted(const Cluster& c, const std::map<std::string, std::vector<KernelSample>>& samples) {
  double t = 0;
  for (const auto& [kind, calls] : samples)
    for (const KernelSample& x : calls) t += c.kernel_time(kind, x.flops, x.bytes);
  return t;
}

double measured(const std::map<std::string, std::vector<KernelSample>>& samples) {
  double t = 0;
  for (const auto& [kind, calls] : samples)
    for (const KernelSample& x : calls) t += x.t;
  return t;
}

int run(int argc, char** argv) {
  std::string base_name, out;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf("usage: halyard-fit-kernels --base CLUSTER --out PROFILE.json PLAN.json PROFILE.txt [PLAN.json PROFILE.txt ...]\n");
      return 0;
    }
    if (k == "--base" || k == "--out") {
      if (i + 1 >= argc) throw UserError("error: " + k + " needs a value.");
      (k == "--base" ? base_name : out) = argv[++i];
    } else if (k.rfind("--", 0) == 0) {
      throw UserError("error: unknown option \"" + k + "\".\nlegal: --base --out --help");
    } else {
      files.push_back(k);
    }
  }
  if (base_name.empty() || out.empty())
    throw UserError("error: --base CLUSTER and --out PROFILE.json are required.");
  if (files.empty() || files.size() % 2)
    throw UserError("error: " + std::to_string(files.size()) + " files given.\nlegal: pairs of PLAN.json PROFILE.txt, at least one.");
  const Cluster base = Cluster::named(base_name);

  std::map<std::string, std::vector<KernelSample>> all;
  std::vector<std::pair<std::string, std::map<std::string, std::vector<KernelSample>>>> libraries;
  for (size_t i = 0; i < files.size(); i += 2) {
    auto samples = pair_profile(read_file(files[i]), read_file(files[i + 1]), files[i + 1]);
    for (const auto& [kind, calls] : samples) all[kind].insert(all[kind].end(), calls.begin(), calls.end());
    libraries.emplace_back(files[i + 1], std::move(samples));
  }

  Cluster c = base;
  c.name = base.name + "+fitted";
  size_t calls = 0;
  for (const auto& [kind, s] : all) calls += s.size();
  c.source = "kernels fitted by halyard-fit-kernels to " + std::to_string(calls) + " calls of " +
             std::to_string(libraries.size()) + " libraries; the rest " + base.name + "'s (" + base.source + ")";
  const double bf16_peak = base.peak_flops.count("bf16") ? base.peak_flops.at("bf16") : 0;
  std::printf("halyard-fit-kernels: base %s\n", base.name.c_str());
  for (const auto& [kind, s] : all) {
    double err = 0;
    c.kernels[kind] = fit_kernel(s, &err);
    const KernelCoefficients& k = c.kernels[kind];
    const double flops_s = k.s_per_flop > 0 ? 1 / k.s_per_flop : 0, bytes_s = k.s_per_byte > 0 ? 1 / k.s_per_byte : 0;
    std::printf("  %-18s %5zu calls: %9.2f TFLOP/s (%5.1f%% of the bf16 peak), %8.1f GB/s (%5.1f%% of memory), "
                "%7.1f us/call; rms error %.1f%%\n",
                kind.c_str(), s.size(), flops_s / 1e12, bf16_peak > 0 ? 100 * flops_s / bf16_peak : 0.0, bytes_s / 1e9,
                base.memory_bandwidth_bytes_per_s > 0 ? 100 * bytes_s / base.memory_bandwidth_bytes_per_s : 0.0,
                k.s_per_call * 1e6, 100 * err);
  }
  for (const auto& [name, samples] : libraries)
    std::printf("  %s: kernels %.4f s measured, %.4f s predicted by %s, %.4f s by the fit\n", name.c_str(),
                measured(samples), predicted(base, samples), base.name.c_str(), predicted(c, samples));
  std::ofstream o(out);
  o << c.to_json() << "\n";
  if (!o) throw UserError("error: cannot write the profile to \"" + out + "\".");
  std::printf("wrote %s (plan with it: halyard-plan --cluster %s ...)\n", out.c_str(), out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
}
