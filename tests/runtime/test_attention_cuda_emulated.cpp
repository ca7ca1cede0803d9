// The CUDA attention kernels (runtime/attention_cuda.cu) and their launcher's
// mapping of Halide buffers onto launches (attention_cuda.h), run on the CPU
// through an emulator (cuda_emulation.h) against the CPU library kernels:
// what can be checked of them without a GPU (test_cuda runs them on one).
// Shapes are small: every thread of a block is a std::thread.
#include "tests/runtime/cuda_emulation.h"
// (after the emulator, which it needs)
#include "runtime/attention_cuda.cu"

#include <HalideBuffer.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "runtime/attention_cuda.h"
#include "tests/attention_against_cpu.h"

namespace {

using halyard::runtime::attention_cuda::Launch;
using Halide::Runtime::Buffer;

#define HALYARD_KERNELS_OF(D)                                                                               \
  {"halyard_attention_fwd_" #D, halyard_attention_fwd_##D}, {"halyard_attention_dq_" #D, halyard_attention_dq_##D}, \
      {"halyard_attention_dkdv_" #D, halyard_attention_dkdv_##D}

void run(const std::vector<Launch>& launches) {
  static const std::map<std::string, void (*)(Args)> kernels = {HALYARD_KERNELS_OF(8), HALYARD_KERNELS_OF(16),
                                                                HALYARD_KERNELS_OF(32), HALYARD_KERNELS_OF(64),
                                                                HALYARD_KERNELS_OF(128)};
  for (const Launch& l : launches) {
    const auto it = kernels.find(l.kernel);
    ASSERT_NE(it, kernels.end()) << l.kernel;
    cuda_emulation::launch(it->second, l.grid[0], l.grid[1], l.grid[2], l.threads, l.args);
  }
}

// Buffers whose device field is their host memory's address, which is what
// the launcher maps; cleared before they are freed.
struct AsDevice {
  std::vector<halide_buffer_t*> bufs;
  AsDevice(std::initializer_list<halide_buffer_t*> xs) : bufs(xs) {
    for (halide_buffer_t* x : bufs) x->device = reinterpret_cast<uint64_t>(x->host);
  }
  ~AsDevice() {
    for (halide_buffer_t* x : bufs) x->device = 0;
  }
};

// The kernels through the launcher's launches against the CPU library
// (tests/attention_against_cpu.h): head_dims the kernels are built for and
// ones they run padded, grouped queries, packed documents, rows not a
// multiple of a block, outputs holding only some heads.
TEST(AttentionCudaEmulated, KernelsMatchTheCpuLibrary) {
  for (int D : {8, 24, 48, 128}) {
    // (Wide head_dims have several threads a row, whose every shuffle the
    // emulator runs as two barriers of the block: fewer heads for those.)
    const int H = D > 32 ? 2 : 4, KV = D > 32 ? 1 : 2;
    halyard::testing::check_attention_against_cpu(
        D, H, KV, 70, 30, 1e-5,
        [&](Buffer<float>& q, Buffer<float>& k, Buffer<float>& v, Buffer<int32_t>& pos, Buffer<float>& lse,
            Buffer<float>& o) {
          AsDevice on({q, k, v, pos, lse, o});
          std::vector<Launch> launches;
          ASSERT_EQ(halyard::runtime::attention_cuda::forward_launches(q, k, v, pos, lse, H, KV, D, o, &launches), "");
          run(launches);
        },
        [&](Buffer<float>& q, Buffer<float>& k, Buffer<float>& v, Buffer<int32_t>& pos, Buffer<float>& o,
            Buffer<float>& dO, Buffer<float>& lse, Buffer<float>& dv, Buffer<float>& dq, Buffer<float>& dk) {
          AsDevice on({q, k, v, pos, o, dO, lse, dv, dq, dk});
          std::vector<Launch> launches;
          ASSERT_EQ(halyard::runtime::attention_cuda::backward_launches(q, k, v, pos, o, dO, lse, dv, dq, H, KV, dk,
                                                                        &launches),
                    "");
          run(launches);
        });
  }
}

// What the launcher refuses, before anything runs.
TEST(AttentionCudaEmulated, BadBuffersAreErrorsThatSayWhat) {
  std::vector<Launch> launches;
  Buffer<float> q(256, 4, 8, 1), k(256, 2, 8, 1), v(256, 2, 8, 1), o(256, 4, 8, 1);
  Buffer<int32_t> pos(8, 1);
  EXPECT_NE(halyard::runtime::attention_cuda::forward_launches(q, k, v, pos, nullptr, 4, 2, 256, o, &launches)
                .find("head_dim 256 is over the 128"),
            std::string::npos);
  Buffer<float> q3(32, 3, 8, 1), o3(32, 3, 8, 1), k3(32, 2, 8, 1), v3(32, 2, 8, 1);
  EXPECT_EQ(halyard::runtime::attention_cuda::forward_launches(q3, k3, v3, pos, nullptr, 3, 2, 32, o3, &launches),
            "kv_heads must divide heads");
}

}  // namespace
