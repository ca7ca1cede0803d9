// calibrate_machine (runtime/measure.h) over MPI ranks: the figures a plan's
// cost model is set from, for this machine and rank count.
//
//   mpirun --allow-run-as-root --oversubscribe -np 4 measure_mpi_main [--threads T]
//
// Rank 0 prints the JSON object, then every rank's resident baseline. Exits 1
// if the ranks disagree on any field but their baseline (every rank must get
// the same fits), or a figure is not a finite non-negative number; no figure
// is compared with a speed (ctest: calibrate_mpi, label "plan").
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "runtime/lr_schedule.h"
#include "runtime/measure.h"

using namespace halyard::runtime;

namespace {

// Every number in j is finite and >= 0 (names the first that is not).
std::string first_bad_number(const nlohmann::json& j, const std::string& path) {
  if (j.is_number()) {
    const double v = j.get<double>();
    return std::isfinite(v) && v >= 0 ? "" : path + " = " + j.dump();
  }
  if (j.is_object())
    for (auto it = j.begin(); it != j.end(); ++it)
      if (std::string bad = first_bad_number(*it, path + "." + it.key()); !bad.empty()) return bad;
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 0;
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--threads") threads = std::atoi(argv[i + 1]);
  auto comm = make_mpi_communicator();
  if (threads < 1) threads = default_threads_per_rank();
  try {
    nlohmann::json machine = calibrate_machine(comm.get(), threads);
    const int64_t baseline = machine["process_baseline_bytes"].get<int64_t>();
    const std::string bad = first_bad_number(machine, "calibrate_machine");

    // The same object on every rank, but for the baseline: compare hashes.
    nlohmann::json shared = machine;
    shared.erase("process_baseline_bytes");
    const int32_t mine = static_cast<int32_t>(std::hash<std::string>{}(shared.dump()) & 0x7fffffff);
    std::vector<int32_t> hashes(static_cast<size_t>(comm->size()));
    comm->all_gather(&mine, 1, hashes.data());
    std::vector<float> baselines(static_cast<size_t>(comm->size()));
    const float mine_mib = static_cast<float>(baseline) / (1 << 20);
    comm->all_gather(&mine_mib, 1, baselines.data());
    const double bad_ranks = comm->all_reduce_sum(bad.empty() ? 0.0 : 1.0);

    if (!bad.empty()) std::fprintf(stderr, "rank %d: error: %s is not a finite number >= 0\n", comm->rank(), bad.c_str());
    if (comm->rank() == 0) {
      std::printf("%s\n", machine.dump(2).c_str());
      std::printf("process_baseline per rank (MiB):");
      for (float b : baselines) std::printf(" %.1f", b);
      std::printf("\n");
      for (int r = 1; r < comm->size(); ++r)
        if (hashes[static_cast<size_t>(r)] != hashes[0])
          std::fprintf(stderr, "error: rank %d's calibration differs from rank 0's (fits must be the same everywhere)\n", r);
    }
    for (int32_t h : hashes)
      if (h != hashes[0]) return 1;
    return bad_ranks > 0 ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", comm->rank(), e.what());
    return 1;
  }
}
