// The executor's device path and the GPU loop schedule, run for real without
// a GPU: libraries built for Halide's OpenCL target (the same
// generators/schedule_gpu.cpp as CUDA, every Func a GPU kernel), run by
// PoCL, OpenCL on the CPU (Debian's pocl-opencl-icd, which scripts/setup.sh
// installs). What a CUDA step does with device buffers is what these do:
// Halide's device interface is the same, only the backend differs (cuBLAS,
// a CUDA-only extern, is not in them: their contractions are Halide's).
//   - the micro Llama's step equals the PyTorch fixture, within 1e-4;
//   - step after step, and after an evaluation in between, the results stay
//     the same: the device holds one block each for the parameters, the
//     gradients, the tokens and the plan's arena, every buffer an alias into
//     them (none allocated or freed per buffer), and only the loss and the
//     gradients come home;
//   - with every value the backward reads offloaded (keep "offload"), the
//     step still equals the fixture: each value goes to host memory after
//     the forward and comes back before the backward, other buffers using
//     its device bytes in between, so the device holds a smaller arena;
//   - AdamW on the device (the library's optimizer kernels) equals
//     runtime::AdamW on the host, while parameters and gradients stay on
//     the device: a step uploads only the tokens and brings home the loss;
//   - two sequence-parallel ranks (threads) of the tiny Llama, checkpointed
//     and tiled (views aliasing their buffers' device memory, tiles
//     concatenated, all-to-alls of device-resident values), equal the
//     single-rank CPU library.
#include <gtest/gtest.h>

#include <HalideRuntime.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "runtime/adamw.h"
#include "runtime/device_memory.h"
#include "runtime/error.h"
#include "runtime/offload_windows.h"

#include "llama_micro_opencl.h"
#include "llama_micro_bf16_mixed.h"
#include "llama_micro_bf16_saved.h"
#include "llama_micro_opencl_bf16_mixed.h"
#include "llama_micro_opencl_offload.h"
#include "llama_micro_opencl_offload_bf16.h"
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
  // The device holds the executor's blocks, each once: the parameters, the
  // gradients, the token slots and the plan's arena, whose buffers share
  // their bytes as on the host (far less than the buffers added up).
  EXPECT_EQ(m.device_bytes(), testing::device_blocks_bytes(m));
  EXPECT_LT(m.arena_bytes(), testing::arena_buffers_bytes(m.spec().train) / 2);
  EXPECT_EQ(m.pinned_host_bytes(), 0);  // page-locking is CUDA's (cuda_context.h), not OpenCL's
  // An evaluation between steps aliases the same blocks: nothing is freed,
  // nothing more allocated, and the next train step gives the same results.
  const double eval = m.forward_loss(ids.data(), labels.data(), pos.data());
  EXPECT_LE(std::abs(eval - want) / want, kTolerance);
  EXPECT_EQ(t.device_buffers_freed, 0);
  EXPECT_EQ(m.device_bytes(), testing::device_blocks_bytes(m));
  EXPECT_EQ(m.train_step(ids.data(), labels.data(), pos.data()), loss);
  check("after an evaluation");
  // Parameters the host changes between steps reach the device.
  for (int i = 0; i < m.num_params(); ++i)
    for (int64_t k = 0; k < m.param_spec(i).numel; ++k) m.param(i)[k] *= 0.5f;
  const double halved = m.train_step(ids.data(), labels.data(), pos.data());
  EXPECT_NE(halved, loss);
  // Kernel times measured on the device (waiting for it around each kernel):
  // the same step, its attention kernels' time counted.
  m.set_kernel_times_on_device(true);
  EXPECT_EQ(m.train_step(ids.data(), labels.data(), pos.data()), halved);
  EXPECT_GT(t.attention_s, 0);
  EXPECT_LT(t.attention_s + t.other_kernels_s, t.total_s);
  m.set_kernel_times_on_device(false);
  runtime::Model fresh(halyard_models::llama_micro_opencl());
  for (int i = 0; i < m.num_params(); ++i) std::copy(m.param(i), m.param(i) + m.param_spec(i).numel, fresh.param(i));
  EXPECT_EQ(fresh.train_step(ids.data(), labels.data(), pos.data()), halved);
  // Without use_adamw the host holds the truth: pointers kept across steps
  // (as training loops keep them) write what the next step reads, and read
  // the gradients it made.
  float* w0 = m.param(0);
  const float* g0 = m.grad(0);
  EXPECT_EQ(m.train_step(ids.data(), labels.data(), pos.data()), halved);
  const std::vector<float> g_before(g0, g0 + m.param_spec(0).numel);
  for (int64_t k = 0; k < m.param_spec(0).numel; ++k) w0[k] *= 2.f;
  EXPECT_NE(m.train_step(ids.data(), labels.data(), pos.data()), halved);
  EXPECT_FALSE(std::equal(g_before.begin(), g_before.end(), g0));
}

