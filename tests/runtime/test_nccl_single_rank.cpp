// NCCL without MPI: a group of one (make_nccl_single_rank), the form a GPU
// node with no MPI runs (scripts/gpu_check.sh). With one rank every
// collective is a copy, but each launches NCCL's kernels on device buffers
// through the same code as a multi-rank group, so NCCL's libraries, the
// device-buffer contract and the stream and event logic are exercised. The
// device tests print the bandwidth of one large all-reduce, for the record.
// Without a CUDA device, only the factory's error is checked.
#include <cuda.h>
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

#include "runtime/collectives.h"
#include "runtime/comm.h"
#include "runtime/cuda_context.h"
#include "runtime/cuda_driver.h"
#include "runtime/error.h"
#include "tests/buffer_spec.h"
#include "tests/device_buffer.h"

namespace halyard::runtime {
namespace {

// The runtime's copy of cuda.h's CUDA_MEMCPY2D (it is built without the
// CUDA headers) must be the driver's, field for field.
static_assert(sizeof(CudaMemcpy2D) == sizeof(CUDA_MEMCPY2D));
static_assert(offsetof(CudaMemcpy2D, src_memory_type) == offsetof(CUDA_MEMCPY2D, srcMemoryType));
static_assert(offsetof(CudaMemcpy2D, src_device) == offsetof(CUDA_MEMCPY2D, srcDevice));
static_assert(offsetof(CudaMemcpy2D, src_pitch) == offsetof(CUDA_MEMCPY2D, srcPitch));
static_assert(offsetof(CudaMemcpy2D, dst_memory_type) == offsetof(CUDA_MEMCPY2D, dstMemoryType));
static_assert(offsetof(CudaMemcpy2D, dst_device) == offsetof(CUDA_MEMCPY2D, dstDevice));
static_assert(offsetof(CudaMemcpy2D, dst_pitch) == offsetof(CUDA_MEMCPY2D, dstPitch));
static_assert(offsetof(CudaMemcpy2D, width_bytes) == offsetof(CUDA_MEMCPY2D, WidthInBytes));
static_assert(offsetof(CudaMemcpy2D, height) == offsetof(CUDA_MEMCPY2D, Height));
static_assert(kCuMemoryTypeDevice == CU_MEMORYTYPE_DEVICE);

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

  // A gradient bucket's sum in the background, another call before its wait.
  DeviceBuffer<float> bucket(x);
  auto sum = c.start_all_reduce_sum(bucket.get(), count);
  c.barrier();
  sum->wait();
  EXPECT_EQ(bucket.host(), x);
}

// ncclCommSplit (an sp group of a dp x sp mesh): a group on the same device,
// whose collectives work; host buffers gathered through the GPU (split()
// gathers the group's world ranks so).
TEST(NcclSingleRank, SplitMakesAGroupOnTheSameDevice) {
  HALYARD_NEED_GPU();
  auto comm = make_nccl_single_rank(60);
  auto group = comm->split(0, 0);
  EXPECT_STREQ(group->backend(), "NCCL");
  EXPECT_EQ(group->size(), 1);
  EXPECT_EQ(group->rank(), 0);
  const std::vector<float> x = ramp(1000, 2.f);
  DeviceBuffer<float> d(x), out(std::vector<float>(x.size(), 0.f));
  group->all_gather(d.get(), 1000, out.get());
  EXPECT_EQ(out.host(), x);
  int32_t mine = 7, all = 0;
  group->all_gather(&mine, 1, &all);
  EXPECT_EQ(all, 7);
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

BufferSpec spec(const char* name, ElemType type, const std::vector<int64_t>& shape) {
  return halyard::testing::buffer_spec(name, type, shape);
}

template <typename T>
std::vector<T> on_host_after_the_step(DeviceBuffer<T>& d) {
  EXPECT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(runtime_cuda_context().stream)), cudaSuccess);
  return d.host();
}

