// The NCCL communicator under mpirun (ctest runs it on 2 ranks):
//
//   mpirun -np 2 test_comm_nccl
//
// With a GPU per rank, the collectives move device buffers and are checked
// against values computed on the host. Without a CUDA device, rank 0 prints
// "[SKIP] no CUDA device: NCCL backend not run", the GPU tests skip, and only
// the factory's error for that case is checked. Rank 0 prints GoogleTest's
// report; other ranks print failed assertions only. Exits 0 if every rank
// passed, 77 (ctest's SKIP_RETURN_CODE) if the GPU tests were skipped and the
// rest passed, 1 otherwise.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "runtime/error.h"
#include "tests/device_buffer.h"
#include "tests/mpi_gtest.h"
#include "tests/uneven_exchange.h"

namespace halyard::runtime {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

Communicator* g_comm = nullptr;  // NCCL; null when the GPU tests skip
std::string g_skip;              // why they skip
bool g_this_rank_has_device = false;
int g_rank = 0;

#define HALYARD_NEED_GPU() \
  if (g_comm == nullptr) GTEST_SKIP() << g_skip

using halyard::testing::DeviceBuffer;
using halyard::testing::element;

TEST(CommNccl, NoDeviceThrowsAClearError) {
  if (g_comm != nullptr || g_skip.rfind("no CUDA device", 0) != 0) GTEST_SKIP() << "every rank has a CUDA device";
  try {
    auto comm = make_nccl_communicator(20);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    if (g_rank == 0) std::printf("rank 0 got, as users will:\n%s\n", e.what());
    if (g_this_rank_has_device) {
      EXPECT_THAT(e.what(), HasSubstr("no CUDA device; fix: run on GPU nodes or use make_mpi_communicator()"));
    } else {
      EXPECT_THAT(e.what(), StartsWith("error: NCCL communicator on rank " + std::to_string(g_rank) +
                                       ": no CUDA device (cudaGetDeviceCount: "));
      EXPECT_THAT(e.what(), HasSubstr("); fix: run on GPU nodes or use make_mpi_communicator()"));
    }
  }
}

// Checked before MPI or CUDA is asked anything, so it runs on every machine.
TEST(CommNccl, BadTimeoutThrowsBeforeAnythingIsSent) {
  try {
    auto comm = make_nccl_communicator(-1);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), StartsWith("error: communicator timeout of -1 s on rank " + std::to_string(g_rank)));
    EXPECT_THAT(e.what(), HasSubstr("the timeout must be a positive, finite number of seconds"));
  }
}

TEST(CommNccl, AllToAllVMovesUnevenBlocksAndCountsBytes) {
  HALYARD_NEED_GPU();
  Communicator& c = *g_comm;
  const int n = c.size(), r = c.rank();
  const halyard::testing::UnevenExchange x(r, n);
  const auto& send_counts = x.send_counts;
  const auto& recv_counts = x.recv_counts;
  const auto& send = x.send;
  const int64_t expected_bytes = x.bytes_to_others;
  const size_t recv_total = static_cast<size_t>(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0}));
  DeviceBuffer<float> d_send(send), d_recv(recv_total);
  c.reset_all_to_all_bytes_sent();
  c.all_to_all_v(d_send.get(), send_counts.data(), d_recv.get(), recv_counts.data());
  const std::vector<float> recv = d_recv.host();
  size_t at = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t k = 0; k < recv_counts[p]; ++k, ++at) EXPECT_EQ(recv[at], element(p, r, k)) << "from rank " << p;
  EXPECT_EQ(c.all_to_all_bytes_sent(), expected_bytes);

  DeviceBuffer<int32_t> i_send(std::vector<int32_t>(send.begin(), send.end())), i_recv(recv_total);
  c.all_to_all_v(i_send.get(), send_counts.data(), i_recv.get(), recv_counts.data());
  const std::vector<int32_t> recv_i = i_recv.host();
  for (size_t i = 0; i < recv_total; ++i) EXPECT_EQ(recv_i[i], static_cast<int32_t>(recv[i]));
  EXPECT_EQ(c.all_to_all_bytes_sent(), 2 * expected_bytes);
}

