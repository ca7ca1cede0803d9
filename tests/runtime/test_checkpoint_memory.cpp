// The memory a checkpoint load adds, measured: loading maps the files and
// converts each tensor straight into its parameter a few MiB at a time, so the
// resident memory of the process may grow by well under one shard while it
// loads (the parameters themselves are allocated, and touched, beforehand).
//
// The model is built here by hand (no generated kernels: a load only needs
// the parameter list), three 2M-element matrices and a norm, so that the
// files are several MiB. Two loads are measured, each printing its figure:
//   - a Hugging Face folder of BF16 shards with model.safetensors.index.json
//     (converted to F32 per tensor), as transformers publishes a model;
//   - a step directory written by save_checkpoint in F32 shards, whose load
//     also verifies every file's checksum.
// Beside them, as a control that the measurement sees a shard-sized buffer,
// Safetensors::read of one shard (which holds every tensor in memory).
// The peak is Linux's VmHWM after clear_refs restarted it (runtime/measure.h).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/adamw.h"
#include "runtime/checkpoint.h"
#include "runtime/measure.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"
#include "tests/temp_dir.h"

#if defined(__SANITIZE_ADDRESS__)
#define HALYARD_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HALYARD_UNDER_ASAN 1
#endif
#endif

namespace halyard::runtime {
namespace {

namespace fs = std::filesystem;
using halyard::testing::TempDir;

constexpr const char* kConfig = R"({"model_type": "memory_probe"})";

// Parameter i: a [2048, 1024] matrix (BF16: 4 MiB; F32: 8 MiB), the last a norm.
const ParamSpec kParams[] = {
    {"model.embed_tokens.weight", 2, {2048, 1024}, 2048 * 1024, 2, {2048, 1024}},
    {"model.layers.0.mlp.up_proj.weight", 2, {2048, 1024}, 2048 * 1024, 2, {2048, 1024}},
    {"lm_head.weight", 2, {2048, 1024}, 2048 * 1024, 2, {2048, 1024}},
    {"model.norm.weight", 1, {1024}, 1024, 1, {1024}},
};

const ModelSpec& probe_spec() {
  static const ModelSpec spec = [] {
    ModelSpec s{};
    s.name = "memory_probe";
    s.config_json = kConfig;
    s.schedule = "";
    s.target = "host";
    s.batch = 1;
    s.seq = 1;
    s.vocab = 2048;
    s.sp = 1;
    s.local_seq = 1;
    s.ignore_index = -100;
    s.params = kParams;
    s.num_params = static_cast<int>(std::size(kParams));
    return s;
  }();
  return spec;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// Resident memory `f` adds at its peak, over what the process holds before it.
template <typename F>
int64_t peak_extra_bytes(F&& f) {
  if (!reset_peak_rss()) return -1;
  const int64_t before = current_rss_bytes();
  f();
  return peak_rss_bytes() - before;
}

// A deterministic value for element i of parameter p, exact in BF16.
float value(int p, int64_t i) { return static_cast<float>((i * 7 + p * 13) % 251 - 125) / 64.0f; }

// The HF folder: one BF16 shard per parameter (the norm in the last), the index, config.json.
// Returns the largest shard's size.
int64_t write_bf16_folder(const std::string& dir) {
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0, largest = 0;
  const int shards = 3;
  for (int k = 0; k < shards; ++k) {
    const std::string file = "model-0000" + std::to_string(k + 1) + "-of-00003.safetensors";
    std::map<std::string, std::vector<uint16_t>> bits;
    std::map<std::string, TensorView> views;
    for (int p = 0; p < probe_spec().num_params; ++p) {
      if (std::min(p, shards - 1) != k) continue;
      const ParamSpec& ps = kParams[p];
      std::vector<uint16_t>& b = bits[ps.name];
      b.resize(static_cast<size_t>(ps.numel));
      for (int64_t i = 0; i < ps.numel; ++i) {
        const float v = value(p, i);
        uint32_t u;
        std::memcpy(&u, &v, 4);
        b[static_cast<size_t>(i)] = static_cast<uint16_t>(u >> 16);  // exact: the values have short mantissas
      }
      views[ps.name] = TensorView{Dtype::BF16, {ps.hf_shape, ps.hf_shape + ps.hf_rank},
                                  {reinterpret_cast<const uint8_t*>(b.data()), b.size() * 2}};
      weight_map[ps.name] = file;
      total += ps.numel * 2;
    }
    const FileDigest d = write_safetensors(dir + "/" + file, views, {{"format", "pt"}});
    largest = std::max(largest, static_cast<int64_t>(d.bytes));
  }
  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump(2);
  std::ofstream(dir + "/config.json") << kConfig;
  return largest;
}

void touch(Model& m) {
  for (int p = 0; p < m.num_params(); ++p) std::memset(m.param(p), 0x11, static_cast<size_t>(m.param_spec(p).numel) * 4);
}

void expect_below(int64_t extra, int64_t shard, const char* what) {
#ifdef HALYARD_UNDER_ASAN
  std::printf("  (ASan build: the figure includes ASan's own memory; not checked)\n");
#else
  EXPECT_LT(extra, shard) << what << ": a load may add less than one shard of resident memory";
#endif
}

TEST(CheckpointMemory, ShardedBf16LoadAddsLessThanOneShard) {
  TempDir dir;
  const int64_t largest = write_bf16_folder(dir.path);
  int64_t total = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) total += static_cast<int64_t>(fs::file_size(e.path()));

  Model m(probe_spec());
  touch(m);  // the parameters are resident before the measurement starts
  int64_t step = -1;
  const int64_t extra = peak_extra_bytes([&] { step = load_checkpoint(dir.path, m, nullptr); });
  if (extra < 0) GTEST_SKIP() << "[SKIP] the kernel refuses /proc/self/clear_refs; the peak cannot be restarted";
  EXPECT_EQ(step, 0);
  for (int p = 0; p < m.num_params(); ++p) {
    const int64_t n = m.param_spec(p).numel;
    for (int64_t i : {int64_t{0}, n / 2, n - 1}) ASSERT_EQ(m.param(p)[i], value(p, i)) << kParams[p].name << "[" << i << "]";
  }

  Safetensors held;
  const int64_t control = peak_extra_bytes([&] { held = Safetensors::read(dir / "model-00001-of-00003.safetensors"); });

  std::printf("[interop] load_checkpoint of 3 BF16 shards + index (%lld bytes in all, largest shard %lld) into F32 "
              "parameters: peak extra resident memory %lld bytes (%.2f MiB, %.0f%% of the largest shard)\n",
              static_cast<long long>(total), static_cast<long long>(largest), static_cast<long long>(extra), mib(extra),
              100.0 * static_cast<double>(extra) / static_cast<double>(largest));
  std::printf("[interop] control: Safetensors::read of one shard (every tensor held in memory): %lld bytes (%.2f MiB)\n",
              static_cast<long long>(control), mib(control));
  expect_below(extra, largest, "BF16 shards");
  EXPECT_GE(control, largest * 9 / 10) << "the measurement must see a shard held in memory";
}

TEST(CheckpointMemory, StepDirectoryLoadWithChecksumsAddsLessThanOneShard) {
  TempDir dir;
  int64_t largest = 0;
  {
    Model m(probe_spec());
    for (int p = 0; p < m.num_params(); ++p)
      for (int64_t i = 0; i < m.param_spec(p).numel; ++i) m.param(p)[i] = value(p, i);
    std::vector<int64_t> sizes;
    std::vector<bool> decay;
    for (int p = 0; p < m.num_params(); ++p) {
      sizes.push_back(m.param_spec(p).numel);
      decay.push_back(true);
    }
    AdamW opt(sizes, decay);
    save_checkpoint(dir.path, m, opt, 7, 9'000'000);  // one 8 MiB F32 matrix per shard
  }
  const std::string step_dir = dir / "step-00000007";
  for (const auto& e : fs::directory_iterator(step_dir))
    if (e.path().filename().string().rfind("model-", 0) == 0)
      largest = std::max(largest, static_cast<int64_t>(fs::file_size(e.path())));
  ASSERT_TRUE(fs::exists(step_dir + "/checksums.json"));
  ASSERT_TRUE(fs::exists(step_dir + "/model.safetensors.index.json"));

  Model m(probe_spec());
  touch(m);
  int64_t step = -1;
  const int64_t extra = peak_extra_bytes([&] { step = load_checkpoint(dir.path, m, nullptr); });
  if (extra < 0) GTEST_SKIP() << "[SKIP] the kernel refuses /proc/self/clear_refs; the peak cannot be restarted";
  EXPECT_EQ(step, 7);
  EXPECT_EQ(m.param(1)[12345], value(1, 12345));
  std::printf("[interop] load_checkpoint of a step directory (F32 shards, checksums verified; largest shard %lld "
              "bytes): peak extra resident memory %lld bytes (%.2f MiB, %.0f%% of the largest shard)\n",
              static_cast<long long>(largest), static_cast<long long>(extra), mib(extra),
              100.0 * static_cast<double>(extra) / static_cast<double>(largest));
  expect_below(extra, largest, "F32 shards with checksums");
}

}  // namespace
}  // namespace halyard::runtime
