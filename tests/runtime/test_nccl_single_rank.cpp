// NCCL without MPI: a group of one (make_nccl_single_rank), the form a GPU
// node with no MPI runs (scripts/gpu_check.sh). With one rank every
// collective is a copy, but each launches NCCL's kernels on device buffers
// through the same code as a multi-rank group, so NCCL's libraries, the
// device-buffer contract and the stream and event logic are exercised. The
// device tests print the bandwidth of one large all-reduce, for the record.
// Without a CUDA device, only the factory's error is checked.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "runtime/error.h"
#include "tests/device_buffer.h"

namespace halyard::runtime {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

bool has_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define HALYARD_NEED_GPU() \
  if (!has_device()) GTEST_SKIP() << "[SKIP] no CUDA device: NCCL not run"

using halyard::testing::DeviceBuffer;

std::vector<float> ramp(size_t n, float from) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = from + static_cast<float>(i % 4093);
  return v;
}

TEST(NcclSingleRank, NoDeviceThrowsAClearError) {
  if (has_device()) GTEST_SKIP() << "this machine has a CUDA device";
  try {
    auto comm = make_nccl_single_rank(10);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    std::printf("got, as users will:\n%s\n", e.what());
    EXPECT_THAT(e.what(), StartsWith("error: NCCL communicator on rank 0: no CUDA device (cudaGetDeviceCount: "));
    EXPECT_THAT(e.what(), HasSubstr("fix: run on GPU nodes or use make_mpi_communicator()"));
  }
}

TEST(NcclSingleRank, BadTimeoutThrowsBeforeCudaIsAsked) {
  try {
    auto comm = make_nccl_single_rank(0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("the timeout must be a positive, finite number of seconds"));
  }
}

TEST(NcclSingleRank, CollectivesOnDeviceBuffers) {
  HALYARD_NEED_GPU();
  auto comm = make_nccl_single_rank(60);
  Communicator& c = *comm;
  EXPECT_STREQ(c.backend(), "NCCL");
  EXPECT_EQ(c.size(), 1);

  const std::vector<float> x = ramp(100003, 1.5f);
  DeviceBuffer<float> d(x);
  c.all_reduce_sum(d.get(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(d.host(), x);
  EXPECT_DOUBLE_EQ(c.all_reduce_sum(2.5), 2.5);

  DeviceBuffer<float> out(std::vector<float>(x.size(), 0.f));
  const int64_t count = static_cast<int64_t>(x.size());
  c.all_to_all_v(d.get(), &count, out.get(), &count);
  EXPECT_EQ(out.host(), x);
  EXPECT_EQ(c.all_to_all_bytes_sent(), 0);  // nothing left the rank

  DeviceBuffer<float> gathered(std::vector<float>(x.size(), 0.f));
  c.all_gather(d.get(), count, gathered.get());
  EXPECT_EQ(gathered.host(), x);
  DeviceBuffer<float> scattered(std::vector<float>(x.size(), 0.f));
  c.reduce_scatter_sum(d.get(), scattered.get(), count);
  EXPECT_EQ(scattered.host(), x);
  c.barrier();
}

TEST(NcclSingleRank, HostBufferIsRefusedWithTheFix) {
  HALYARD_NEED_GPU();
  auto comm = make_nccl_single_rank(60);
  std::vector<float> host(16, 1.f), recv(16);
  const int64_t count = 16;
  try {
    comm->all_to_all_v(host.data(), &count, recv.data(), &count);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("is host memory, but the NCCL backend moves device memory"));
  }
}

// On one rank NCCL's in-place all-reduce moves no bytes (an H200 returned in
// 0.002 ms for 256 MiB): what this times is the call, not a bandwidth.
TEST(NcclSingleRank, LargeAllReduceKeepsTheValues) {
  HALYARD_NEED_GPU();
  auto comm = make_nccl_single_rank(60);
  const size_t n = size_t{64} << 20;  // 256 MiB of f32
  DeviceBuffer<float> d(std::vector<float>(n, 1.f));
  comm->all_reduce_sum(d.get(), static_cast<int64_t>(n));  // warm-up
  const int reps = 5;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) comm->all_reduce_sum(d.get(), static_cast<int64_t>(n));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  std::printf("  NCCL all_reduce of 256 MiB in place on one rank: %.3f ms per call (moves nothing: no bandwidth)\n",
              s * 1e3);
  EXPECT_EQ(d.host()[12345], 1.f);
}

}  // namespace
}  // namespace halyard::runtime