TEST(GpuPath, OffloadedValuesComeBackForTheBackwardAndTheArenaShrinks) {
  auto st = runtime::Safetensors::read(fixture("llama_micro.safetensors"));
  const runtime::ModelSpec& spec = halyard_models::llama_micro_opencl_offload();
  ASSERT_GT(spec.train.offload_bytes, 0);
  int out = 0, back = 0;
  for (int c = 0; c < spec.train.num_calls; ++c) {
    out += spec.train.calls[c].kind == runtime::CallKind::Offload;
    back += spec.train.calls[c].kind == runtime::CallKind::Reload;
  }
  EXPECT_GT(out, 4);
  EXPECT_EQ(out, back);
  runtime::Model m(spec), kept(halyard_models::llama_micro_opencl());
  testing::load_params(m, st);
  testing::load_params(kept, st);
  auto ids = st.to_i32("input_ids"), labels = st.to_i32("labels"), pos = st.to_i32("position_ids");
  const double want = st.to_f64("loss")[0];
  double loss = 0;
  try {
    loss = m.train_step(ids.data(), labels.data(), pos.data());
  } catch (const std::exception& e) {
    FAIL() << e.what();
  }
  kept.train_step(ids.data(), labels.data(), pos.data());
  double worst = 0;
  for (int i = 0; i < m.num_params(); ++i) {
    const double e = testing::rel_diff(m.grad(i), st.to_f64(std::string("grad/") + m.param_spec(i).name));
    worst = std::max(worst, e);
    EXPECT_LE(e, kTolerance) << m.param_spec(i).name;
    // The same kernels in the same order: the bits of the kept library's.
    EXPECT_TRUE(std::equal(m.grad(i), m.grad(i) + m.param_spec(i).numel, kept.grad(i))) << m.param_spec(i).name;
  }
  const auto& t = m.last_step_times();
  std::printf("  offloaded step: loss %.9f vs torch %.9f, worst gradient %.2e; %d values, %lld bytes out and back "
              "(%.3f ms); device %lld bytes vs %lld kept (arena %lld vs %lld), host copies %lld bytes\n",
              loss, want, worst, out, static_cast<long long>(t.offloaded_bytes), t.offload_s * 1e3,
              static_cast<long long>(m.device_bytes()), static_cast<long long>(kept.device_bytes()),
              static_cast<long long>(m.arena_bytes()), static_cast<long long>(kept.arena_bytes()),
              static_cast<long long>(spec.train.offload_bytes));
  EXPECT_LE(std::abs(loss - want) / want, kTolerance);
  EXPECT_GT(t.offloaded_bytes, 0);
  EXPECT_LT(m.arena_bytes(), kept.arena_bytes());
  EXPECT_LT(m.device_bytes(), kept.device_bytes());
  EXPECT_EQ(m.device_bytes(), testing::device_blocks_bytes(m));
  // Again, and after an evaluation (which offloads nothing: no backward).
  EXPECT_EQ(m.train_step(ids.data(), labels.data(), pos.data()), loss);
  EXPECT_LE(std::abs(m.forward_loss(ids.data(), labels.data(), pos.data()) - want) / want, kTolerance);
  EXPECT_EQ(m.last_step_times().offloaded_bytes, 0);
  EXPECT_EQ(m.train_step(ids.data(), labels.data(), pos.data()), loss);
}

