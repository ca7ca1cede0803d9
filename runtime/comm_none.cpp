// make_mpi_communicator for programs built without MPI (halyard_comm_none):
// a trainer carried to a GPU node that has no MPI (scripts/gpu_check.sh)
// runs one rank, and asking it for ranks is an error that says so.
#include <string>

#include "runtime/comm.h"
#include "runtime/error.h"

namespace halyard::runtime {

std::unique_ptr<Communicator> make_mpi_communicator(double, int) {
  throw Error("error: this program was built without MPI (halyard_add_llama_train(... NO_MPI): a build for nodes "
              "that have none), so it runs one rank only.\nfix: launch it without mpirun, or use a build that links "
              "MPI (the default) for several ranks.");
}

}  // namespace halyard::runtime
