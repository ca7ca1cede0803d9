// Ring attention over MPI processes: `mpirun -np P strategies_mpi_main` runs
// the ring-sharded tiny Llama built for P ranks (2; or 4: contiguous,
// zigzag, and both padded with checkpointing and tiles; and on packed
// documents) and, on every rank,
// the single-rank library on the whole batch; each rank's loss and gradients
// must match within 1e-5 relative, and the bytes it sent the ring's formula
// exactly (hybrid 2 x 2 on 4: plus Ulysses' within each pair of ranks). Exits non-zero on any mismatch, naming the rank (ctest:
// strategies_mpi_2, strategies_mpi_4).
//
//   strategies_mpi_main --check-fault   the ctest wrapper (strategies_ring_killed):
//     runs `mpirun --enable-recovery -np 4` on --fault, where rank 2 SIGKILLs
//     itself in the middle of a ring exchange (as it starts its third pass
//     of the first step); the survivors, with a 5 s timeout, must exit
//     non-zero within 60 s, and one must name rank 2 as the one it waited for.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include "runtime/lr_schedule.h"
#include "runtime/error.h"
#include "tests/generators/sp_check.h"
#include "tests/mpi_launch.h"
#include "tiny_hybrid_sp4_s126_tiled.h"
#include "tiny_hybrid_sp4_s128.h"
#include "tiny_ring_sp2_s128.h"
#include "tiny_ring_sp4_s126_tiled.h"
#include "tiny_ring_sp4_s128.h"
#include "tiny_sp1_s126.h"
#include "tiny_sp1_s128.h"
#include "tiny_zigzag_sp4_s126_tiled.h"
#include "tiny_zigzag_sp4_s128.h"

using namespace halyard;

namespace {

bool check(const runtime::ModelSpec& reference, const runtime::ModelSpec& ring, runtime::Communicator& comm,
           const runtime::Packing& packing = {}) {
  const auto cfg = llama::LlamaConfig::load(std::string(HALYARD_SOURCE_DIR) + "/examples/llama/configs/tiny.json");
  const sp_check::StepResult ref = sp_check::run_step(reference, nullptr, nullptr, 0, 1, 3, 5, packing);
  const sp_check::StepResult got = sp_check::run_step(ring, &comm, nullptr, 0, 1, 3, 5, packing);
  const sp_check::Comparison c = sp_check::compare(ring, got, ref);
  const int u = std::max(ring.ulysses_degree, 1);
  const sp_check::RingVolume v = sp_check::ring_bytes(cfg, ring, comm.size(), u);
  const bool a2a_ok = u == 1 ? got.a2a_forward_bytes == 0
                             : sp_check::volume_matches(got, sp_check::ulysses_forward_bytes(cfg, ring, u));
  const double fwd = static_cast<double>(got.p2p_forward_bytes) / v.layers;
  const double bwd = static_cast<double>(got.p2p_train_bytes - got.p2p_forward_bytes) / v.layers;
  const bool ok = c.loss <= 1e-5 && c.forward_loss <= 1e-5 && c.worst_grad <= 1e-5 &&
                  fwd == v.forward + v.indices && bwd == v.backward && a2a_ok;
  std::printf("%s %s%s (%s) rank %d/%d (MPI): loss %.9g vs one rank %.9g (rel %.2e), worst gradient %.2e (%s); "
              "ring bytes per layer: forward %.0f (formula %.0f + token indices %.0f), backward %.0f (formula %.0f)\n",
              ok ? "ok  " : "FAIL", packing.on() ? "packed " : "", ring.name, ring.sequence_layout, comm.rank(), comm.size(), got.loss, ref.loss,
              c.loss, c.worst_grad, c.worst_param.c_str(), fwd, v.forward, v.indices, bwd, v.backward);
  return ok;
}

// A communicator that forwards to another one, and on rank `victim` dies as
// it starts its `at`-th ring pass (the middle of an exchange: the passes
// before it are in flight).
class DiesOnSend : public runtime::Communicator {
 public:
  DiesOnSend(std::unique_ptr<runtime::Communicator> inner, int victim, int at)
      : Communicator(inner->rank(), inner->size(), inner->timeout_s()), inner_(std::move(inner)), victim_(victim), at_(at) {}
  const char* backend() const override { return inner_->backend(); }
  bool other_threads_may_call() const override { return inner_->other_threads_may_call(); }