// The step's collectives as a CUDA model over NCCL runs them
// (Model::device_collective): each plan on device buffers, its rows copied
// by cuMemcpy2DAsync on the runtime's compute stream, its transfer through
// NCCL on the runtime's communication stream after an event from the
// compute stream; against the same plan on the host. (One rank: every
// transfer is a rank's block to itself, but each copy of the plan runs.)
TEST(NcclSingleRank, StepCollectivesOnTheDeviceMatchTheHost) {
  HALYARD_NEED_GPU();
  auto comm = make_nccl_single_rank(60);
  const RuntimeCudaContext& ctx = runtime_cuda_context();
  ASSERT_NE(ctx.context, nullptr) << ctx.error;
  comm->use_streams(ctx.comm_stream, ctx.stream);
  auto device = make_cuda_collective_memory();
  HostCollectiveMemory host;
  auto host_comm = make_in_process_group(1);
  struct Case {
    CallKind kind;
    BufferSpec in, out;
  };
  const Case f32_cases[] = {
      {CallKind::SeqToHeads, spec("x", ElemType::F32, {2, 5, 4, 3}), spec("y", ElemType::F32, {2, 5, 4, 3})},
      {CallKind::HeadsToSeq, spec("y", ElemType::F32, {3, 7, 2, 8}), spec("x", ElemType::F32, {3, 7, 2, 8})},
      {CallKind::AllReduce, spec("loss", ElemType::F32, {1000}), spec("sum", ElemType::F32, {1000})},
  };
  for (const Case& c : f32_cases) {
    int64_t n = 1;
    for (int d = 0; d < c.in.rank; ++d) n *= c.in.shape[d];
    const std::vector<float> x = ramp(static_cast<size_t>(n), 0.5f);
    std::vector<float> want(x.size(), -1.f);
    run_collective(c.kind, c.in, x.data(), c.out, want.data(), *host_comm[0], host);
    DeviceBuffer<float> in(x), out(std::vector<float>(x.size(), -1.f));
    run_plan(plan_collective(c.kind, c.in, c.out, 1, comm->backend()), in.get(), out.get(), comm.get(), *device);
    EXPECT_EQ(on_host_after_the_step(out), want) << c.in.name << " -> " << c.out.name;
  }
  const BufferSpec pos = spec("pos", ElemType::I32, {2, 9});
  std::vector<int32_t> p(18), want(18, -1);
  std::iota(p.begin(), p.end(), 7);
  run_collective(CallKind::GatherSeq, pos, p.data(), pos, want.data(), *host_comm[0], host);
  DeviceBuffer<int32_t> in(p), out(std::vector<int32_t>(18, -1));
  run_plan(plan_collective(CallKind::GatherSeq, pos, pos, 1, comm->backend()), in.get(), out.get(), comm.get(), *device);
  EXPECT_EQ(on_host_after_the_step(out), want);
}

// Replicated kv heads are summed on the way back (heads_to_seq over more
// ranks than kv heads): on the device by cuBLAS's geam, in place, on the
// compute stream. Strided rows both sides, against the host's sums.
TEST(NcclSingleRank, ReplicaSumsOnTheDeviceMatchTheHost) {
  HALYARD_NEED_GPU();
  auto comm = make_nccl_single_rank(60);  // (the device current, as a model over NCCL has it)
  auto device = make_cuda_collective_memory();
  HostCollectiveMemory host;
  const Rows add{Area::Staging, Area::Out, 3, 5, 2, 11, 4, 6, true};  // 6 rows of 4, pitches 5 and 11
  const std::vector<float> src = ramp(40, 0.25f);
  const std::vector<float> dst = ramp(80, -3.f);
  std::vector<float> want = dst;
  host.rows(add, src.data(), want.data(), 4);
  DeviceBuffer<float> s(src), d(dst);
  device->rows(add, s.get(), d.get(), 4);
  EXPECT_EQ(on_host_after_the_step(d), want);
  device->zero(d.get(), 80 * 4);
  EXPECT_EQ(on_host_after_the_step(d), std::vector<float>(80, 0.f));
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