TEST(CommNccl, AllReduceSumOnDeviceAndHostValues) {
  HALYARD_NEED_GPU();
  Communicator& c = *g_comm;
  const int n = c.size(), r = c.rank();
  for (int64_t len : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100000}}) {
    std::vector<float> data(static_cast<size_t>(len));
    for (int64_t i = 0; i < len; ++i) data[i] = static_cast<float>(r + 1) + 0.5f * (i % 1000);
    DeviceBuffer<float> d(data);
    c.all_reduce_sum(d.get(), len);
    const std::vector<float> sum = d.host();
    for (int64_t i = 0; i < len; ++i)
      ASSERT_EQ(sum[i], static_cast<float>(n * (n + 1) / 2) + 0.5f * (i % 1000) * n) << "element " << i;
  }
  DeviceBuffer<double> d64(std::vector<double>(33, 0.25 * (r + 1)));
  c.all_reduce_sum(d64.get(), 33);
  EXPECT_EQ(d64.host(), std::vector<double>(33, 0.25 * n * (n + 1) / 2));

  // Host memory goes through the communicator's staging buffer.
  std::vector<float> on_host(5, 1.0f + r);
  c.all_reduce_sum(on_host.data(), 5);
  EXPECT_EQ(on_host, std::vector<float>(5, static_cast<float>(n + n * (n - 1) / 2)));
  EXPECT_EQ(c.all_reduce_sum(1.5 * r), 1.5 * n * (n - 1) / 2);
  EXPECT_EQ(c.all_reduce_sum(int64_t{1} << (40 + r)), ((int64_t{1} << n) - 1) << 40);
}

TEST(CommNccl, AllGatherPutsRankPAtOffsetPTimesN) {
  HALYARD_NEED_GPU();
  Communicator& c = *g_comm;
  const int n = c.size(), r = c.rank();
  const int64_t per = 6;
  std::vector<int32_t> ids(per);
  for (int64_t k = 0; k < per; ++k) ids[k] = r * 10 + static_cast<int32_t>(k);
  DeviceBuffer<int32_t> d_ids(ids), d_all(per * n);
  c.all_gather(d_ids.get(), per, d_all.get());
  const std::vector<int32_t> all = d_all.host();
  for (int p = 0; p < n; ++p)
    for (int64_t k = 0; k < per; ++k) EXPECT_EQ(all[p * per + k], p * 10 + k);

  DeviceBuffer<float> f_send(std::vector<float>(3, 0.5f * r)), f_all(3 * n);
  c.all_gather(f_send.get(), 3, f_all.get());
  const std::vector<float> all_f = f_all.host();
  for (int p = 0; p < n; ++p)
    for (int k = 0; k < 3; ++k) EXPECT_EQ(all_f[p * 3 + k], 0.5f * p);
}

TEST(CommNccl, ReduceScatterSumGivesEachRankItsBlock) {
  HALYARD_NEED_GPU();
  Communicator& c = *g_comm;
  const int n = c.size(), r = c.rank();
  const int64_t per = 6;
  std::vector<float> send(per * n);
  for (int64_t i = 0; i < per * n; ++i) send[i] = static_cast<float>(i) + 1000.0f * r;
  DeviceBuffer<float> d_send(send), d_recv(per);
  c.reduce_scatter_sum(d_send.get(), d_recv.get(), per);
  const std::vector<float> recv = d_recv.host();
  for (int64_t k = 0; k < per; ++k)
    EXPECT_EQ(recv[k], static_cast<float>(n * (r * per + k)) + 1000.0f * n * (n - 1) / 2);
}

