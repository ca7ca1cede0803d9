// halyard-calibrate: measures this machine's CPU ranks and writes the
// machine profile (a cluster description, schedules/cluster.h) that plan()
// predicts with:
//
//   mpirun -np R halyard-calibrate --out profile.json [--steps 4] [--threads T]
//
// Run it on as many ranks per node as the training will use: the kernels'
// speed depends on how many ranks share the cores. For each linked library
// built for sp = R (halyard_add_llama_calibrate in CMakeLists.txt), every
// rank trains a few steps exactly as llama_train does (the same model,
// AdamW state and batches), timing every call of the step (HALYARD_PROFILE)
// and the whole step, and records its peak resident memory. Then it
//   - re-plans each library (plan() from the library's own plan summary),
//     pairs the measured calls with the plan's stages by root node
//     (pair_profile, schedules/calibration.h), and fits per stage
//     kind t = flops * s_per_flop + bytes * s_per_byte + s_per_call (least
//     squares with non-negative coefficients); a kind the libraries never
//     ran takes the fit of one doing the same work (kernel_kind_stand_in);
//   - takes the memory the plan does not model (the process, its libraries,
//     MPI, allocator slack) as the gap between the measured peak of the first
//     library (a fresh process, as a training run is) and the plan's total
//     without a baseline, the largest over ranks;
//   - measures memory bandwidth and the MPI collectives (runtime/measure.h);
//   - fits how far behind the other ranks are when one reaches a collective
//     (collective_lag_s) to what the steps took beyond their kernels and
//     the transfers and update the plan gives them.
// Rank 0 writes the profile and prints the fit of every kind.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dsl/error.h"
#include "examples/llama/linked_models.h"
#include "examples/llama/llama_builder.h"
#include "runtime/adamw.h"
#include "runtime/comm.h"
#include "runtime/data.h"
#include "runtime/error.h"
#include "runtime/lr_schedule.h"
#include "runtime/measure.h"
#include "runtime/model.h"
#include "schedules/calibration.h"
#include "schedules/plan.h"

using namespace halyard;

namespace {

struct Options {
  std::string out, data = HALYARD_SOURCE_DIR "/examples/llama/data/corpus.txt";
  int steps = 4, threads = 0;
  double timeout = 60;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf("usage: mpirun -np R halyard-calibrate --out PROFILE.json [--steps N (4)] [--threads T] [--data TEXT]\n");
      std::exit(0);
    }
    if (i + 1 >= argc) throw runtime::Error("error: " + k + " needs a value.");
    const std::string v = argv[++i];
    try {
      size_t used = 0;
      if (k == "--out") o.out = v;
      else if (k == "--steps") o.steps = std::stoi(v, &used);
      else if (k == "--threads") o.threads = std::stoi(v, &used);
      else if (k == "--data") o.data = v;
      else throw runtime::Error("error: unknown option \"" + k + "\".\nlegal: --out --steps --threads --data --help");
      if (used != 0 && used != v.size()) throw std::invalid_argument(v);
    } catch (const std::logic_error&) {
      throw runtime::Error("error: " + k + " \"" + v + "\" is not a whole number.");
    }
  }
  if (o.out.empty()) throw runtime::Error("error: --out PROFILE.json is required.");
  if (o.steps < 2) throw runtime::Error("error: --steps " + std::to_string(o.steps) + "\nlegal: 2 or more (the first step warms up).");
  return o;
}

struct Measured {
  const runtime::ModelSpec* spec;
  std::vector<std::string> profiles;  // Model::profile() of each profiled step
  double step_s = 0;                  // median over the profiled steps
  int64_t peak_rss = 0;
};

// Trains `spec` as llama_train does and times every call.
Measured measure(const runtime::ModelSpec& spec, runtime::Communicator* comm, const Options& o) {
  runtime::reset_peak_rss();  // this library's peak, not the one measured before it
  runtime::Model m(spec, comm, comm);
  m.init_params(0);
  std::vector<int64_t> sizes;
  const std::vector<bool> decay = m.decay_flags();
  std::vector<float*> params;
  std::vector<const float*> grads;
  for (int i = 0; i < m.num_params(); ++i) {
    sizes.push_back(m.param_spec(i).numel);
    params.push_back(m.param(i));
    grads.push_back(m.grad(i));
  }
  runtime::AdamW opt(sizes, decay);
  const int rank = comm ? comm->rank() : 0;
  const runtime::Batcher batcher(runtime::TokenFile::from_text(o.data),
                                 spec.batch, spec.seq, spec.vocab, 0, runtime::Shard{rank, spec.sp, 0, 1, runtime::zigzag_layout(spec)});
  const int64_t n = batcher.local_tokens();
  std::vector<int32_t> ids(static_cast<size_t>(n)), labels(ids.size()), pos(ids.size());
  Measured r{&spec, {}, 0, 0};
  std::vector<double> steps;
  for (int step = 1; step <= o.steps; ++step) {
    batcher.fill(step, ids.data(), labels.data(), pos.data());
    if (comm) comm->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    m.train_step(ids.data(), labels.data(), pos.data());
    opt.step(step, 1e-3, params.data(), grads.data(), 1.0);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (step == 1) continue;  // warm-up: first touches, thread pool start
    steps.push_back(secs);
    r.profiles.push_back(m.profile());
  }
  std::sort(steps.begin(), steps.end());
  r.step_s = steps[steps.size() / 2];
  r.peak_rss = runtime::peak_rss_bytes();
  return r;
}

