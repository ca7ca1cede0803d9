// This process's MPI, shared by the MPI and NCCL communicators (internal to
// halyard_comm_mpi; not a public header).
//
// MPI is initialized by the first communicator made, if nobody has, and
// finalized at exit unless a communicator failed: finalizing could then wait
// forever on a dead peer (mpirun sees the abnormal exit and stops the job,
// which is what a failed rank wants).
#pragma once

#include <mpi.h>

#include <string>

namespace halyard::runtime {

// Initializes MPI if needed; `who` names the caller in errors (MPI already
// finalized, MPI_Init_thread failed).
void ensure_mpi(const std::string& who);
// Marks the process as having a failed communicator: no MPI_Finalize at exit.
void mark_mpi_failed();
// MPI's text for an error code.
std::string mpi_error_string(int code);

}  // namespace halyard::runtime