// Offloaded copies stored in bf16 (schedules/precision.h) on the device
// path: loss and gradients the CPU library's that stores the same values in
// bf16 (kernels in another order round a few saved values apart: 1e-3), and
// half the bytes out and back.
TEST(GpuPath, OffloadedBf16CopiesMoveHalfTheBytes) {
  auto st = runtime::Safetensors::read(fixture("llama_micro.safetensors"));
  runtime::Model m(halyard_models::llama_micro_opencl_offload_bf16()), f32(halyard_models::llama_micro_opencl_offload()),
      cpu(halyard_models::llama_micro_bf16_saved());
  for (runtime::Model* x : {&m, &f32, &cpu}) testing::load_params(*x, st);
  auto ids = st.to_i32("input_ids"), labels = st.to_i32("labels"), pos = st.to_i32("position_ids");
  const double want = st.to_f64("loss")[0];
  const double loss = m.train_step(ids.data(), labels.data(), pos.data());
  const int64_t bf16_bytes = m.last_step_times().offloaded_bytes;
  f32.train_step(ids.data(), labels.data(), pos.data());
  const int64_t f32_bytes = f32.last_step_times().offloaded_bytes;
  const double cpu_loss = cpu.train_step(ids.data(), labels.data(), pos.data());
  EXPECT_LE(std::abs(loss - cpu_loss) / want, 1e-5);
  double worst = 0;
  for (int i = 0; i < m.num_params(); ++i) {
    const std::vector<float> ref(cpu.grad(i), cpu.grad(i) + cpu.param_spec(i).numel);
    const double e = testing::rel_diff(m.grad(i), std::vector<double>(ref.begin(), ref.end()));
    worst = std::max(worst, e);
    EXPECT_LE(e, 1e-3) << m.param_spec(i).name;
  }
  std::printf("  bf16 copies offloaded: loss %.9f vs torch %.9f; worst gradient rel diff vs the CPU library %.2e; "
              "%lld bytes out and back (f32 copies: %lld); device arena %lld bytes (f32: %lld)\n",
              loss, want, worst, static_cast<long long>(bf16_bytes), static_cast<long long>(f32_bytes),
              static_cast<long long>(m.arena_bytes()), static_cast<long long>(f32.arena_bytes()));
  EXPECT_GT(bf16_bytes, 0);
  EXPECT_LT(static_cast<double>(bf16_bytes), 0.56 * static_cast<double>(f32_bytes));
}

// Mixed precision on the device (examples/llama/schedules/bf16_mixed.json):
// the weights' and activations' bf16 copies are made by the device's
// kernels and read by its contractions; the step is the CPU library's of
// the same schedule, but where a value's f32 bits straddle a bf16 rounding
// boundary (see test_lowering.cpp: up to 3.3e-3 of the largest gradient).
TEST(GpuPath, MixedPrecisionStepOnTheDeviceMatchesItsCpuLibrary) {
  auto st = runtime::Safetensors::read(fixture("llama_micro.safetensors"));
  runtime::Model m(halyard_models::llama_micro_opencl_bf16_mixed()), cpu(halyard_models::llama_micro_bf16_mixed());
  for (runtime::Model* x : {&m, &cpu}) testing::load_params(*x, st);
  auto ids = st.to_i32("input_ids"), labels = st.to_i32("labels"), pos = st.to_i32("position_ids");
  const double want = st.to_f64("loss")[0];
  const double loss = m.train_step(ids.data(), labels.data(), pos.data());
  const double cpu_loss = cpu.train_step(ids.data(), labels.data(), pos.data());
  EXPECT_LE(std::abs(loss - cpu_loss) / want, 1e-5);
  double worst = 0, worst_torch = 0;
  for (int i = 0; i < m.num_params(); ++i) {
    const std::vector<float> ref(cpu.grad(i), cpu.grad(i) + cpu.param_spec(i).numel);
    const double e = testing::rel_diff(m.grad(i), std::vector<double>(ref.begin(), ref.end()));
    worst = std::max(worst, e);
    worst_torch = std::max(worst_torch, testing::rel_diff(m.grad(i), st.to_f64(std::string("grad/") + m.param_spec(i).name)));
    EXPECT_LE(e, 1e-2) << m.param_spec(i).name;
  }
  std::printf("  bf16 mixed on the device: loss %.9f vs the CPU library's %.9f (torch f32 %.9f); worst gradient rel "
              "diff vs the CPU library %.2e, vs torch's f32 %.2e; device arena %lld bytes\n",
              loss, cpu_loss, want, worst, worst_torch, static_cast<long long>(m.arena_bytes()));
  EXPECT_GT(worst_torch, 1e-4);  // the contractions did round
  EXPECT_EQ(m.arena_bytes(), cpu.arena_bytes());
}

