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
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "runtime/error.h"
#include "tests/mpi_gtest.h"
#include "tests/nccl_contract.h"

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

namespace nccl_contract = halyard::testing::nccl_contract;

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
  nccl_contract::all_to_all_v_moves_uneven_blocks_and_counts_bytes(*g_comm);
}

TEST(CommNccl, AllReduceSumOnDeviceAndHostValues) {
  HALYARD_NEED_GPU();
  nccl_contract::all_reduce_sum_on_device_and_host_values(*g_comm);
}

TEST(CommNccl, AllGatherPutsRankPAtOffsetPTimesN) {
  HALYARD_NEED_GPU();
  nccl_contract::all_gather_puts_rank_p_at_offset_p_times_n(*g_comm);
}

TEST(CommNccl, ReduceScatterSumGivesEachRankItsBlock) {
  HALYARD_NEED_GPU();
  nccl_contract::reduce_scatter_sum_gives_each_rank_its_block(*g_comm);
}

TEST(CommNccl, SendRecvBetweenPairsInCallOrder) {
  HALYARD_NEED_GPU();
  if (g_comm->size() % 2 != 0) GTEST_SKIP() << "pairs need an even number of ranks";
  nccl_contract::send_recv_between_pairs_in_call_order(*g_comm);
}

TEST(CommNccl, HostBufferIsAUserMistakeAndLeavesTheCommunicatorUsable) {
  HALYARD_NEED_GPU();
  nccl_contract::host_buffer_is_a_user_mistake_and_leaves_the_communicator_usable(*g_comm);
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
