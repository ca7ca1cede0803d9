// This process's MPI (see mpi_process.h).
#include "runtime/mpi_process.h"

#include <atomic>
#include <cstdlib>

#include "runtime/error.h"

namespace halyard::runtime {
namespace {

std::atomic<bool> g_failed{false};

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !g_failed.load()) MPI_Finalize();
}

}  // namespace

void mark_mpi_failed() { g_failed = true; }

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(length));
}

void ensure_mpi(const std::string& who) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized)
    throw Error("error: " + who + ": MPI is already finalized in this process.\n"
                "fix: make every communicator before MPI_Finalize.");
  if (initialized) return;
  int provided = 0;
  // SERIALIZED: a model's communication thread makes the step's calls while
  // the main thread computes (one thread at a time ever calls MPI).
  int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  if (rc != MPI_SUCCESS) throw Error("error: " + who + ": MPI_Init_thread failed: " + mpi_error_string(rc));
  std::atexit(finalize_at_exit);
}

}  // namespace halyard::runtime
