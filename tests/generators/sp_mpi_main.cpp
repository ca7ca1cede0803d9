// Sequence parallelism over MPI processes: `mpirun -np P sp_mpi_main` runs the
// Ulysses-sharded tiny Llama built for P ranks (2, or 4: also the padded,
// checkpointed one, and as dp 2 x sp 2) and, on every rank, the single-rank library on the whole
// batch; each rank's loss and gradients must match within 1e-5 relative and
// its all-to-all volume Ulysses' formula within 5%. Exits non-zero on any
// mismatch, naming the rank (ctest: sp_mpi_2, sp_mpi_4).
#include <cstdio>
#include <exception>
#include <string>

#include "runtime/lr_schedule.h"
#include "tests/generators/sp_check.h"
#include "tiny_sp1_s126.h"
#include "tiny_sp1_s128.h"
#include "tiny_sp2_s128.h"
#include "tiny_sp4_s126_tiled.h"
#include "tiny_sp4_s128.h"

using namespace halyard;

namespace {

bool check(const runtime::ModelSpec& reference, const runtime::ModelSpec& sharded, runtime::Communicator& comm) {
  const auto cfg = llama::LlamaConfig::load(std::string(HALYARD_SOURCE_DIR) + "/examples/llama/configs/tiny.json");
  const sp_check::StepResult ref = sp_check::run_step(reference, nullptr);
  const sp_check::StepResult got = sp_check::run_step(sharded, &comm);
  const sp_check::Comparison c = sp_check::compare(sharded, got, ref);
  const sp_check::Volume v = sp_check::ulysses_forward_bytes(cfg, sharded, comm.size());
  const bool volume_ok = sp_check::volume_matches(got, v);
  const bool ok = c.loss <= 1e-5 && c.forward_loss <= 1e-5 && c.worst_grad <= 1e-5 && volume_ok &&
                  got.a2a_train_bytes == 2 * got.a2a_forward_bytes;
  std::printf("%s %s rank %d/%d (MPI): loss %.9g vs one rank %.9g (rel %.2e), worst gradient %.2e (%s); "
              "all-to-all per layer: forward %lld B sent (formula %.0f B; %.0f B leave the rank), train %lld B\n",
              ok ? "ok  " : "FAIL", sharded.name, comm.rank(), comm.size(), got.loss, ref.loss, c.loss, c.worst_grad,
              c.worst_param.c_str(), static_cast<long long>(got.a2a_forward_bytes / v.layers), v.formula, v.over_the_wire,
              static_cast<long long>(got.a2a_train_bytes / v.layers));
  return ok;
}

}  // namespace

int main() {
  try {
    auto comm = runtime::make_mpi_communicator(120);
    runtime::Model::set_num_threads(runtime::default_threads_per_rank());
    bool ok = true;
    if (comm->size() == 2) {
      ok = check(halyard_models::tiny_sp1_s128(), halyard_models::tiny_sp2_s128(), *comm);
    } else if (comm->size() == 4) {
      ok = check(halyard_models::tiny_sp1_s128(), halyard_models::tiny_sp4_s128(), *comm);
      ok = check(halyard_models::tiny_sp1_s126(), halyard_models::tiny_sp4_s126_tiled(), *comm) && ok;
      // dp 2 x sp 2: sequence groups of world ranks {0, 1} and {2, 3}.
      const int replica = comm->rank() / 2;
      auto group = runtime::make_mpi_communicator(120, replica);
      const auto& spec = halyard_models::tiny_sp2_s128();
      const sp_check::StepResult ref = sp_check::data_parallel_reference(halyard_models::tiny_sp1_s128(), 2);
      const sp_check::StepResult got = sp_check::run_step(spec, group.get(), comm.get(), replica, 2);
      const sp_check::Comparison c = sp_check::compare(spec, got, ref);
      const bool dp_ok = c.loss <= 1e-5 && c.forward_loss <= 1e-5 && c.worst_grad <= 1e-5;
      std::printf("%s dp 2 x sp 2 rank %d (replica %d, sp rank %d of %d, MPI): loss %.9g vs %.9g (rel %.2e), "
                  "worst gradient %.2e (%s)\n",
                  dp_ok ? "ok  " : "FAIL", comm->rank(), replica, group->rank(), group->size(), got.loss, ref.loss,
                  c.loss, c.worst_grad, c.worst_param.c_str());
      ok = ok && dp_ok;
    } else {
      std::fprintf(stderr, "error: sp_mpi_main has libraries for 2 and 4 ranks, not %d.\nfix: mpirun -np 2 or -np 4.\n",
                   comm->size());
      return 2;
    }
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