int run(const Options& o) {
  std::unique_ptr<runtime::Communicator> comm;
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) comm = runtime::make_mpi_communicator(o.timeout);
  const int ranks = comm ? comm->size() : 1, rank = comm ? comm->rank() : 0;
  runtime::Communicator* sp_comm = ranks > 1 ? comm.get() : nullptr;
  const int threads = o.threads > 0 ? o.threads : runtime::default_threads_per_rank();
  runtime::Model::set_num_threads(threads);
  setenv("HALYARD_PROFILE", "1", 1);

  // Train first, before anything else grows the process.
  std::vector<Measured> runs;
  for (int i = 0; i < halyard_linked_model_count; ++i)
    if (halyard_linked_models[i]->sp == ranks) runs.push_back(measure(*halyard_linked_models[i], sp_comm, o));
  if (runs.empty())
    throw runtime::Error("error: halyard-calibrate links no library for sp = " + std::to_string(ranks) +
                         " ranks.\nfix: launch it on as many ranks as one of its libraries splits the sequence over.");

  // Pair the calls with the plan's stages by root node (pair_profile); one
  // sample per stage, its mean over the steps: a step takes the sum of its
  // calls' times, slow ones included. Where ranks share cores (4 ranks on
  // 2), a call the scheduler interrupts takes several times its usual
  // time, and the median left those out: the 4-rank contractions were fitted
  // at 77 GFLOP/s against 62 with the mean, and 4-rank steps predicted 9-23%
  // fast (scripts/plan_accuracy.sh).
  std::map<std::string, std::vector<KernelSample>> samples;
  int64_t baseline = 0;
  // Per library: its schedule and request, and its measured step less the
  // kernels' measured times (for collective_lag_s, below).
  struct Beside {
    Schedule schedule;
    ModelRequest request;
    double step_less_kernels_s;
  };
  std::vector<Beside> besides;
  // The ranks and threads that ran, so that the memory the plan models (a
  // thread's scratch stack each) is the memory these processes held.
  Cluster ran = Cluster::named("local-cpu");
  ran.ranks = ran.ranks_per_node = ranks;
  ran.cores_per_node = static_cast<int64_t>(threads) * ranks;
  std::ostringstream report;
  for (const Measured& r : runs) {
    const nlohmann::json summary = nlohmann::json::parse(r.spec->plan_json);
    const Schedule s = Schedule::parse(summary.at("schedule_spec").dump(), r.spec->name);
    const Plan p = plan(llama::llama_builder(), {summary.at("config").get<std::string>(), r.spec->batch, r.spec->seq}, s,
                        ran);
    const std::string plan_json = p.to_json();
    std::vector<std::map<std::string, std::vector<KernelSample>>> steps;
    for (const std::string& profile : r.profiles) {
      try {
        steps.push_back(pair_profile(plan_json, profile, std::string("library \"") + r.spec->name + "\""));
      } catch (const halyard::UserError& e) {
        const std::string why = e.what();
        throw runtime::Error(why.substr(0, why.find('\n')) +
                             "\nfix: the library is not the one this build plans; rebuild halyard-calibrate.");
      }
    }
    std::map<std::string, size_t> seen;  // per kind: its stages so far, in the plan's order
    double kernels_s = 0;
    for (const StageCost& st : p.stages) {
      const size_t i = seen[st.kind]++;
      std::vector<double> t;
      double held = 0;
      for (const auto& step : steps) {
        t.push_back(step.at(st.kind)[i].t);
        held = std::max(held, step.at(st.kind)[i].scratch);
      }
      const double mean = std::accumulate(t.begin(), t.end(), 0.0) / static_cast<double>(t.size());
      samples[st.kind].push_back({st.charged_flops, static_cast<double>(st.bytes), mean, held});
      kernels_s += mean;
      if (std::getenv("HALYARD_CALIBRATE_VERBOSE") && rank == 0)
        std::printf("  %-10s %-44s %8.3f ms  %12.0f flops %10lld bytes  scratch %10lld est %10.0f held\n", st.kind.c_str(),
                    st.label.substr(0, 44).c_str(), mean * 1e3, st.flops, static_cast<long long>(st.bytes),
                    static_cast<long long>(st.scratch_estimate), held);
    }
    besides.push_back({s, p.request, r.step_s - kernels_s});
    const int64_t modeled = p.memory.total() - p.memory.runtime_baseline;
    int64_t gap = r.peak_rss - modeled;
    if (comm) {  // the largest gap of any rank
      std::vector<float> all(static_cast<size_t>(ranks));
      float mine = static_cast<float>(gap);
      comm->all_gather(&mine, 1, all.data());
      gap = static_cast<int64_t>(*std::max_element(all.begin(), all.end()));
    }
    // The first library runs in a fresh process, as a training run does; the
    // later ones find what the earlier left behind (allocator arenas, pages).
    if (&r == &runs.front()) baseline = gap;
    char line[256];
    std::snprintf(line, sizeof line, "  %s: step %.4f s (median of %zu), peak %.1f MiB of which the plan models %.1f MiB\n",
                  r.spec->name, r.step_s, r.profiles.size(), static_cast<double>(r.peak_rss) / (1 << 20),
                  static_cast<double>(modeled) / (1 << 20));
    report << line;
  }

  nlohmann::json machine = runtime::calibrate_machine(comm.get(), threads);
  Cluster c;
  c.name = "local-cpu x" + std::to_string(ranks);
  c.source = "calibrated by halyard-calibrate on " + machine.value("cpu", std::string("?")) + ", " +
             std::to_string(ranks) + " rank(s) x " + std::to_string(threads) + " thread(s)";
  c.ranks = c.ranks_per_node = ranks;
  c.cores_per_node = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  c.memory_bandwidth_bytes_per_s = machine.value("memory_bandwidth_bytes_per_s", 0.0);
  c.process_baseline_bytes = baseline;
  if (machine.contains("collectives"))
    for (auto it = machine["collectives"].begin(); it != machine["collectives"].end(); ++it)
      c.collectives[it.key()] = {it->value("alpha_s", 0.0), it->value("beta_s_per_byte", 0.0)};
  for (const auto& [kind, kind_samples] : samples) {
    double err = 0;
    c.kernels[kind] = fit_kernel(kind_samples, &err);
    char line[256];
    std::snprintf(line, sizeof line, "  %-10s %4zu calls: %.3g s/flop (%.2f GFLOP/s), %.3g s/byte (%.2f GB/s), %.1f us/call; rms error %.1f%%\n",
                  kind.c_str(), kind_samples.size(), c.kernels[kind].s_per_flop,
                  c.kernels[kind].s_per_flop > 0 ? 1e-9 / c.kernels[kind].s_per_flop : 0.0, c.kernels[kind].s_per_byte,
                  c.kernels[kind].s_per_byte > 0 ? 1e-9 / c.kernels[kind].s_per_byte : 0.0, c.kernels[kind].s_per_call * 1e6,
                  100 * err);
    report << line;
  }
  // How far behind the other ranks were at a collective (collective_lag_s),
  // from each library's steps beyond its kernels' measured times, on each
  // rank: where ranks share cores, the others are often still computing
  // when one reaches a collective. Unfitted on one rank (no collectives).
  {
    std::vector<StepBeyondKernels> steps;
    int waits = 0;
    for (const Beside& b : besides) {
      const Plan p = plan(llama::llama_builder(), b.request, b.schedule, c);
      double measured = b.step_less_kernels_s;
      if (comm) measured = comm->all_reduce_sum(measured) / ranks;  // the mean over the ranks
      steps.push_back({measured, p.step_s - p.compute_s, p.collective_lags});
      waits += p.collective_waits;
    }
    c.collective_lag_s = fit_collective_lag(steps);
    if (waits > 0) {
      char line[160];
      std::snprintf(line, sizeof line, "  ranks behind at a collective: up to %.2f ms (fitted over %d collectives waited on)\n",
                    c.collective_lag_s * 1e3, waits);
      report << line;
    }
  }
  // Kinds these libraries never ran: a kind doing the same work per FLOP
  // stands in, else their bytes at the memory's bandwidth.
  for (const std::string& kind : kernel_kinds()) {
    if (samples.count(kind)) continue;
    const std::string like = kernel_kind_stand_in(kind);
    if (samples.count(like)) {
      c.kernels[kind] = c.kernels.at(like);
      report << "  " << kind << ": no calls in these libraries; " << like << "'s fit stands in\n";
    } else {
      c.kernels[kind] = {0, c.memory_bandwidth_bytes_per_s > 0 ? 1 / c.memory_bandwidth_bytes_per_s : 0, 0};
      report << "  " << kind << ": no calls in these libraries; its bytes at the memory's bandwidth\n";
    }
  }
  if (rank == 0) {
    std::ofstream out(o.out);
    out << c.to_json() << "\n";
    if (!out) throw runtime::Error("error: cannot write the profile to \"" + o.out + "\".");
    std::printf("halyard-calibrate: %s\n%sprocess baseline %.1f MiB; wrote %s\n", c.source.c_str(), report.str().c_str(),
                static_cast<double>(baseline) / (1 << 20), o.out.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
}