// A device block's copies go in pieces (to a row's end, whole rows, at most
// 2^16 rows at once, a tail): a range starting mid-row and longer than one
// piece of rows lands byte for byte, the bytes around it untouched, and a
// range past the block's end is refused.
TEST(GpuPath, DeviceBlockCopiesEveryByteInPieces) {
  const halide_device_interface_t* device = runtime::device_interface_of(halyard_models::llama_micro_opencl().target);
  ASSERT_NE(device, nullptr);
  const int64_t bytes = (int64_t{1} << 16) * 4096 + 3 * 4096 + 100, at = 4000, n = bytes - at - 50;
  runtime::DeviceBlock block(device, bytes);
  block.fill_zero("the test's block");
  std::vector<uint8_t> host(static_cast<size_t>(bytes));
  for (size_t k = 0; k < host.size(); ++k) host[k] = static_cast<uint8_t>(k * 131 + 7);
  block.copy_from_host(host.data() + at, at, n, "the test's block");
  std::vector<uint8_t> back(static_cast<size_t>(bytes), 0xAA);
  block.copy_to_host(back.data(), 0, bytes, "the test's block");
  int64_t wrong = 0;
  for (int64_t k = 0; k < bytes; ++k)
    wrong += back[static_cast<size_t>(k)] != (k >= at && k < at + n ? host[static_cast<size_t>(k)] : 0);
  EXPECT_EQ(wrong, 0);
  EXPECT_THROW(block.copy_to_host(back.data(), bytes - 10, 20, "the test's block"), runtime::Error);
}

// The windows of a hand-made program: A and B share arena bytes, C does not.
//   0: k0 writes A   1: Offload A   2: k1 writes C   3: k2 writes B
//   4: k3 reads C    5: Reload A    6: k4 reads A
TEST(GpuPath, CopyWindowsEndWhereTheBytesAreTouched) {
  using runtime::BufferSpec;
  using runtime::CallKind;
  using runtime::ElemType;
  using runtime::Storage;
  const BufferSpec buffers[] = {{"A", ElemType::F32, 1, {256}, Storage::Arena, 0, 0, 0, 0},
                                {"B", ElemType::F32, 1, {128}, Storage::Arena, 0, 512, 0},
                                {"C", ElemType::F32, 1, {64}, Storage::Arena, 0, 2048, 0}};
  const int a[] = {0}, b[] = {1}, c[] = {2}, ca[] = {2, 0};
  const runtime::CallSpec calls[] = {{nullptr, "k0", "", 1, a, CallKind::Kernel, nullptr, 0},
                                     {nullptr, "offload", "A", 1, a, CallKind::Offload, nullptr, 0},
                                     {nullptr, "k1", "", 1, c, CallKind::Kernel, nullptr, 0},
                                     {nullptr, "k2", "", 1, b, CallKind::Kernel, nullptr, 0},
                                     {nullptr, "k3", "", 1, c, CallKind::Kernel, nullptr, 0},
                                     {nullptr, "reload", "A", 1, a, CallKind::Reload, nullptr, 0},
                                     {nullptr, "k4", "", 2, ca, CallKind::Kernel, nullptr, 0}};
  const runtime::ProgramSpec p{buffers, 3, calls, 7, 4096, 0};
  const std::vector<runtime::CopyWindow> w = runtime::copy_windows(p);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].call, 1);
  EXPECT_EQ(w[0].start, 1);
  EXPECT_EQ(w[0].finish, 3);  // k2 writes B over A's bytes
  EXPECT_EQ(w[1].call, 5);
  EXPECT_EQ(w[1].start, 4);  // after k2, the last to touch A's bytes
  EXPECT_EQ(w[1].finish, 6);  // k4 reads A
}

// The micro Llama with every value the backward reads offloaded, its copies
// run at the far edges of their windows (offloads as late as they may,
// reloads as early): the same bits as the copies at their calls. This is
// what a communication stream may do with them, checked without one.
TEST(GpuPath, OffloadCopiesAtTheEdgesOfTheirWindowsGiveTheSameBits) {
  auto st = runtime::Safetensors::read(fixture("llama_micro.safetensors"));
  const runtime::ModelSpec& spec = halyard_models::llama_micro_opencl_offload();
  const std::vector<runtime::CopyWindow> windows = runtime::copy_windows(spec.train);
  int offloads = 0, late = 0, early = 0, calls_hidden = 0;
  for (const runtime::CopyWindow& w : windows) {
    if (spec.train.calls[w.call].kind == runtime::CallKind::Offload) {
      ++offloads;
      late += w.finish > w.call + 1;
    } else {
      early += w.start < w.call;
    }
    calls_hidden += w.finish - w.start - 1;
  }
  std::printf("  %zu copies: %d offloads may finish later than the next call, %d reloads start earlier than "
              "their calls; %d calls inside windows in all\n", windows.size(), late, early, calls_hidden);
  EXPECT_EQ(static_cast<int>(windows.size()), 2 * offloads);
  EXPECT_GT(late, 0);  // (the cases are exercised)
  EXPECT_GT(early, 0);
  runtime::Model at_calls(spec), at_edges(spec);
  testing::load_params(at_calls, st);
  testing::load_params(at_edges, st);
  at_edges.set_copies_at_window_edges(true);
  auto ids = st.to_i32("input_ids"), labels = st.to_i32("labels"), pos = st.to_i32("position_ids");
  for (int step = 0; step < 2; ++step) {
    const double want = at_calls.train_step(ids.data(), labels.data(), pos.data());
    EXPECT_EQ(at_edges.train_step(ids.data(), labels.data(), pos.data()), want) << "step " << step;
    EXPECT_EQ(at_edges.last_step_times().offloaded_bytes, at_calls.last_step_times().offloaded_bytes);
    for (int i = 0; i < at_calls.num_params(); ++i)
      EXPECT_TRUE(std::equal(at_calls.grad(i), at_calls.grad(i) + at_calls.param_spec(i).numel, at_edges.grad(i)))
          << "step " << step << " " << at_calls.param_spec(i).name;
  }
}

