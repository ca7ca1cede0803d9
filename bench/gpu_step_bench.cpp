// Training-step throughput and device memory of the tiny Llama's CUDA
// libraries, and of Llama-3.2-1B's at 32k tokens (the target), one
// library per process:
//
//   gpu_step_bench --seq N [--steps K] [--precision f32|bf16] [--model tiny|llama-3.2-1b]
//                  [--schedule autosp] [--no-update] [--profile-dir DIR]
//
// (bf16: the mixed-precision libraries, examples/llama/schedules/
// bf16_mixed.json: contractions through cuBLAS's bf16 GEMM with f32 sums,
// saved values in bf16, everything else f32. --schedule autosp: Llama-3.2-1B
// as AutoSP planned it for one H100 (bench/CMakeLists.txt). --no-update
// skips the AdamW timings, three steps and more of a large model.) It
// prints one JSON line: median step time after one warm-up step (which pays
// the driver's PTX compilation), tokens/s, the device memory the step held
// at its peak (sampled, above what was in use before the model existed), and
// the copies home the executor made in a step; then one more step waiting
// for the device around each kernel (Model::set_kernel_times_on_device) for
// the device time of its attention kernels (attention_s: every layer's
// forward and backward) and of the others (other_kernels_s), whose profile
// (each kernel's device time, Model::profile()) --profile-dir writes to
// DIR/<library>.profile.txt for halyard-fit-kernels; then, with
// AdamW on the device (Model::use_adamw: parameters and gradients stay
// there), the median of a step and its update (step_and_update_s_median),
// of the update alone (update_s_median), and a step's copies each way; and
// what the library's plan predicted for its cluster (plan_cluster): the step
// (predicted_step_s) and the peak per rank (predicted_peak_mib, AdamW's
// moments included: predicted_optimizer_mib of it).
// Without a CUDA device it
// prints the line with "skip": "<why>" and exits 77; a step that fails (out of device
// memory, say) prints {"error": "<what>"} and exits 1. scripts/gpu_check.sh
// runs it beside bench/torch_peer.py on the same GPU.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "bench/bench_util.h"
#include "runtime/cuda_probe.h"
#include "runtime/error.h"
#include "runtime/model.h"
#include "gpu_1b_autosp_s32768.h"
#include "gpu_1b_bf16_s32768.h"
#include "gpu_tiny_bf16_s16384.h"
#include "gpu_tiny_bf16_s32768.h"
#include "gpu_tiny_bf16_s8192.h"
#include "gpu_tiny_s16384.h"
#include "gpu_tiny_s32768.h"
#include "gpu_tiny_s8192.h"

using namespace halyard;