 protected:
  using T = runtime::CommType;
  void do_all_to_all_v(const void* s, const int64_t* sc, void* r, const int64_t* rc, T t) override {
    if (t == T::I32) inner_->all_to_all_v(static_cast<const int32_t*>(s), sc, static_cast<int32_t*>(r), rc);
    else inner_->all_to_all_v(static_cast<const float*>(s), sc, static_cast<float*>(r), rc);
  }
  void do_all_reduce_sum(void* data, int64_t n, T t) override {
    if (t == T::F64) inner_->all_reduce_sum(static_cast<double*>(data), n);
    else if (t == T::I64) *static_cast<int64_t*>(data) = inner_->all_reduce_sum(*static_cast<int64_t*>(data));
    else inner_->all_reduce_sum(static_cast<float*>(data), n);
  }
  void do_all_gather(const void* s, int64_t n, void* r, T t) override {
    if (t == T::I32) inner_->all_gather(static_cast<const int32_t*>(s), n, static_cast<int32_t*>(r));
    else inner_->all_gather(static_cast<const float*>(s), n, static_cast<float*>(r));
  }
  void do_reduce_scatter_sum(const void* s, void* r, int64_t n, T) override {
    inner_->reduce_scatter_sum(static_cast<const float*>(s), static_cast<float*>(r), n);
  }
  // The ring's passes go through the backend's nonblocking exchange (MPI_Isend,
  // MPI_Irecv): the survivors' timeouts are those of a pending exchange.
  std::unique_ptr<runtime::Exchange> do_start_exchange(const void* s, void* r, int64_t n, int to, int from, int tag,
                                                       T t) override {
    if (rank() == victim_ && ++sends_ == at_) raise(SIGKILL);
    if (t == T::I32)
      return inner_->start_exchange(static_cast<const int32_t*>(s), static_cast<int32_t*>(r), n, to, from, tag);
    return inner_->start_exchange(static_cast<const float*>(s), static_cast<float*>(r), n, to, from, tag);
  }
  void do_send(const void* d, int64_t n, int peer, int tag, T t) override {
    if (t == T::I32) inner_->send(static_cast<const int32_t*>(d), n, peer, tag);
    else inner_->send(static_cast<const float*>(d), n, peer, tag);
  }
  void do_recv(void* d, int64_t n, int peer, int tag, T t) override {
    if (t == T::I32) inner_->recv(static_cast<int32_t*>(d), n, peer, tag);
    else inner_->recv(static_cast<float*>(d), n, peer, tag);
  }
  void do_barrier() override { inner_->barrier(); }

 private:
  std::unique_ptr<runtime::Communicator> inner_;
  int victim_, at_, sends_ = 0;
};

// --fault: ring steps until rank 2 dies mid-exchange; survivors report and exit 1.
int run_fault() {
  DiesOnSend comm(runtime::make_mpi_communicator(5), 2, 3);
  comm.barrier();
  const auto start = std::chrono::steady_clock::now();
  try {
    for (int step = 0; step < 3; ++step) sp_check::run_step(halyard_models::tiny_ring_sp4_s128(), &comm);
  } catch (const runtime::Error& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "[rank %d after %.1f s] %s\n", comm.rank(), s, e.what());
    std::fflush(stderr);
    std::exit(1);
  }
  std::fprintf(stderr, "[rank %d] ring steps finished without rank 2\n", comm.rank());
  return 3;
}

int check_fault() {
  const testing::Launch run = testing::launch({HALYARD_MPIEXEC, "--allow-run-as-root", "--oversubscribe",
                                               "--enable-recovery", "-np", "4", testing::self_path(), "--fault"},
                                              60);
  std::vector<std::string> problems;
  if (run.hung) problems.push_back("mpirun was still running after 60 s: something hung");
  if (run.log.find("waiting for rank 2 (dead or stuck?)") == std::string::npos)
    problems.push_back("no survivor reported \"... timed out after 5 s waiting for rank 2 (dead or stuck?)\"");
  if (run.log.find("finished without rank 2") != std::string::npos)
    problems.push_back("a survivor finished its steps without rank 2");
  for (const auto& p : problems) std::printf("FAILED: %s\n", p.c_str());
  if (problems.empty()) std::printf("PASSED: rank 2 killed in a ring exchange, reported in %.1f s\n", run.seconds);
  return problems.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "--check-fault") return check_fault();
  if (mode == "--fault") return run_fault();
  try {
    auto comm = runtime::make_mpi_communicator(120);
    runtime::Model::set_num_threads(runtime::default_threads_per_rank());
    bool ok = true;
    if (comm->size() == 2) {
      ok = check(halyard_models::tiny_sp1_s128(), halyard_models::tiny_ring_sp2_s128(), *comm);
      ok = check(halyard_models::tiny_sp1_s128(), halyard_models::tiny_ring_sp2_s128(), *comm, sp_check::kWords) && ok;
    } else if (comm->size() == 4) {
      ok = check(halyard_models::tiny_sp1_s128(), halyard_models::tiny_ring_sp4_s128(), *comm);
      ok = check(halyard_models::tiny_sp1_s128(), halyard_models::tiny_zigzag_sp4_s128(), *comm) && ok;
      ok = check(halyard_models::tiny_sp1_s126(), halyard_models::tiny_ring_sp4_s126_tiled(), *comm) && ok;
      ok = check(halyard_models::tiny_sp1_s126(), halyard_models::tiny_zigzag_sp4_s126_tiled(), *comm) && ok;
      ok = check(halyard_models::tiny_sp1_s128(), halyard_models::tiny_hybrid_sp4_s128(), *comm) && ok;
      ok = check(halyard_models::tiny_sp1_s126(), halyard_models::tiny_hybrid_sp4_s126_tiled(), *comm) && ok;
      // Packed documents (every word one), crossing the ranks' boundaries.
      ok = check(halyard_models::tiny_sp1_s128(), halyard_models::tiny_ring_sp4_s128(), *comm, sp_check::kWords) && ok;
      ok = check(halyard_models::tiny_sp1_s126(), halyard_models::tiny_zigzag_sp4_s126_tiled(), *comm, sp_check::kWords) &&
           ok;
      ok = check(halyard_models::tiny_sp1_s128(), halyard_models::tiny_hybrid_sp4_s128(), *comm, sp_check::kWords) && ok;
    } else {
      std::fprintf(stderr,
                   "error: strategies_mpi_main has libraries for 2 and 4 ranks, not %d.\nfix: mpirun -np 2 or -np 4.\n",
                   comm->size());
      return 2;
    }
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