// runtime::AdamW over a model's host copies, as a training loop calls it; returns the norm.
double host_adamw_step(runtime::Model& m, runtime::AdamW& opt, int64_t t, double lr, double max_norm) {
  std::vector<float*> w;
  std::vector<const float*> g;
  std::vector<int64_t> sizes;
  for (int i = 0; i < m.num_params(); ++i) {
    w.push_back(m.param(i));
    g.push_back(m.grad(i));
    sizes.push_back(m.param_spec(i).numel);
  }
  const double norm = runtime::global_grad_norm(g.data(), sizes);
  opt.step(t, lr, w.data(), g.data(), runtime::clip_scale(norm, max_norm));
  return norm;
}

std::vector<int64_t> param_sizes(const runtime::Model& m) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < m.num_params(); ++i) sizes.push_back(m.param_spec(i).numel);
  return sizes;
}

// The largest difference between two models' parameters, relative to the largest magnitude.
double param_diff(const runtime::Model& a, const runtime::Model& b) {
  double worst = 0;
  for (int i = 0; i < a.num_params(); ++i) {
    const std::vector<double> want(b.param(i), b.param(i) + b.param_spec(i).numel);
    worst = std::max(worst, testing::rel_diff(a.param(i), want));
  }
  return worst;
}

// A GPU library's AdamW runs where its parameters live: its optimizer
// kernels update them on the device, the moments stay there, and so steps
// upload only the tokens and bring home only the loss (the update, the
// gradient norm's partial sums). Three steps equal the same library updated
// by runtime::AdamW on the host, clipping included.
TEST(GpuPath, AdamWOnTheDeviceKeepsParametersAndGradientsThere) {
  auto st = runtime::Safetensors::read(fixture("llama_micro.safetensors"));
  const runtime::ModelSpec& spec = halyard_models::llama_micro_opencl();
  ASSERT_NE(spec.adamw, nullptr);
  ASSERT_NE(spec.grad_sumsq, nullptr);
  runtime::Model dev(spec), host(spec);
  testing::load_params(dev, st);
  testing::load_params(host, st);
  auto ids = st.to_i32("input_ids"), labels = st.to_i32("labels"), pos = st.to_i32("position_ids");
  try {
    dev.adamw_step(1, 1e-3, 1.0);
    ADD_FAILURE() << "an update before use_adamw ran";
  } catch (const runtime::Error& e) {
    EXPECT_NE(std::string(e.what()).find("use_adamw"), std::string::npos) << e.what();
  }
  dev.use_adamw(dev.decay_flags());
  ASSERT_TRUE(dev.adamw_on_device());
  runtime::AdamW opt(param_sizes(host), host.decay_flags());
  int token_arrays = 0;
  for (int b = 0; b < spec.train.num_buffers; ++b) token_arrays += spec.train.buffers[b].storage == runtime::Storage::Input;
  const double lr = 3e-2, max_norm = 1.0;
  bool clipped = false;
  for (int64_t t = 1; t <= 3; ++t) {
    const double loss = dev.train_step(ids.data(), labels.data(), pos.data());
    const runtime::Model::StepTimes times = dev.last_step_times();
    const double want = host.train_step(ids.data(), labels.data(), pos.data());
    EXPECT_LE(std::abs(loss - want) / want, 1e-5) << "step " << t;
    if (t > 1) {  // the parameters are where the last update left them
      EXPECT_EQ(times.host_to_device_copies, token_arrays) << "step " << t;
      EXPECT_LE(times.device_to_host_copies, 1 + testing::collectives(spec.train)) << "step " << t;  // no gradient
    }
    const double norm = dev.adamw_step(t, lr, max_norm);
    EXPECT_EQ(dev.last_update_times().device_to_host_copies, 1);
    EXPECT_EQ(dev.last_update_times().host_to_device_copies, 0);
    const double host_norm = host_adamw_step(host, opt, t, lr, max_norm);
    clipped = clipped || host_norm > max_norm;
    std::printf("  step %lld: loss %.9f vs %.9f on the host; gradient norm %.9f vs %.9f\n", static_cast<long long>(t),
                loss, want, norm, host_norm);
    EXPECT_LE(std::abs(norm - host_norm), 1e-6 * host_norm) << "step " << t;
  }
  EXPECT_TRUE(clipped);  // (the case is exercised)
  // The device held the moments, and a block for the norm's partial sums.
  EXPECT_GT(dev.device_bytes(), testing::device_blocks_bytes(dev) + 2 * 4 * dev.flat_size());
  // The host's copies are fetched when asked for: parameters and moments.
  const double worst = param_diff(dev, host);
  std::printf("  after 3 updates: parameters within %.2e of the host's update\n", worst);
  EXPECT_LE(worst, 1e-5);
  for (int i = 0; i < dev.num_params(); ++i) {
    std::vector<float> m, v;
    dev.adamw_moments(i, m, v);
    const std::vector<double> want_m(opt.m(static_cast<size_t>(i)).begin(), opt.m(static_cast<size_t>(i)).end());
    const std::vector<double> want_v(opt.v(static_cast<size_t>(i)).begin(), opt.v(static_cast<size_t>(i)).end());
    EXPECT_LE(testing::rel_diff(m.data(), want_m), 1e-5) << dev.param_spec(i).name;
    EXPECT_LE(testing::rel_diff(v.data(), want_v), 1e-5) << dev.param_spec(i).name;
  }
  // What the host writes goes up before the next kernel reads it: the
  // parameters (one copy of them all) and the moments.
  for (runtime::Model* m : {&dev, &host}) m->param(0)[0] += 0.25f;
  std::vector<float> m0, v0;
  dev.adamw_moments(0, m0, v0);
  for (float& x : m0) x *= 0.5f;
  dev.set_adamw_moments(0, m0, v0);
  opt.m(0) = m0;
  opt.v(0) = v0;
  const double loss = dev.train_step(ids.data(), labels.data(), pos.data());
  EXPECT_EQ(dev.last_step_times().host_to_device_copies, token_arrays + 1);
  EXPECT_LE(std::abs(loss - host.train_step(ids.data(), labels.data(), pos.data())) / loss, 1e-5);
  dev.adamw_step(4, lr, max_norm);
  host_adamw_step(host, opt, 4, lr, max_norm);
  EXPECT_LE(param_diff(dev, host), 1e-5);
  // Gradients the host rewrote (a ZeRO step uses them as scratch) are the ones the update reads.
  dev.train_step(ids.data(), labels.data(), pos.data());
  host.train_step(ids.data(), labels.data(), pos.data());
  for (runtime::Model* m : {&dev, &host}) std::fill(m->grads_flat(), m->grads_flat() + m->flat_size(), 0.f);
  const auto before = [&] {
    std::vector<float> w(dev.param(1), dev.param(1) + dev.param_spec(1).numel);
    return w;
  }();
  EXPECT_EQ(dev.adamw_step(5, lr, max_norm), 0.0);
  EXPECT_EQ(dev.last_update_times().host_to_device_copies, 2);  // the gradients, and the parameters (read above)
  host_adamw_step(host, opt, 5, lr, max_norm);
  EXPECT_LE(param_diff(dev, host), 1e-5);
  EXPECT_FALSE(std::equal(before.begin(), before.end(), dev.param(1)));  // the moments still move them
}

