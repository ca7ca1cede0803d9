// The NCCL communicator's bootstrap over MPI_COMM_WORLD (make_nccl_communicator
// in comm.h), every step polled against the timeout:
//   1. each rank counts its CUDA devices; the ranks all-gather whether they
//      have one, so a CPU-only rank fails everywhere at once, with its name,
//      instead of leaving its peers to time out;
//   2. the node-local rank picks the device (modulo the device count);
//   3. rank 0 makes the ncclUniqueId and broadcasts it;
//   4. ncclCommInitRankConfig with blocking = 0 (comm_nccl.cpp).
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "runtime/comm_nccl_open.h"
#include "runtime/error.h"
#include "runtime/mpi_process.h"

namespace halyard::runtime {
namespace {

using nccl_detail::deadline_after;
using nccl_detail::poll_until;

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// Polls an MPI request of the bootstrap; throws on error or at the deadline.
void wait_mpi(MPI_Request* request, double timeout_s, const std::string& who, const char* call,
              const char* what) {
  int rc = MPI_SUCCESS;
  const bool done = poll_until(deadline_after(timeout_s), [&] {
    int flag = 0;
    rc = MPI_Test(request, &flag, MPI_STATUS_IGNORE);
    return rc != MPI_SUCCESS || flag != 0;
  });
  if (done && rc == MPI_SUCCESS) return;
  mark_mpi_failed();
  if (!done)
    throw Error("error: " + who + " timed out after " + seconds_text(timeout_s) +
                " s waiting for a peer (dead or stuck?) " + what +
                "\nevery rank must make its communicators in the same order.");
  throw Error("error: " + who + ": " + call + " failed: " + mpi_error_string(rc));
}

// The rank among the processes of this node: mpirun's variable when it set
// one, else MPI's shared-memory split (blocking, but by now every rank is known
// to be inside the factory, since all of them answered the all-gather).
int local_rank(int rank, const std::string& who) {
  if (const char* env = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) {
    char* end = nullptr;
    long value = std::strtol(env, &end, 10);
    if (end != env && *end == 0 && value >= 0) return static_cast<int>(value);
  }
  MPI_Comm node = MPI_COMM_NULL;
  int rc = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  if (rc != MPI_SUCCESS) throw Error("error: " + who + ": MPI_Comm_split_type failed: " + mpi_error_string(rc));
  int local = 0;
  MPI_Comm_rank(node, &local);
  MPI_Comm_free(&node);
  return local;
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(double timeout_s) {
  ensure_mpi("make_nccl_communicator");
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto comm = unopened_nccl_communicator(rank, size, timeout_s, mark_mpi_failed);
  const std::string who = "make_nccl_communicator on rank " + std::to_string(rank) + " of " + std::to_string(size);

  // The buffers MPI writes into. A request that times out cannot be
  // cancelled (MPI has no way to cancel a collective) and may still write
  // them later, so they are leaked then rather than freed.
  struct Bootstrap {
    int has_device = 0;
    std::vector<int> everyone;
    struct {
      int result;
      ncclUniqueId id;
    } id{};
  };
  auto boot = std::make_unique<Bootstrap>();
  auto wait = [&](MPI_Request* request, const char* call, const char* what) {
    try {
      wait_mpi(request, timeout_s, who, call, what);
    } catch (const Error&) {
      (void)boot.release();
      throw;
    }
  };

  // 1. Who has a GPU.
  std::string no_device;
  const int devices = count_cuda_devices(rank, no_device);
  const bool has_device = devices > 0;
  boot->has_device = has_device ? 1 : 0;
  boot->everyone.assign(static_cast<size_t>(size), 0);
  MPI_Request request;
  int rc = MPI_Iallgather(&boot->has_device, 1, MPI_INT, boot->everyone.data(), 1, MPI_INT, MPI_COMM_WORLD, &request);
  if (rc != MPI_SUCCESS) throw Error("error: " + who + ": MPI_Iallgather failed: " + mpi_error_string(rc));
  try {
    wait(&request, "MPI_Iallgather", "while the ranks counted their CUDA devices");
  } catch (const Error&) {
    if (!has_device) throw Error(no_device);  // the root cause, whatever the peers did
    throw;
  }
  if (!has_device) throw Error(no_device);
  std::vector<int> without;
  for (int p = 0; p < size; ++p)
    if (!boot->everyone[static_cast<size_t>(p)]) without.push_back(p);
  if (!without.empty())
    throw Error("error: NCCL communicator on rank " + std::to_string(rank) + ": " + ranks_text(without) +
                (without.size() == 1 ? " has" : " have") +
                " no CUDA device; fix: run on GPU nodes or use make_mpi_communicator()");

  // 2. Which GPU.
  const int device = local_rank(rank, who) % devices;
  const cudaError_t set_rc = cudaSetDevice(device);
  if (set_rc != cudaSuccess)
    throw Error("error: " + who + ": cudaSetDevice(" + std::to_string(device) +
                ") failed: " + cudaGetErrorString(set_rc));

  // 3. The id, with rank 0's result so that its failure is everyone's error.
  if (rank == 0) boot->id.result = static_cast<int>(ncclGetUniqueId(&boot->id.id));
  rc = MPI_Ibcast(&boot->id, static_cast<int>(sizeof boot->id), MPI_BYTE, 0, MPI_COMM_WORLD, &request);
  if (rc != MPI_SUCCESS) throw Error("error: " + who + ": MPI_Ibcast failed: " + mpi_error_string(rc));
  wait(&request, "MPI_Ibcast", "while rank 0 broadcast the NCCL unique id");
  if (boot->id.result != ncclSuccess)
    throw Error("error: " + who + ": ncclGetUniqueId on rank 0 failed: " +
                ncclGetErrorString(static_cast<ncclResult_t>(boot->id.result)) +
                "\nrank 0 could not open a bootstrap socket; NCCL_DEBUG=INFO and NCCL_SOCKET_IFNAME help find why.");

  // 4. The communicator.
  open_nccl(*comm, device, boot->id.id);
  return comm;
}

}  // namespace halyard::runtime
