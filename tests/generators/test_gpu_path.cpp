// The executor's device path and the GPU loop schedule, run for real without
// a GPU: libraries built for Halide's OpenCL target (the same
// generators/schedule_gpu.cpp as CUDA, every Func a GPU kernel), run by
// PoCL, OpenCL on the CPU (Debian's pocl-opencl-icd, which scripts/setup.sh
// installs). What a CUDA step does with device buffers is what these do:
// Halide's device interface is the same, only the backend differs (cuBLAS,
// a CUDA-only extern, is not in them: their contractions are Halide's).
//   - the micro Llama's step equals the PyTorch fixture, within 1e-4;
//   - step after step, and after an evaluation in between, the results stay
//     the same: the buffers keep their device allocations (none freed), and
//     only the loss and the gradients come home;
//   - two sequence-parallel ranks (threads) of the tiny Llama, checkpointed
//     and tiled (views of device buffers, tiles concatenated, all-to-alls
//     of device-resident values), equal the single-rank CPU library.
#include <gtest/gtest.h>

#include <HalideRuntime.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "llama_micro_opencl.h"
#include "tests/device_step.h"
#include "tests/generators/sp_check.h"
#include "tiny_opencl_sp2_s126_tiled.h"
#include "tiny_sp1_s126.h"

namespace halyard {
namespace {

constexpr double kTolerance = 1e-4;  // the GPU schedule sums in another order than the CPU's

std::string fixture(const std::string& name) { return std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/" + name; }

TEST(GpuPath, LibrariesAreOpenClBuildsOfTheGpuSchedule) {
  const std::string t = halyard_models::llama_micro_opencl().target;
  EXPECT_NE(t.find("opencl"), std::string::npos) << t;
  EXPECT_EQ(t.find("cuda"), std::string::npos) << t;
}

TEST(GpuPath, MicroLlamaStepsOnTheDeviceMatchTorchAndKeepTheirBuffers) {
  auto st = runtime::Safetensors::read(fixture("llama_micro.safetensors"));
  runtime::Model m(halyard_models::llama_micro_opencl());
  testing::load_params(m, st);
  auto ids = st.to_i32("input_ids"), labels = st.to_i32("labels"), pos = st.to_i32("position_ids");
  const double want = st.to_f64("loss")[0];
  std::vector<std::vector<double>> ref;
  for (int i = 0; i < m.num_params(); ++i) ref.push_back(st.to_f64(std::string("grad/") + m.param_spec(i).name));
  auto check = [&](const char* when) {
    double worst = 0;
    for (int i = 0; i < m.num_params(); ++i) {
      const double e = testing::rel_diff(m.grad(i), ref[static_cast<size_t>(i)]);
      worst = std::max(worst, e);
      EXPECT_LE(e, kTolerance) << when << ": " << m.param_spec(i).name;
    }
    return worst;
  };
  double loss = 0;
  try {
    loss = m.train_step(ids.data(), labels.data(), pos.data());
  } catch (const std::exception& e) {
    FAIL() << e.what() << "\n(OpenCL comes from PoCL, Debian's pocl-opencl-icd: bash scripts/setup.sh installs it)";
  }
  const auto& t = m.last_step_times();
  std::printf("  opencl step 1: loss %.9f vs torch %.9f, worst gradient %.2e; %lld copies home\n", loss, want,
              check("step 1"), static_cast<long long>(t.device_to_host_copies));
  EXPECT_LE(std::abs(loss - want) / want, kTolerance);
  // The same parameters again: the device keeps what step 1 left, the
  // parameters and tokens go up anew, and the results are the same bits.
  std::vector<std::vector<float>> first;
  for (int i = 0; i < m.num_params(); ++i) first.emplace_back(m.grad(i), m.grad(i) + m.param_spec(i).numel);
  const double again = m.train_step(ids.data(), labels.data(), pos.data());
  EXPECT_EQ(again, loss);
  EXPECT_EQ(t.device_buffers_freed, 0);
  EXPECT_LE(t.device_to_host_copies, m.num_params() + 1 + testing::collectives(m.spec().train));  // the loss, the gradients
  for (int i = 0; i < m.num_params(); ++i)
    EXPECT_TRUE(std::equal(first[static_cast<size_t>(i)].begin(), first[static_cast<size_t>(i)].end(), m.grad(i)))
        << "step 2 " << m.param_spec(i).name;
  // An evaluation between steps frees the train program's device buffers;
  // the next train step makes them again and gives the same results.
  const double eval = m.forward_loss(ids.data(), labels.data(), pos.data());
  EXPECT_LE(std::abs(eval - want) / want, kTolerance);
  EXPECT_GT(t.device_buffers_freed, 0);
  EXPECT_EQ(m.train_step(ids.data(), labels.data(), pos.data()), loss);
  check("after an evaluation");
  // Parameters the host changes between steps reach the device.
  for (int i = 0; i < m.num_params(); ++i)
    for (int64_t k = 0; k < m.param_spec(i).numel; ++k) m.param(i)[k] *= 0.5f;
  const double halved = m.train_step(ids.data(), labels.data(), pos.data());
  EXPECT_NE(halved, loss);
  runtime::Model fresh(halyard_models::llama_micro_opencl());
  for (int i = 0; i < m.num_params(); ++i) std::copy(m.param(i), m.param(i) + m.param_spec(i).numel, fresh.param(i));
  EXPECT_EQ(fresh.train_step(ids.data(), labels.data(), pos.data()), halved);
}

TEST(GpuPath, TwoSequenceRanksCheckpointedAndTiledOnTheDeviceMatchOneCpuRank) {
  const runtime::ModelSpec &ref_spec = halyard_models::tiny_sp1_s126(), &dev = halyard_models::tiny_opencl_sp2_s126_tiled();
  ASSERT_EQ(ref_spec.seq, dev.seq);
  const sp_check::StepResult ref = sp_check::run_step(ref_spec, nullptr);
  std::vector<std::string> errors;
  const auto got = sp_check::run_in_process(dev, 2, &errors);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    const sp_check::Comparison c = sp_check::compare(dev, got[static_cast<size_t>(r)], ref);
    std::printf("  %s rank %d: loss rel %.2e, forward %.2e, worst gradient %.2e (%s)\n", dev.name, r, c.loss,
                c.forward_loss, c.worst_grad, c.worst_param.c_str());
    EXPECT_LE(c.loss, kTolerance) << "rank " << r;
    EXPECT_LE(c.forward_loss, kTolerance) << "rank " << r;
    EXPECT_LE(c.worst_grad, kTolerance) << "rank " << r << " " << c.worst_param;
  }
}

}  // namespace
}  // namespace halyard
