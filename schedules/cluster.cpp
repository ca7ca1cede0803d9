// Cluster descriptions, presets and JSON (see cluster.h).
#include "schedules/cluster.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dsl/error.h"
#include "dsl/types.h"

namespace halyard {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// A GPU cluster from its datasheet. Matmuls and attention reach `mm_eff` and
// `attn_eff` of the bf16 peak, memory-bound kernels 80% of HBM bandwidth;
// collectives within a node run over NVLink at `nvlink` bytes/s per GPU and
// direction, across nodes over `ib` bytes/s per GPU; copies to and from the
// host over `pcie` bytes/s each way (PCIe 4.0 x16 on A100, 5.0 on H100/H200).
Cluster gpu_preset(const std::string& name, int64_t ranks, double mem_gib, double bf16, double f32, double hbm, double nvlink,
            double ib, double pcie) {
  Cluster c;
  c.name = name;
  c.source = "datasheet preset: bf16 matmuls at 60% and attention at 40% of peak, other kernels at 80% of HBM "
             "bandwidth, NVLink within a node, 400 Gb/s InfiniBand per GPU across nodes, PCIe to the host at 80% "
             "of its rate; CUDA context and NCCL buffers 1 GiB per rank";
  c.device = "cuda";
  c.ranks = ranks;
  c.ranks_per_node = std::min<int64_t>(ranks, 8);
  c.memory_per_rank_bytes = static_cast<int64_t>(mem_gib * kGiB);
  c.peak_flops = {{"bf16", bf16}, {"f32", f32}};
  c.memory_bandwidth_bytes_per_s = hbm;
  c.process_baseline_bytes = static_cast<int64_t>(kGiB);
  const double per_byte = 1 / (0.8 * hbm);
  for (const std::string& k : kernel_kinds()) c.kernels[k] = {0, per_byte, 5e-6};
  c.kernels["contract"].s_per_flop = c.kernels["contract_seq"].s_per_flop = 1 / (0.6 * bf16);
  for (const char* k : {"attention", "attention_lse", "attention_grad_q", "attention_grad_kv"})
    c.kernels[k].s_per_flop = 1 / (0.4 * bf16);
  for (const char* k : {"all_to_all", "all_reduce", "all_gather", "ring_shift"}) c.collectives[k] = {10e-6, 1 / nvlink};
  c.inter_node = {10e-6, 1 / ib};
  c.host_link = {10e-6, 1 / (0.8 * pcie)};
  return c;
}

// Uncalibrated CPU ranks: a rough x86 core (AVX2 FMA at a third of peak) and
// shared-memory MPI. halyard-calibrate replaces every number with a measured one.
Cluster local_cpu() {
  Cluster c;
  c.name = "local-cpu";
  c.source = "uncalibrated defaults for CPU ranks; run halyard-calibrate for measured coefficients";
  c.ranks = 4;
  c.ranks_per_node = 4;
  c.peak_flops = {{"f32", 50e9}};
  c.memory_bandwidth_bytes_per_s = 10e9;
  c.process_baseline_bytes = 40 << 20;
  for (const std::string& k : kernel_kinds()) c.kernels[k] = {1 / 20e9, 1 / 8e9, 20e-6};
  for (const char* k : {"all_to_all", "all_reduce", "all_gather", "ring_shift"}) c.collectives[k] = {20e-6, 1 / 2e9};
  return c;
}

LinkCoefficients link_from(const nlohmann::json& j) {
  return {j.value("alpha_s", 0.0), j.value("beta_s_per_byte", 0.0)};
}

}  // namespace

const std::vector<std::string>& kernel_kinds() {
  static const std::vector<std::string> k = {"contract",         "contract_seq",      "attention", "attention_lse",
                                             "attention_grad_q", "attention_grad_kv", "norm",      "pointwise",
                                             "embedding",        "loss",              "copy"};
  return k;
}

std::string kernel_kind_stand_in(const std::string& kind) {
  if (kind == "attention_lse") return "attention";
  if (kind == "attention_grad_q") return "attention_grad_kv";
  if (kind == "contract_seq") return "contract";
  return "";
}