namespace {

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

// The library's schedule and what its plan predicted (ModelSpec::plan_json)
// for its cluster, as JSON fields after a comma; "" without a plan.
std::string plan_fields(const runtime::ModelSpec& spec) {
  if (!spec.plan_json || !*spec.plan_json) return "";
  const auto plan = nlohmann::ordered_json::parse(spec.plan_json);
  const double mib = 1 << 20;
  char out[512];
  std::snprintf(out, sizeof out,
                ",\"schedule\":\"%s\",\"plan_cluster\":\"%s\",\"predicted_step_s\":%.4f,\"predicted_peak_mib\":%.1f,"
                "\"predicted_optimizer_mib\":%.1f",
                json_escape(plan.value("schedule", "")).c_str(), json_escape(plan.value("cluster", "")).c_str(),
                plan.value("predicted_step_s", 0.0), plan.value("predicted_peak_bytes_per_rank", 0.0) / mib,
                plan["memory_per_rank"].value("optimizer_state", 0.0) / mib);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using Key = std::tuple<std::string, std::string, int64_t>;  // model, precision or "autosp", seq
  const std::map<Key, const runtime::ModelSpec& (*)()> models = {
      {{"tiny", "f32", 8192}, &halyard_models::gpu_tiny_s8192},
      {{"tiny", "f32", 16384}, &halyard_models::gpu_tiny_s16384},
      {{"tiny", "f32", 32768}, &halyard_models::gpu_tiny_s32768},
      {{"tiny", "bf16", 8192}, &halyard_models::gpu_tiny_bf16_s8192},
      {{"tiny", "bf16", 16384}, &halyard_models::gpu_tiny_bf16_s16384},
      {{"tiny", "bf16", 32768}, &halyard_models::gpu_tiny_bf16_s32768},
      {{"llama-3.2-1b", "bf16", 32768}, &halyard_models::gpu_1b_bf16_s32768},
      {{"llama-3.2-1b", "autosp", 32768}, &halyard_models::gpu_1b_autosp_s32768}};
  int64_t seq = 0;
  int steps = 3;
  std::string precision = "f32", model = "tiny", schedule, profile_dir;
  bool update = true, bad = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--no-update") update = false;
    else if (i + 1 == argc) bad = true;
    else if (k == "--seq") seq = std::atoll(argv[++i]);
    else if (k == "--steps") steps = std::atoi(argv[++i]);
    else if (k == "--precision") precision = argv[++i];
    else if (k == "--model") model = argv[++i];
    else if (k == "--schedule") schedule = argv[++i];
    else if (k == "--profile-dir") profile_dir = argv[++i];
    else bad = true;
  }
  // AutoSP's plan computes its contractions in bf16: it is a mixed-precision library.
  if (schedule == "autosp" && precision == "f32") precision = "bf16";
  const std::string variant = schedule == "autosp" ? schedule : precision;
  if (bad || (!schedule.empty() && schedule != "autosp") || !models.count({model, variant, seq}) || steps < 1) {
    std::fprintf(stderr, "usage: gpu_step_bench --seq N [--steps K>=1] [--precision f32|bf16] [--model M] [--schedule autosp] "
                         "[--no-update] [--profile-dir DIR]; the libraries (model precision-or-schedule seq):");
    for (const auto& [key, f] : models)
      std::fprintf(stderr, " %s/%s/%lld", std::get<0>(key).c_str(), std::get<1>(key).c_str(),
                   static_cast<long long>(std::get<2>(key)));
    std::fprintf(stderr, "\n");
    return 2;
  }
  const runtime::ModelSpec& spec = models.at({model, variant, seq})();
  // The line of a run that measured nothing: which one, and `key` ("skip" or "error") saying why.
  auto unmeasured = [&](const char* key, const std::string& why) {
    std::printf("{\"peer\":\"halyard\",\"config\":\"%s\",\"dtype\":\"%s\",\"seq\":%lld,\"%s\":\"%s\"%s}\n",
                json_escape(model).c_str(), precision.c_str(), static_cast<long long>(seq), key, json_escape(why).c_str(),
                plan_fields(spec).c_str());
  };
  runtime::CudaProbe gpu;
  if (!gpu.present()) {
    unmeasured("skip", gpu.why_absent());
    return 77;
  }
  const int64_t baseline = gpu.memory_used_bytes();
  try {
    runtime::Model m(spec);
    m.init_params(0);
    const int64_t n = m.tokens();
    std::vector<int32_t> ids(static_cast<size_t>(n)), labels(static_cast<size_t>(n)), pos(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
      ids[static_cast<size_t>(t)] = static_cast<int32_t>((t * 37 + 11) % 256);
      labels[static_cast<size_t>(t)] = static_cast<int32_t>((t * 53 + 7) % 256);
      pos[static_cast<size_t>(t)] = static_cast<int32_t>(t % m.spec().seq);
    }
    double loss = 0;
    gpu.start_sampling();
    const double secs =
        bench::median_seconds([&] { loss = m.train_step(ids.data(), labels.data(), pos.data()); }, steps);
    const int64_t peak = gpu.stop_sampling();
    const auto& t = m.last_step_times();
    const int64_t copies = t.device_to_host_copies, freed = t.device_buffers_freed;
    m.set_kernel_times_on_device(true);
    if (!profile_dir.empty()) setenv("HALYARD_PROFILE", "1", 1);
    m.train_step(ids.data(), labels.data(), pos.data());
    const double attention_s = t.attention_s, other_kernels_s = t.other_kernels_s;
    // With HALYARD_PROFILE set, each kernel's device time in that step, on stderr.
    if (std::getenv("HALYARD_PROFILE")) std::fputs(m.profile().c_str(), stderr);
    if (!profile_dir.empty()) {
      const std::string path = profile_dir + "/" + m.spec().name + ".profile.txt";
      std::ofstream out(path);
      out << m.profile();
      if (!out) throw runtime::Error("error: cannot write the profile to \"" + path + "\".");
    }
    m.set_kernel_times_on_device(false);
    const int64_t blocks = m.device_bytes();
    double with_update = 0, update_s = 0;
    int64_t to_host = 0, to_device = 0;
    if (update) {
      m.use_adamw(m.decay_flags());
      int64_t updates = 0;
      auto step_and_update = [&] {
        m.train_step(ids.data(), labels.data(), pos.data());
        m.adamw_step(++updates, 1e-4, 1.0);
      };
      step_and_update();  // (the moments are made at the first update)
      with_update = bench::median_seconds(step_and_update, steps);
      to_host = t.device_to_host_copies, to_device = t.host_to_device_copies;
      update_s = bench::median_seconds([&] { m.adamw_step(++updates, 1e-4, 1.0); }, steps);
    }
    char updates_json[320] = "";
    if (update)
      std::snprintf(updates_json, sizeof updates_json,
                    ",\"step_and_update_s_median\":%.4f,\"update_s_median\":%.5f,\"device_update_copies_home\":%lld,"
                    "\"device_update_copies_to_device\":%lld,\"device_update_mib\":%.1f",
                    with_update, update_s, static_cast<long long>(to_host), static_cast<long long>(to_device),
                    static_cast<double>(m.device_bytes()) / (1 << 20));
    std::printf("{\"peer\":\"halyard\",\"device\":\"%s\",\"target\":\"%s\",\"model\":\"%s\",\"config\":\"%s\",\"dtype\":\"%s\","
                "\"seq\":%lld,\"batch\":%lld,\"loss\":%.6f,\"step_s_median\":%.4f,\"tokens_per_s\":%.1f,"
                "\"peak_device_mib\":%.1f,\"executor_blocks_mib\":%.1f,\"device_to_host_copies\":%lld,"
                "\"device_buffers_freed\":%lld,\"attention_s\":%.5f,\"other_kernels_s\":%.5f%s%s}\n",
                json_escape(gpu.name()).c_str(), m.spec().target, m.spec().name, json_escape(model).c_str(), precision.c_str(),
                static_cast<long long>(m.spec().seq),
                static_cast<long long>(m.spec().batch), loss, secs, static_cast<double>(n) / secs,
                static_cast<double>(peak - baseline) / (1 << 20), static_cast<double>(blocks) / (1 << 20),
                static_cast<long long>(copies), static_cast<long long>(freed), attention_s, other_kernels_s,
                updates_json, plan_fields(spec).c_str());
  } catch (const std::exception& e) {
    gpu.stop_sampling();
    unmeasured("error", e.what());
    return 1;
  }
  return 0;
}
