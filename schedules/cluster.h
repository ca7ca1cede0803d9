// What a plan runs on: ranks, memory per rank, and the coefficients of the
// time model, from a calibration run on this machine or a preset.
//
// Time of a kernel stage of kind K (kernel_kinds(): contract, contract_seq
// for a contraction over tokens, one kind per attention kernel, norm,
// pointwise, embedding, loss, copy): flops * s_per_flop + bytes * s_per_byte +
// s_per_call, each coefficient per kind. Time of a collective: alpha +
// beta * bytes, bytes being what each rank sends. Presets describe GPU
// clusters by their datasheets (peak FLOP/s at a stated efficiency, memory
// and link bandwidths); the CPU profile of this machine comes from
// halyard-calibrate (examples/llama/calibrate.cpp), which measures the
// generated kernels, the MPI collectives and the process's own memory.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace halyard {

struct KernelCoefficients {
  double s_per_flop = 0, s_per_byte = 0, s_per_call = 0;
  bool operator==(const KernelCoefficients&) const = default;
};

struct LinkCoefficients {
  double alpha_s = 0, beta_s_per_byte = 0;
  bool operator==(const LinkCoefficients&) const = default;
};

struct Cluster {
  std::string name;
  std::string source;  // where the numbers come from (calibration run, datasheet)
  int64_t ranks = 1, ranks_per_node = 1;
  // CPU cores of a node (halyard-calibrate writes the machine's), shared by
  // the ranks on it as the runtime shares them (default_threads_per_rank):
  // what per-thread scratch the plan counts. 0: unknown, and a rank is
  // taken to have ranks_per_node / ranks threads.
  int64_t cores_per_node = 0;
  // Threads of one rank when `ranks` ranks run.
  int64_t threads_per_rank(int64_t ranks) const;
  // What a rank is: "cpu" (a process on CPU cores) or "cuda" (an NVIDIA
  // GPU). It decides the kernels a plan counts (Schedule::on_gpu).
  std::string device = "cpu";
  bool gpu() const { return device != "cpu"; }
  int64_t memory_per_rank_bytes = 0;  // 0: unknown
  std::map<std::string, double> peak_flops;  // per dtype ("f32", "bf16"), per rank
  double memory_bandwidth_bytes_per_s = 0;   // per rank
  // Memory a rank holds before the model: the process, its libraries, MPI
  // (or the CUDA context on a GPU).
  int64_t process_baseline_bytes = 0;
  std::map<std::string, KernelCoefficients> kernels;       // by stage kind
  std::map<std::string, LinkCoefficients> collectives;     // all_to_all, all_reduce, all_gather: within a node
  LinkCoefficients inter_node;                             // added per byte when a collective crosses nodes
  // Copies between a rank's device and its host memory (PCIe), each way:
  // what offloading a value costs. Zero on CPU ranks (none to offload to).
  LinkCoefficients host_link;
  bool has_host_link() const { return host_link.beta_s_per_byte > 0; }
  // How far behind a rank the others may be when it reaches a collective
  // it waits on: where ranks share cores the scheduler runs them in turns
  // (4 ranks on 2 cores), and one waiting on k others stands still for the
  // latest of k lags, k / (k + 1) of this on average if they spread evenly
  // up to it (k: the group's other ranks; a ring shift's one). Beyond the
  // transfer. halyard-calibrate measures it from its training steps; 0 in
  // the presets.
  double collective_lag_s = 0;
  // What a collective of `kind` over `degree` ranks waits for, in units of
  // collective_lag_s: k / (k + 1).
  static double lag_share(const std::string& kind, int64_t degree);

  // Time of a kernel stage of this kind; unknown kinds use "pointwise".
  double kernel_time(const std::string& kind, double flops, double bytes) const;
  double collective_time(const std::string& kind, double bytes_per_rank, int64_t degree) const;

  std::string to_json() const;
  static Cluster parse(const std::string& json_text, const std::string& what);
  // A preset name (presets()) or a path to a cluster/profile .json file.
  static Cluster named(const std::string& name_or_path);
  static const std::vector<std::string>& presets();
};

// The stage kinds the time model distinguishes.
const std::vector<std::string>& kernel_kinds();

// The kind whose measured coefficients stand in for `kind` where a
// calibration ran no kernel of it, or "" where none does the same work per
// FLOP (then its bytes at the memory's bandwidth): a log-sum-exp alone
// computes the forward's scores, dQ alone the backward's products.
std::string kernel_kind_stand_in(const std::string& kind);

}  // namespace halyard