TEST(CommNccl, SendRecvBetweenPairsInCallOrder) {
  HALYARD_NEED_GPU();
  Communicator& c = *g_comm;
  const int n = c.size(), r = c.rank();
  if (n % 2 != 0) GTEST_SKIP() << "pairs need an even number of ranks";
  const int peer = r ^ 1;
  DeviceBuffer<float> first(std::vector<float>(1 << 16, 1.0f * r)), second(std::vector<float>(3, -1.0f * r));
  DeviceBuffer<float> got_first(1 << 16), got_second(3);
  // NCCL sends complete only when received: even ranks send first.
  if (r % 2 == 0) {
    c.send(first.get(), 1 << 16, peer, 1);
    c.send(second.get(), 3, peer, 2);
    c.recv(got_first.get(), 1 << 16, peer, 1);
    c.recv(got_second.get(), 3, peer, 2);
  } else {
    c.recv(got_first.get(), 1 << 16, peer, 1);
    c.recv(got_second.get(), 3, peer, 2);
    c.send(first.get(), 1 << 16, peer, 1);
    c.send(second.get(), 3, peer, 2);
  }
  EXPECT_EQ(got_first.host(), std::vector<float>(1 << 16, 1.0f * peer));
  EXPECT_EQ(got_second.host(), std::vector<float>(3, -1.0f * peer));
}

TEST(CommNccl, HostBufferIsAUserMistakeAndLeavesTheCommunicatorUsable) {
  HALYARD_NEED_GPU();
  Communicator& c = *g_comm;
  std::vector<float> send(4), recv(4 * c.size());
  try {
    c.all_gather(send.data(), 4, recv.data());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("error: all_gather on rank " + std::to_string(c.rank()) + " of " +
                                    std::to_string(c.size()) +
                                    ": send is host memory, but the NCCL backend moves device memory."));
  }
  EXPECT_STREQ(c.backend(), "NCCL");
  for (int i = 0; i < 50; ++i) c.barrier();
}

int run(int argc, char** argv) {
  // MPI first, and on every machine: the MPI communicator initializes it
  // (finalizing it at exit) and sums the ranks' results, with a timeout.
  auto mpi = make_mpi_communicator(30);
  g_rank = mpi->rank();
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();
    devices = 0;
  }
  g_this_rank_has_device = devices > 0;
  const char* local_size_env = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int local_size = local_size_env ? std::max(1, std::atoi(local_size_env)) : 1;
  const int64_t without = mpi->all_reduce_sum(int64_t{devices == 0});
  const int64_t short_of = mpi->all_reduce_sum(int64_t{devices > 0 && devices < local_size});
  if (without > 0)
    g_skip = "no CUDA device: NCCL backend not run";
  else if (short_of > 0)  // NCCL refuses two ranks on one GPU
    g_skip = "fewer CUDA devices than ranks on a node (NCCL needs one GPU per rank): NCCL backend not run";
  if (!g_skip.empty() && mpi->rank() == 0) {
    std::printf("[SKIP] %s\n", g_skip.c_str());
    std::fflush(stdout);
  }

  int failed = 0;
  std::unique_ptr<Communicator> nccl;
  if (g_skip.empty()) {
    try {
      nccl = make_nccl_communicator(20);
    } catch (const Error& e) {
      std::fprintf(stderr, "[rank %d] %s\n", mpi->rank(), e.what());
      failed = 1;
    }
  }
  g_comm = nccl.get();
  ::testing::InitGoogleTest(&argc, argv);
  halyard::testing::print_failures_only_off_rank_zero(mpi->rank());
  if (!failed) failed = RUN_ALL_TESTS() != 0;
  g_comm = nullptr;
  nccl.reset();
  const int64_t ranks_failed = mpi->all_reduce_sum(int64_t{failed});
  if (mpi->rank() == 0)
    std::printf("comm_nccl: %s (%d ranks)\n",
                ranks_failed ? (std::to_string(ranks_failed) + " rank(s) FAILED").c_str()
                : g_skip.empty() ? "all ranks passed"
                                 : "skipped",
                mpi->size());
  mpi.reset();
  if (ranks_failed) return 1;
  return g_skip.empty() ? 0 : 77;
}

}  // namespace
}  // namespace halyard::runtime

int main(int argc, char** argv) { return halyard::runtime::run(argc, argv); }