double Cluster::kernel_time(const std::string& kind, double flops, double bytes) const {
  auto it = kernels.find(kind);
  // A cluster file that lists some kinds: a missing one is priced as the
  // kind doing its work (halyard-calibrate's stand-in), not as a pointwise
  // kernel (which made a log-sum-exp alone cost its bytes alone).
  if (it == kernels.end()) it = kernels.find(kernel_kind_stand_in(kind));
  if (it == kernels.end()) it = kernels.find("pointwise");
  if (it == kernels.end()) return 0;
  const KernelCoefficients& k = it->second;
  return flops * k.s_per_flop + bytes * k.s_per_byte + k.s_per_call;
}

double Cluster::collective_time(const std::string& kind, double bytes, int64_t degree) const {
  if (degree <= 1) return 0;
  auto it = collectives.find(kind);
  // A ring shift (send to the next rank, receive from the one before) is
  // priced on the all-to-all's link in profiles calibrated before it was measured.
  if (it == collectives.end() && kind == "ring_shift") it = collectives.find("all_to_all");
  if (it == collectives.end()) return 0;
  double t = it->second.alpha_s + bytes * it->second.beta_s_per_byte;
  // A group wider than a node sends the share bound for other nodes over the slower link.
  if (degree > ranks_per_node && ranks_per_node > 0)
    t += inter_node.alpha_s + bytes * (1.0 - static_cast<double>(ranks_per_node) / static_cast<double>(degree)) *
                                  inter_node.beta_s_per_byte;
  return t;
}

double Cluster::lag_share(const std::string& kind, int64_t degree) {
  if (degree <= 1) return 0;
  const double k = kind == "ring_shift" ? 1 : static_cast<double>(degree - 1);
  return k / (k + 1);
}

int64_t Cluster::threads_per_rank(int64_t on_mesh) const {
  const int64_t on_node = std::max<int64_t>(1, std::min(on_mesh, ranks_per_node));
  if (cores_per_node > 0) return std::max<int64_t>(1, cores_per_node / on_node);
  return std::max<int64_t>(1, on_mesh >= ranks_per_node ? 1 : ranks_per_node / on_mesh);
}

std::string Cluster::to_json() const {
  nlohmann::json j = {{"name", name},
                      {"source", source},
                      {"ranks", ranks},
                      {"ranks_per_node", ranks_per_node},
                      {"memory_per_rank_bytes", memory_per_rank_bytes},
                      {"peak_flops", peak_flops},
                      {"memory_bandwidth_bytes_per_s", memory_bandwidth_bytes_per_s},
                      {"process_baseline_bytes", process_baseline_bytes}};
  if (cores_per_node > 0) j["cores_per_node"] = cores_per_node;
  if (collective_lag_s > 0) j["collective_lag_s"] = collective_lag_s;
  for (const auto& [k, v] : kernels)
    j["kernels"][k] = {{"s_per_flop", v.s_per_flop}, {"s_per_byte", v.s_per_byte}, {"s_per_call", v.s_per_call}};
  for (const auto& [k, v] : collectives) j["collectives"][k] = {{"alpha_s", v.alpha_s}, {"beta_s_per_byte", v.beta_s_per_byte}};
  j["inter_node"] = {{"alpha_s", inter_node.alpha_s}, {"beta_s_per_byte", inter_node.beta_s_per_byte}};
  if (gpu()) j["device"] = device;
  if (has_host_link())
    j["host_link"] = {{"alpha_s", host_link.alpha_s}, {"beta_s_per_byte", host_link.beta_s_per_byte}};
  return j.dump(2);
}

