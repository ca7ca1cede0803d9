// The CUDA build of generated models: compiled in every test build (no GPU is
// needed to compile), run for real where a CUDA device is present, skipped
// with "[SKIP] no CUDA device" elsewhere. On a device, the micro Llama's train
// step must match the PyTorch fixture as the CPU build does.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "llama_micro_cuda.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"
#include "tiny_llama_cuda.h"

namespace halyard {
namespace {

bool cuda_device_present() {
  void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (!lib) return false;
  using InitFn = int (*)(unsigned);
  using CountFn = int (*)(int*);
  auto init = reinterpret_cast<InitFn>(dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<CountFn>(dlsym(lib, "cuDeviceGetCount"));
  int n = 0;
  return init && count && init(0) == 0 && count(&n) == 0 && n > 0;
}

TEST(Cuda, LibrariesWereBuiltForCuda) {
  EXPECT_NE(std::string(halyard_models::llama_micro_cuda().target).find("cuda_capability_80"), std::string::npos);
  EXPECT_NE(std::string(halyard_models::tiny_llama_cuda().target).find("cuda_capability_80"), std::string::npos);
}

TEST(Cuda, MicroLlamaTrainStepMatchesTorchOnDevice) {
  if (!cuda_device_present()) GTEST_SKIP() << "[SKIP] no CUDA device";
  auto st = runtime::Safetensors::read(std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/llama_micro.safetensors");
  runtime::Model m(halyard_models::llama_micro_cuda());
  for (int i = 0; i < m.num_params(); ++i) {
    auto w = st.to_f32(m.param_spec(i).name);
    std::copy(w.begin(), w.end(), m.param(i));
  }
  auto ids = st.to_i32("input_ids"), labels = st.to_i32("labels"), pos = st.to_i32("position_ids");
  const double loss = m.train_step(ids.data(), labels.data(), pos.data());
  const double want = st.to_f64("loss")[0];
  std::printf("  cuda loss %.9f vs torch %.9f\n", loss, want);
  EXPECT_LE(std::abs(loss - want) / want, 1e-4);
  for (int i = 0; i < m.num_params(); ++i) {
    auto ref = st.to_f64(std::string("grad/") + m.param_spec(i).name);
    double diff = 0, scale = 1e-30;
    for (size_t k = 0; k < ref.size(); ++k) {
      diff = std::max(diff, std::abs(m.grad(i)[k] - ref[k]));
      scale = std::max(scale, std::abs(ref[k]));
    }
    EXPECT_LE(diff / scale, 1e-4) << m.param_spec(i).name;
  }
}

}  // namespace
}  // namespace halyard