// A CPU library's update is runtime::AdamW's on the host, bit for bit; and
// the update refuses what it cannot do, saying what to do instead.
TEST(GpuPath, AdamWOfACpuLibraryIsTheHostsAndMisuseIsNamed) {
  const runtime::ModelSpec& spec = halyard_models::tiny_sp1_s126();
  EXPECT_EQ(spec.adamw, nullptr);
  runtime::Model m(spec), ref(spec);
  m.init_params(7);
  ref.init_params(7);
  std::vector<int32_t> ids(static_cast<size_t>(m.tokens())), pos(ids.size());
  for (size_t k = 0; k < ids.size(); ++k) {
    ids[k] = static_cast<int32_t>((k * 7 + 3) % static_cast<size_t>(spec.vocab));
    pos[k] = static_cast<int32_t>(k % static_cast<size_t>(spec.local_seq));
  }
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const runtime::Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(message([&] { m.adamw_step(1, 1e-3, 1.0); }).find("use_adamw"), std::string::npos);
  EXPECT_NE(message([&] { m.use_adamw({true}); }).find("one flag per parameter"), std::string::npos);
  m.use_adamw(m.decay_flags());
  EXPECT_FALSE(m.adamw_on_device());
  EXPECT_NE(message([&] { m.adamw_step(1, 1e-3, 1.0); }).find("call train_step first"), std::string::npos);
  runtime::AdamW opt(param_sizes(ref), ref.decay_flags());
  for (int64_t t = 1; t <= 2; ++t) {
    m.train_step(ids.data(), ids.data(), pos.data());
    ref.train_step(ids.data(), ids.data(), pos.data());
    EXPECT_EQ(m.adamw_step(t, 1e-2, 0.5), host_adamw_step(ref, opt, t, 1e-2, 0.5));
  }
  for (int i = 0; i < m.num_params(); ++i)
    EXPECT_TRUE(std::equal(m.param(i), m.param(i) + m.param_spec(i).numel, ref.param(i))) << m.param_spec(i).name;
  EXPECT_NE(message([&] { m.adamw_step(0, 1e-3, 1.0); }).find("steps count from 1"), std::string::npos);
  std::vector<float> mm, vv;
  m.adamw_moments(0, mm, vv);
  EXPECT_EQ(mm, opt.m(0));
  EXPECT_NE(message([&] { m.set_adamw_moments(0, {1.f}, {1.f}); }).find("elements"), std::string::npos);
}

