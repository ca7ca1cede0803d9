// Sequence-parallel strategies on 4 MPI ranks: where each rank's step time
// goes, measured with the runtime's per-step timestamps (Model::last_step_times).
//
//   mpirun -np 4 ring_bench [--steps K] [--only NAME]
// For the tiny Llama at 4,096 tokens (1,024 per rank), batch 1, one thread
// per rank: ring attention (contiguous and zigzag placement) and Ulysses.
// Per rank, the median over K steps of the attention kernels' time (zigzag
// should even it out; contiguous gives the last rank the most keys) and of
// the communication by kind: ring passes, Ulysses' all-to-alls, gradient
// sums. With overlap on, the model's communication thread runs them while
// the kernels go on; each kind's time on that thread (busy) and the time the
// step stood still waiting for it (waited) are timestamps of the same step,
// and the share hidden is 1 - waited / busy. A collective's time includes
// waiting for a slower peer, so load imbalance shows here too. Each
// strategy also runs with overlap off (every collective blocks where it
// stands), for the step time it saves. Beside the measured, the library's
// own plan (ModelSpec::plan_json, planned for the cluster it was built
// for) predicts the step, the communication and the part of it the step
// waits for.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "runtime/data.h"
#include "runtime/model.h"
#include "ring_s4096_sp4_contiguous.h"
#include "ring_s4096_sp4_ulysses.h"
#include "ring_s4096_sp4_zigzag.h"

using namespace halyard;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Figures {
  double step_s = 0, attention_s = 0;
  runtime::Model::CommTime ring, all_to_all, grads;
};

// The bundled corpus is shorter than a row of 4,096 tokens: rows come from
// it repeated, in a file of this rank's own.
runtime::TokenFile corpus(int rank) {
  std::ifstream in(HALYARD_SOURCE_DIR "/examples/llama/data/corpus.txt", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string path = "/tmp/halyard_ring_bench_" + std::to_string(::getpid()) + "_" + std::to_string(rank) + ".txt";
  std::ofstream out(path, std::ios::binary);
  for (int k = 0; k < 4; ++k) out << text;
  out.close();
  runtime::TokenFile f = runtime::TokenFile::from_text(path);
  std::remove(path.c_str());  // the mapping stays
  return f;
}

// K steps of `spec` on this rank; the medians of its step times.
Figures run(const runtime::ModelSpec& spec, runtime::Communicator& comm, int steps, bool overlap) {
  runtime::Model m(spec, &comm);
  m.set_overlap(overlap);
  m.init_params(1);
  const runtime::Batcher batcher(corpus(comm.rank()), spec.batch, spec.seq, spec.vocab, 7,
                                 runtime::Shard{comm.rank(), comm.size(), 0, 1, runtime::zigzag_layout(spec)});
  std::vector<double> step, attention;
  std::vector<runtime::Model::StepTimes> times;
  for (int s = 0; s <= steps; ++s) {
    const auto b = batcher.get(s);
    comm.barrier();
    m.train_step(b.input_ids.data(), b.labels.data(), b.position_ids.data());
    if (s == 0) continue;  // warm-up
    const auto& t = m.last_step_times();
    step.push_back(t.total_s);
    attention.push_back(t.attention_s);
    times.push_back(t);
  }
  // Per kind, the median step's waited and busy times (of the same step).
  auto kind = [&](runtime::Model::CommTime runtime::Model::StepTimes::*k) {
    std::vector<runtime::Model::CommTime> v;
    for (const auto& t : times) v.push_back(t.*k);
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.busy_s < b.busy_s; });
    return v.empty() ? runtime::Model::CommTime{} : v[v.size() / 2];
  };
  return {median(step), median(attention), kind(&runtime::Model::StepTimes::ring),
          kind(&runtime::Model::StepTimes::all_to_all), kind(&runtime::Model::StepTimes::grads)};
}

// Every rank's value of x, on every rank.
std::vector<float> gather(runtime::Communicator& comm, double x) {
  std::vector<float> all(static_cast<size_t>(comm.size()));
  const float v = static_cast<float>(x);
  comm.all_gather(&v, 1, all.data());
  return all;
}

