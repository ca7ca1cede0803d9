// The NCCL communicator's pieces shared by its bootstraps (internal to
// halyard_comm_nccl; not a public header): comm_nccl.cpp makes the
// communicator from an id, without MPI; comm_nccl_mpi.cpp gets the id and the
// device over MPI_COMM_WORLD.
#pragma once

#include <nccl.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "runtime/comm.h"

namespace halyard::runtime {

// Rank `rank` of `size`, not started yet: constructing it checks the timeout
// (before any bootstrap asks MPI or CUDA anything, as every communicator
// does). `on_failure` runs before any error it throws.
std::unique_ptr<Communicator> unopened_nccl_communicator(int rank, int size, double timeout_s,
                                                         std::function<void()> on_failure);
// Starts a communicator made by unopened_nccl_communicator on CUDA `device`,
// every rank passing the same id. Throws Error (naming the device and NCCL's
// reason) when NCCL cannot start.
void open_nccl(Communicator& comm, int device, const ncclUniqueId& id);

// This process's CUDA devices; with none (or when CUDA cannot tell), 0 and
// in `why` the error a communicator on `rank` throws for it.
int count_cuda_devices(int rank, std::string& why);

namespace nccl_detail {

using Clock = std::chrono::steady_clock;

inline Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Calls done() until it returns true or the deadline passes. Spins (yielding)
// for the first millisecond, where most collectives end, then sleeps 50 us so
// that a long wait does not take a core from the rank's own threads.
template <typename Done>
inline bool poll_until(Clock::time_point deadline, Done&& done) {
  const auto start = Clock::now();
  for (;;) {
    if (done()) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    if (now - start < std::chrono::milliseconds(1))
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace nccl_detail
}  // namespace halyard::runtime