// A NaN gradient makes the norm NaN, and the update applies nothing, on the
// device and on the host alike: the parameters and moments stay as they
// were (a trainer then stops without reading the device's gradients every
// step), and the next finite step updates again.
TEST(GpuPath, AnUpdateWithANonFiniteGradientAppliesNothing) {
  auto st = runtime::Safetensors::read(fixture("llama_micro.safetensors"));
  auto ids = st.to_i32("input_ids"), labels = st.to_i32("labels"), pos = st.to_i32("position_ids");
  for (const runtime::ModelSpec* spec :
       {&halyard_models::llama_micro_opencl(), &halyard_models::llama_micro_bf16_saved()}) {
    SCOPED_TRACE(spec->name);
    runtime::Model m(*spec);
    testing::load_params(m, st);
    m.use_adamw(m.decay_flags());
    EXPECT_EQ(m.adamw_on_device(), spec->adamw != nullptr);
    m.train_step(ids.data(), labels.data(), pos.data());
    ASSERT_TRUE(std::isfinite(m.adamw_step(1, 1e-2, 1.0)));
    auto state = [&] {
      std::vector<std::vector<float>> all;
      for (int i = 0; i < m.num_params(); ++i) {
        std::vector<float> mm, vv;
        m.adamw_moments(i, mm, vv);
        all.emplace_back(m.param(i), m.param(i) + m.param_spec(i).numel);
        all.push_back(mm);
        all.push_back(vv);
      }
      return all;
    };
    m.train_step(ids.data(), labels.data(), pos.data());
    const auto before = state();
    m.grads_flat()[m.flat_size() / 2] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_TRUE(std::isnan(m.adamw_step(2, 1e-2, 1.0)));
    EXPECT_TRUE(state() == before);  // bitwise (no NaN among them)
    m.train_step(ids.data(), labels.data(), pos.data());
    EXPECT_TRUE(std::isfinite(m.adamw_step(2, 1e-2, 1.0)));
    EXPECT_FALSE(state() == before);
  }
}

