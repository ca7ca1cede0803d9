// Fitting the time model's kernel coefficients (cluster.h) to measured
// kernel calls: shared by halyard-calibrate, which measures CPU ranks under
// MPI, and halyard-fit-kernels, which reads the per-call times a GPU node
// wrote (scripts/gpu_check.sh) beside the plans of the libraries it ran.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "schedules/cluster.h"

namespace halyard {

// One kernel call: what the plan says it does (its charged FLOPs and bytes,
// StageCost) and the seconds it took.
struct KernelSample {
  double flops = 0, bytes = 0, t = 0;
  double scratch = 0;  // the most scratch bytes a call held at once, where the profile states it
};

// t = flops * s_per_flop + bytes * s_per_byte + s_per_call by least squares
// of the relative error (each sample weighted by 1/t, so that short and long
// kernels count alike) over the non-empty subsets of the three coefficients:
// the best fit whose coefficients are all >= 0. *rms_rel_error: its
// root-mean-square relative error.
KernelCoefficients fit_kernel(const std::vector<KernelSample>& samples, double* rms_rel_error);

// One measured step beside its plan, for Cluster::collective_lag_s: what the
// step took beyond its kernels' measured times, what the plan gives that
// part at no lag (the transfers the step waits for and the update: step_s -
// compute_s), and the lags the step waits for (Plan::collective_lags).
struct StepBeyondKernels {
  double measured_s = 0, planned_s = 0, lags = 0;
};

// The lag that accounts for the time the steps stood still beyond the plan,
// over all their lags together; 0 where they wait for none, and never
// below 0 (steps faster than planned lag no rank).
double fit_collective_lag(const std::vector<StepBeyondKernels>& steps);

// Pairs one step's Model::profile() (a line per call: "<ms> ms  <kernel>
// <label>", the label starting "<op> %<root>") with the kernel stages of
// the plan that built the library (Plan::to_json: "stages", each with
// "label", "kind", "charged_flops" and "bytes") by their root node, and
// returns the samples by kernel kind, each kind's in the plan's stage
// order. Calls of one root in the step are summed (their scratch: the
// most). Throws naming `what` and the stage when the profile lacks a
// stage: the profile is another library's, or no kernel call was timed.
std::map<std::string, std::vector<KernelSample>> pair_profile(const std::string& plan_json, const std::string& profile,
                                                              const std::string& what);

}  // namespace halyard