Cluster Cluster::parse(const std::string& text, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for a number past double (1e400)
    throw UserError("error: cluster \"" + what + "\" is not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw UserError("error: cluster \"" + what + "\" must be a JSON object.");
  Cluster c;
  try {
    c.name = j.value("name", what);
    c.source = j.value("source", "file " + what);
    c.ranks = j.value("ranks", int64_t{1});
    c.ranks_per_node = j.value("ranks_per_node", c.ranks);
    c.cores_per_node = j.value("cores_per_node", int64_t{0});
    c.memory_per_rank_bytes = j.value("memory_per_rank_bytes", int64_t{0});
    if (j.contains("peak_flops")) c.peak_flops = j["peak_flops"].get<std::map<std::string, double>>();
    c.memory_bandwidth_bytes_per_s = j.value("memory_bandwidth_bytes_per_s", 0.0);
    c.process_baseline_bytes = j.value("process_baseline_bytes", int64_t{0});
    if (j.contains("kernels"))
      for (auto it = j["kernels"].begin(); it != j["kernels"].end(); ++it) {
        const std::vector<std::string>& kinds = kernel_kinds();
        if (std::find(kinds.begin(), kinds.end(), it.key()) == kinds.end())
          throw UserError("error: cluster \"" + what + "\": kernel kind \"" + it.key() + "\" is unknown.\nlegal: " +
                          join(kinds) + ".");
        c.kernels[it.key()] = {it->value("s_per_flop", 0.0), it->value("s_per_byte", 0.0), it->value("s_per_call", 0.0)};
      }
    if (j.contains("collectives"))
      for (auto it = j["collectives"].begin(); it != j["collectives"].end(); ++it) c.collectives[it.key()] = link_from(*it);
    if (j.contains("inter_node")) c.inter_node = link_from(j["inter_node"]);
    if (j.contains("host_link")) c.host_link = link_from(j["host_link"]);
    c.collective_lag_s = j.value("collective_lag_s", 0.0);
    // Files from before "device" existed: a host link was a GPU's.
    c.device = j.value("device", j.contains("host_link") ? "cuda" : "cpu");
  } catch (const nlohmann::json::exception& e) {
    throw UserError("error: cluster \"" + what + "\" has an ill-typed field: " + e.what() +
                    "\nlegal: numbers for ranks, bandwidths and coefficients (see schedules/cluster.h).");
  }
  if (c.device != "cpu" && c.device != "cuda")
    throw UserError("error: cluster \"" + what + "\": device \"" + c.device + "\".\nlegal: \"cpu\" or \"cuda\".");
  if (!c.gpu() && c.has_host_link())
    throw UserError("error: cluster \"" + what + "\" has device \"cpu\" and a host_link: a CPU rank's memory is host "
                    "memory already, there is no link to offload over.\nfix: drop \"host_link\", or say \"device\": \"cuda\".");
  if (c.cores_per_node < 0)
    throw UserError("error: cluster \"" + what + "\": cores_per_node " + std::to_string(c.cores_per_node) +
                    ".\nlegal: the cores of a node (>= 1), or leave it out when unknown.");
  if (!(c.collective_lag_s >= 0))
    throw UserError("error: cluster \"" + what + "\": collective_lag_s " + std::to_string(c.collective_lag_s) +
                    ".\nlegal: seconds >= 0, or leave it out (0).");
  if (c.ranks < 1 || c.ranks_per_node < 1)
    throw UserError("error: cluster \"" + what + "\": ranks " + std::to_string(c.ranks) + ", ranks_per_node " +
                    std::to_string(c.ranks_per_node) + ".\nlegal: both >= 1.");
  return c;
}

const std::vector<std::string>& Cluster::presets() {
  static const std::vector<std::string> names = {"local-cpu", "8xA100-80GB", "8xH100-80GB", "8xH200", "64xH100-80GB"};
  return names;
}

Cluster Cluster::named(const std::string& n) {
  if (n == "local-cpu") return local_cpu();
  if (n == "8xA100-80GB") return gpu_preset(n, 8, 80, 312e12, 19.5e12, 2.039e12, 300e9, 50e9, 32e9);
  if (n == "8xH100-80GB") return gpu_preset(n, 8, 80, 989e12, 67e12, 3.35e12, 450e9, 50e9, 64e9);
  if (n == "8xH200") return gpu_preset(n, 8, 141, 989e12, 67e12, 4.8e12, 450e9, 50e9, 64e9);
  if (n == "64xH100-80GB") return gpu_preset(n, 64, 80, 989e12, 67e12, 3.35e12, 450e9, 50e9, 64e9);
  std::ifstream in(n);
  if (!in)
    throw UserError("error: cluster \"" + n + "\" is neither a preset nor a readable file.\nlegal: " + join(presets()) +
                    ",\nor a path to a cluster or machine-profile .json (halyard-calibrate writes one).");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), n);
}

}  // namespace halyard