// Two sequence ranks, each updating on its device: the gradients are summed
// over the ranks on the host and go up once, both ranks take the same
// update, and after two steps the loss is one CPU rank's with
// runtime::AdamW. (Parameters are compared by the loss they give: Adam
// divides a gradient near zero by its own small magnitude, so the two
// schedules' last bits move such a parameter apart, by up to a fraction of
// the learning rate: 3 elements by 2e-4 to 8e-4 here, with lr 1e-2.)
TEST(GpuPath, TwoRanksUpdatingOnTheirDevicesMatchOneCpuRank) {
  const runtime::ModelSpec &ref_spec = halyard_models::tiny_sp1_s126(), &dev = halyard_models::tiny_opencl_sp2_s126_tiled();
  constexpr int kSteps = 2;
  constexpr double kLr = 1e-2, kClip = 1.0;
  auto run = [&](const runtime::ModelSpec& spec, runtime::Communicator* comm, std::vector<std::vector<float>>* params,
                 std::vector<double>* norms, int64_t* grad_uploads, double* loss_after) {
    runtime::Model m(spec, comm);
    m.init_params(5);
    m.use_adamw(m.decay_flags());
    const int rank = comm ? comm->rank() : 0, ranks = comm ? comm->size() : 1;
    const runtime::Batcher batcher(runtime::TokenFile::from_text(sp_check::kCorpus), spec.batch, spec.seq, spec.vocab,
                                   5, runtime::Shard{rank, ranks, 0, 1, runtime::zigzag_layout(spec)});
    for (int64_t t = 1; t <= kSteps; ++t) {
      const auto b = batcher.get(t);
      m.train_step(b.input_ids.data(), b.labels.data(), b.position_ids.data());
      norms->push_back(m.adamw_step(t, kLr, kClip));
      *grad_uploads += m.last_update_times().host_to_device_copies;
    }
    for (int i = 0; i < m.num_params(); ++i) params->emplace_back(m.param(i), m.param(i) + m.param_spec(i).numel);
    const auto b = batcher.get(kSteps + 1);
    *loss_after = m.forward_loss(b.input_ids.data(), b.labels.data(), b.position_ids.data());
  };
  std::vector<std::vector<float>> want;
  std::vector<double> want_norms;
  int64_t unused = 0;
  double want_loss = 0;
  run(ref_spec, nullptr, &want, &want_norms, &unused, &want_loss);
  auto comms = runtime::make_in_process_group(2, 120);
  std::vector<std::vector<std::vector<float>>> got(2);
  std::vector<std::vector<double>> norms(2);
  std::vector<int64_t> uploads(2, 0);
  std::vector<double> losses(2, 0);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        run(dev, comms[static_cast<size_t>(r)].get(), &got[static_cast<size_t>(r)], &norms[static_cast<size_t>(r)],
            &uploads[static_cast<size_t>(r)], &losses[static_cast<size_t>(r)]);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    EXPECT_EQ(uploads[static_cast<size_t>(r)], kSteps) << "rank " << r;  // the summed gradients, once per update
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const std::vector<double> w(want[i].begin(), want[i].end());
      worst = std::max(worst, testing::rel_diff(got[static_cast<size_t>(r)][i].data(), w));
      EXPECT_EQ(got[static_cast<size_t>(r)][i], got[0][i]) << "rank " << r << " parameter " << i;  // the same update
    }
    std::printf("  rank %d: gradient norms %.9f, %.9f vs %.9f, %.9f on one CPU rank; then loss %.9f vs %.9f "
                "(parameters within %.2e of the largest)\n", r, norms[static_cast<size_t>(r)][0],
                norms[static_cast<size_t>(r)][1], want_norms[0], want_norms[1], losses[static_cast<size_t>(r)],
                want_loss, worst);
    for (int t = 0; t < kSteps; ++t)
      EXPECT_LE(std::abs(norms[static_cast<size_t>(r)][static_cast<size_t>(t)] - want_norms[static_cast<size_t>(t)]),
                1e-4 * want_norms[static_cast<size_t>(t)]);
    EXPECT_LE(std::abs(losses[static_cast<size_t>(r)] - want_loss) / want_loss, 1e-5) << "rank " << r;
    EXPECT_LE(worst, 2 * kSteps * kLr) << "rank " << r;
  }
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
    // Every buffer aliases the executor's blocks, the tiles' views of their
    // sequence included, but for the views OpenCL cannot alias (rows of
    // positions and labels starting off its alignment): after the
    // evaluation only those are freed, and besides the collectives' inputs,
    // the loss and the gradients, only their buffers come home.
    const sp_check::StepResult& g = got[static_cast<size_t>(r)];
    const int copied_views = testing::unaligned_views(dev.forward);
    EXPECT_GT(copied_views, 0);  // (the case is exercised)
    EXPECT_LT(copied_views, testing::views(dev.forward) / 2);
    EXPECT_EQ(g.train_times.device_buffers_freed, copied_views) << "rank " << r;
    EXPECT_LE(g.train_times.device_to_host_copies,
              dev.num_params + 1 + testing::collectives(dev.train) + testing::unaligned_views(dev.train))
        << "rank " << r;
    EXPECT_GT(g.device_bytes, g.arena_bytes + 2 * 4 * g.flat_size) << "rank " << r;
  }
}

}  // namespace
}  // namespace halyard