void row(runtime::Communicator& comm, const char* what, double x, double scale, const char* unit) {
  const std::vector<float> all = gather(comm, x * scale);
  if (comm.rank() != 0) return;
  std::printf("  %-52s", what);
  for (float v : all) std::printf(" %9.1f", v);
  const auto [lo, hi] = std::minmax_element(all.begin(), all.end());
  std::printf("  %s (max/min %.2f)\n", unit, *lo > 0 ? *hi / *lo : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 5;
  std::string only;  // --only: the strategies whose name contains it (each alone, without the others' runs before it)
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--steps") steps = std::atoi(argv[i + 1]);
    else if (std::string(argv[i]) == "--only") only = argv[i + 1];
  auto comm = runtime::make_mpi_communicator(300);
  if (comm->size() != 4) {
    std::fprintf(stderr, "error: ring_bench runs on 4 ranks, not %d.\nfix: mpirun -np 4 ring_bench\n", comm->size());
    return 2;
  }
  runtime::Model::set_num_threads(1);
  if (comm->rank() == 0)
    std::printf("tiny Llama, seq 4096 over 4 MPI ranks (1024 tokens each), batch 1, 1 thread per rank, median of %d "
                "steps\n  %-52s %9s %9s %9s %9s\n",
                steps, "per rank", "rank 0", "rank 1", "rank 2", "rank 3");
  struct Strategy {
    const char* name;
    const runtime::ModelSpec& spec;
  };
  const Strategy strategies[] = {{"ring (contiguous)", halyard_models::ring_s4096_sp4_contiguous()},
                                 {"ring (zigzag)", halyard_models::ring_s4096_sp4_zigzag()},
                                 {"ulysses", halyard_models::ring_s4096_sp4_ulysses()}};
  for (const Strategy& s : strategies) {
    if (std::string(s.name).find(only) == std::string::npos) continue;
    const Figures on = run(s.spec, *comm, steps, true), off = run(s.spec, *comm, steps, false);
    if (comm->rank() == 0) std::printf("%s\n", s.name);
    row(*comm, "step ms (overlap on)", on.step_s, 1e3, "ms");
    row(*comm, "step ms (overlap off: collectives block)", off.step_s, 1e3, "ms");
    row(*comm, "attention kernels ms (forward + backward)", on.attention_s, 1e3, "ms");
    const struct {
      const char* name;
      runtime::Model::CommTime Figures::*f;
    } kinds[] = {{"ring passes", &Figures::ring},
                 {"Ulysses all-to-alls", &Figures::all_to_all},
                 {"gradient sums", &Figures::grads}};
    for (const auto& k : kinds) {
      const runtime::Model::CommTime t = on.*(k.f);
      if (comm->all_reduce_sum(static_cast<double>(t.busy_s)) == 0) continue;  // none in this strategy
      const std::string n = k.name;
      row(*comm, (n + " ms, on the communication thread").c_str(), t.busy_s, 1e3, "ms");
      row(*comm, (n + " ms, the step waited").c_str(), t.waited_s, 1e3, "ms");
      row(*comm, (n + ": share hidden %").c_str(), t.hidden(), 100, "%");
      row(*comm, (n + " ms, overlap off").c_str(), (off.*(k.f)).waited_s, 1e3, "ms");
    }
    double busy = 0, waited = 0;
    for (const auto& k : kinds) busy += (on.*(k.f)).busy_s, waited += (on.*(k.f)).waited_s;
    row(*comm, "all communication ms, on the communication thread", busy, 1e3, "ms");
    row(*comm, "all communication ms, the step waited", waited, 1e3, "ms");
    row(*comm, "all communication: share hidden %", busy > 0 ? 1 - waited / busy : 0, 100, "%");
    const auto plan = nlohmann::json::parse(s.spec.plan_json);
    const double c = plan.at("communication_s"), e = plan.at("exposed_communication_s");
    if (comm->rank() == 0)
      std::printf("  predicted (plan for %s): step %.1f ms, communication %.1f ms, the step waits %.1f ms, hidden %.0f%%\n",
                  plan.at("cluster").get<std::string>().c_str(), 1e3 * plan.at("predicted_step_s").get<double>(), 1e3 * c,
                  1e3 * e, c > 0 ? 100 * (1 - e / c) : 0.0);
  }
  return 0;
}
