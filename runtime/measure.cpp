// Measurements of this process and machine (see measure.h): resident memory
// from /proc, collectives timed and fitted to a line, a STREAM-like triad.
#include "runtime/measure.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <malloc.h>

#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

#include "runtime/error.h"
#include "runtime/scratch.h"

namespace halyard::runtime {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The elements of one call of `kind` at `bytes` per rank (see measure.h):
// f32 elements this rank sends, a multiple of P for the all-to-all.
int64_t elements_for(CollectiveKind kind, int64_t bytes, int ranks) {
  const int64_t n = bytes / static_cast<int64_t>(sizeof(float));
  return kind == CollectiveKind::AllToAll ? n / ranks * ranks : n;
}

// "model name" of /proc/cpuinfo (x86), else "Model name"/"CPU part" lines some
// ARM kernels write; "unknown" when there is none.
std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    key.erase(key.find_last_not_of(" \t") + 1);
    if (key == "model name" || key == "Model name") {
      std::string v = line.substr(colon + 1);
      v.erase(0, v.find_first_not_of(" \t"));
      return v;
    }
  }
  return "unknown";
}

}  // namespace

int64_t current_rss_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = -1;
  if (!(in >> size_pages >> resident_pages) || resident_pages < 0)
    throw Error("error: cannot read the resident pages from /proc/self/statm (current_rss_bytes).\n"
                "current_rss_bytes needs Linux's /proc; on other systems measure with the OS's own tools.");
  return resident_pages * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) {  // "VmHWM:     123456 kB"
      std::istringstream fields(line.substr(6));
      int64_t kib = 0;
      if (fields >> kib) return kib * 1024;
    }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // KiB on Linux
}

bool reset_peak_rss() {
  // Hand freed heap and scratch back first, so the new peak starts from what is live.
  malloc_trim(0);
  scratch::trim();
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.close();
  return static_cast<bool>(out);
}

const char* collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::AllToAll: return "all_to_all";
    case CollectiveKind::AllReduce: return "all_reduce";
    case CollectiveKind::AllGather: return "all_gather";
    case CollectiveKind::RingShift: return "ring_shift";
  }
  return "?";
}

// Least squares of the relative residuals (a + b x - t) / t, with a, b >= 0:
// the sizes span three decades, and a plain fit would spend itself on the
// largest (its error at 4 KiB, where the latency a is all there is, could be
// 100%). That is weights 1 / t². The objective is convex, so when the free
// minimum is infeasible the constrained one lies on an edge, a = 0 or b = 0:
// take the better of the two.
LinearFit fit_linear(const std::vector<double>& x, const std::vector<double>& t) {
  if (x.size() != t.size() || std::adjacent_find(x.begin(), x.end(), std::not_equal_to<>()) == x.end())
    throw Error("error: fit_linear given " + std::to_string(x.size()) + " sizes and " + std::to_string(t.size()) +
                " times; it needs one time per size and at least two different sizes to fit alpha + beta * size.");
  double s = 0, sx = 0, st = 0, sxx = 0, sxt = 0;
  std::vector<double> w;
  for (size_t i = 0; i < x.size(); ++i) {
    const double ti = std::max(t[i], 1e-9);  // a clock tick, not zero
    w.push_back(1 / (ti * ti));
    s += w[i], sx += w[i] * x[i], st += w[i] * t[i], sxx += w[i] * x[i] * x[i], sxt += w[i] * x[i] * t[i];
  }
  auto cost = [&](double a, double b) {
    double c = 0;
    for (size_t i = 0; i < x.size(); ++i) c += w[i] * (a + b * x[i] - t[i]) * (a + b * x[i] - t[i]);
    return c;
  };
  LinearFit f;
  // s * sxx > sx²: there are two distinct sizes.
  f.beta_s_per_byte = (s * sxt - sx * st) / (s * sxx - sx * sx);
  f.alpha_s = (st - f.beta_s_per_byte * sx) / s;
  if (f.alpha_s < 0 || f.beta_s_per_byte < 0) {
    const double b_only = std::max(0.0, sxt / sxx), a_only = std::max(0.0, st / s);
    if (cost(0, b_only) <= cost(a_only, 0)) f.alpha_s = 0, f.beta_s_per_byte = b_only;
    else f.alpha_s = a_only, f.beta_s_per_byte = 0;
  }
  f.rms_rel_error = std::sqrt(cost(f.alpha_s, f.beta_s_per_byte) / static_cast<double>(x.size()));
  return f;
}

LinearFit measure_collective(Communicator& comm, CollectiveKind kind, const std::vector<int64_t>& bytes_per_rank,
                             int reps) {
  const std::string what = std::string("measure_collective(") + collective_kind_name(kind) + ")";
  const int ranks = comm.size();
  if (reps < 1) throw Error("error: " + what + " with reps " + std::to_string(reps) + ".\nlegal: reps >= 1.");
  std::vector<int64_t> elements;
  for (int64_t b : bytes_per_rank) {
    if (b < 0) throw Error("error: " + what + " given a size of " + std::to_string(b) + " bytes.\nlegal: bytes >= 0.");
    elements.push_back(elements_for(kind, b, ranks));
  }
  if (std::adjacent_find(elements.begin(), elements.end(), std::not_equal_to<>()) == elements.end())
    throw Error("error: " + what + " needs at least two different sizes to fit alpha + beta * bytes; got " +
                std::to_string(bytes_per_rank.size()) + " size(s) of " +
                std::to_string(elements.empty() ? 0 : elements[0] * 4) + " bytes" +
                (kind == CollectiveKind::AllToAll ? " (after rounding to " + std::to_string(ranks) + " equal f32 blocks)"
                                                  : std::string(" (after rounding to whole f32 elements)")) +
                ".\nfix: pass sizes that differ, e.g. 4096, 65536, 1048576.");

  const int64_t most = *std::max_element(elements.begin(), elements.end());
  // Buffers for the largest size, touched now so that no page fault is timed.
  std::vector<float> send(static_cast<size_t>(most), 1.0f);
  std::vector<float> recv(static_cast<size_t>(kind == CollectiveKind::AllGather ? most * ranks : most), 0.0f);
  std::vector<int64_t> send_counts(static_cast<size_t>(ranks)), recv_counts(static_cast<size_t>(ranks));
  auto call = [&](int64_t n) {
    switch (kind) {
      case CollectiveKind::AllToAll:
        std::fill(send_counts.begin(), send_counts.end(), n / ranks);
        std::fill(recv_counts.begin(), recv_counts.end(), n / ranks);
        comm.all_to_all_v(send.data(), send_counts.data(), recv.data(), recv_counts.data());
        break;
      case CollectiveKind::AllReduce:
        // Reduce the same ones over and over: sums stay finite and exact.
        std::copy(send.begin(), send.begin() + n, recv.begin());
        comm.all_reduce_sum(recv.data(), n);
        break;
      case CollectiveKind::AllGather:
        comm.all_gather(send.data(), n, recv.data());
        break;
      case CollectiveKind::RingShift: {
        const int r = comm.rank(), next = (r + 1) % ranks, prev = (r + ranks - 1) % ranks;
        comm.start_exchange(send.data(), recv.data(), n, next, prev, 1)->wait();
        break;
      }
    }
  };

  // times[(size * reps + rep) * ranks + rank]: this rank fills its own slots;
  // one sum over ranks then gives every rank every time, exactly (x + 0 = x).
  const size_t sizes = elements.size(), per_rep = static_cast<size_t>(ranks);
  std::vector<double> times(sizes * static_cast<size_t>(reps) * per_rep, 0.0);
  for (size_t s = 0; s < sizes; ++s) {
    comm.barrier();
    call(elements[s]);  // warm-up: first-touch of the peers' buffers, lazy connections
    for (int r = 0; r < reps; ++r) {
      comm.barrier();
      const auto t0 = Clock::now();
      call(elements[s]);
      times[(s * static_cast<size_t>(reps) + static_cast<size_t>(r)) * per_rep + static_cast<size_t>(comm.rank())] =
          seconds_since(t0);
    }
  }
  comm.all_reduce_sum(times.data(), static_cast<int64_t>(times.size()));

  std::vector<double> x, t;
  for (size_t s = 0; s < sizes; ++s) {
    std::vector<double> slowest;
    for (int r = 0; r < reps; ++r) {
      const double* at = &times[(s * static_cast<size_t>(reps) + static_cast<size_t>(r)) * per_rep];
      slowest.push_back(*std::max_element(at, at + ranks));
    }
    x.push_back(static_cast<double>(elements[s]) * sizeof(float));
    t.push_back(median(slowest));
  }
  return fit_linear(x, t);
}

double measure_memory_bandwidth_bytes_per_s(int threads) {
  if (threads < 1)
    throw Error("error: measure_memory_bandwidth_bytes_per_s(" + std::to_string(threads) +
                ") needs at least one thread.\nlegal: threads >= 1 (e.g. the Halide threads of one rank).");
  constexpr int64_t kElements = (int64_t{64} << 20) / sizeof(double);  // 64 MiB per array
  constexpr int kRuns = 5;
  // Not std::vector: its constructor would touch every page from this thread,
  // and the pages should lie near the thread that streams them.
  std::unique_ptr<double[]> a(new double[kElements]), b(new double[kElements]), c(new double[kElements]);
  const double scalar = 3.0;
  std::barrier sync(threads);
  std::vector<double> run_s(kRuns, 0.0);
  auto work = [&](int id) {
    const int64_t begin = kElements * id / threads, end = kElements * (id + 1) / threads;
    for (int64_t i = begin; i < end; ++i) a[i] = 0.0, b[i] = 1.0, c[i] = 2.0;
    for (int run = 0; run < kRuns; ++run) {
      sync.arrive_and_wait();
      const auto t0 = Clock::now();
      double* __restrict out = a.get();
      const double* __restrict x = b.get();
      const double* __restrict y = c.get();
      for (int64_t i = begin; i < end; ++i) out[i] = x[i] + scalar * y[i];
      sync.arrive_and_wait();  // the run ends when the last thread does
      if (id == 0) run_s[static_cast<size_t>(run)] = seconds_since(t0);
    }
  };
  std::vector<std::thread> pool;
  for (int id = 1; id < threads; ++id) pool.emplace_back(work, id);
  work(0);
  for (auto& th : pool) th.join();
  // Read the result, so that no compiler drops the loop as dead stores.
  volatile double sink = a[kElements / 2];
  (void)sink;
  const double best = *std::min_element(run_s.begin(), run_s.end());
  return static_cast<double>(3 * kElements * sizeof(double)) / best;
}

nlohmann::json calibrate_machine(Communicator* comm, int threads) {
  const int64_t baseline = current_rss_bytes();  // before this function allocates anything
  nlohmann::json out;
  out["cpu"] = cpu_model();
  out["cores"] = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  out["threads_per_rank"] = threads;
  out["ranks"] = comm ? comm->size() : 1;

  // Every rank streams at once, as ranks sharing a node do in training; the
  // slowest rank's figure is what a plan can count on.
  if (comm) comm->barrier();
  double bandwidth = measure_memory_bandwidth_bytes_per_s(threads);
  if (comm && comm->size() > 1) {
    std::vector<double> all(static_cast<size_t>(comm->size()), 0.0);
    all[static_cast<size_t>(comm->rank())] = bandwidth;
    comm->all_reduce_sum(all.data(), static_cast<int64_t>(all.size()));
    bandwidth = *std::min_element(all.begin(), all.end());
  }
  out["memory_bandwidth_bytes_per_s"] = bandwidth;
  out["process_baseline_bytes"] = baseline;

  if (comm && comm->size() > 1) {
    std::vector<int64_t> sizes;
    for (int64_t b = 4 << 10; b <= 4 << 20; b *= 4) sizes.push_back(b);  // 4 KiB .. 4 MiB
    constexpr int kReps = 10;
    nlohmann::json collectives = nlohmann::json::object();
    for (CollectiveKind kind : kCollectiveKinds) {
      const LinearFit f = measure_collective(*comm, kind, sizes, kReps);
      collectives[collective_kind_name(kind)] = {
          {"alpha_s", f.alpha_s}, {"beta_s_per_byte", f.beta_s_per_byte}, {"rms_rel_error", f.rms_rel_error}};
    }
    out["collectives"] = collectives;
  }
  return out;
}

namespace {

// "model.layers.*.mlp.gate_proj op:contract" -> "mlp.gate_proj": the module a
// rule names, without the layer wildcard and the op (several ops of one module
// read as one). A module's sequence tiles, which AutoSP decides apart from its
// whole values ("... op:contract seq_tiles"), read "mlp.gate_proj tiles"; the
// rule for every tile, "sequence tiles".
std::string module_of(const std::string& match) {
  std::istringstream terms(match);
  std::string m, t;
  bool tiles = false;
  while (terms >> t) {
    if (t == "seq_tiles") tiles = true;
    else if (m.empty()) m = t;
  }
  if (m.empty()) return tiles ? "sequence tiles" : "*";
  const std::string layers = "model.layers.*.";
  if (m.rfind(layers, 0) == 0) m = m.substr(layers.size());
  return tiles ? m + " tiles" : m;
}

// Bytes as MiB with one decimal: "41.2".
std::string mib(double bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f", bytes / (1 << 20));
  return s;
}

std::string mib_text(double bytes) { return mib(bytes) + " MiB"; }

}  // namespace

std::string describe_plan(const nlohmann::ordered_json& plan) {
  auto number = [&](const char* key, const nlohmann::ordered_json& v) {
    if (!v.is_number())
      throw Error(std::string("error: the plan's \"") + key + "\" is " + v.dump() +
                  ", not a number.\nfix: the generator that wrote plan_json must write bytes and seconds as numbers.");
    return v.get<double>();
  };
  if (!plan.is_object()) return "";
  std::string memory, breakdown;
  if (plan.contains("memory_per_rank")) {
    const auto& parts = plan["memory_per_rank"];
    if (!parts.is_object())
      throw Error("error: the plan's \"memory_per_rank\" is " + parts.dump() +
                  ", not an object.\nfix: the generator must write it as {\"<name>\": bytes, ...}.");
    for (auto it = parts.begin(); it != parts.end(); ++it)
      breakdown += (breakdown.empty() ? "" : ", ") + it.key() + ": " + mib(number(it.key().c_str(), *it));
  }
  if (plan.contains("predicted_peak_bytes_per_rank")) {
    memory = "predicted peak " +
             mib(number("predicted_peak_bytes_per_rank", plan["predicted_peak_bytes_per_rank"])) + " MiB per rank";
    if (!breakdown.empty()) memory += " (" + breakdown + ")";
  } else if (!breakdown.empty()) {
    memory = "predicted memory per rank in MiB (" + breakdown + ")";
  }
  std::string step;
  if (plan.contains("predicted_step_s")) {
    char s[64];
    std::snprintf(s, sizeof s, "predicted step %.3g s", number("predicted_step_s", plan["predicted_step_s"]));
    step = s;
  }
  if (memory.empty() && step.empty()) return "";
  return "plan: " + memory + (memory.empty() || step.empty() ? "" : ", ") + step;
}

std::string describe_schedule(const nlohmann::ordered_json& plan) {
  if (!plan.is_object() || !plan.contains("schedule_spec") || !plan["schedule_spec"].is_object()) return "";
  const auto& spec = plan["schedule_spec"];
  std::string out = "schedule \"" + plan.value("schedule", std::string("?")) + "\": ";
  if (spec.contains("mesh") && spec["mesh"].is_object()) {
    const auto& m = spec["mesh"];
    out += "mesh dp=" + std::to_string(m.value("dp", 1)) + " x sp=" + std::to_string(m.value("sp", 1)) +
           ", ZeRO-" + std::to_string(m.value("zero", 0));
  }
  std::vector<std::string> strategies;
  if (spec.contains("attention") && spec["attention"].is_array())
    for (const auto& a : spec["attention"])
      if (a.is_object() && a.contains("strategy") && a["strategy"].is_string()) {
        std::string st = a["strategy"].get<std::string>();
        if (std::find(strategies.begin(), strategies.end(), st) == strategies.end()) strategies.push_back(st);
      }
  std::string attention;
  for (const auto& st : strategies) attention += (attention.empty() ? "" : "+") + st;
  out += "; attention " + (attention.empty() ? std::string("on one rank") : attention);
  // seq_tile tiles the loss too unless loss_seq_tile says otherwise (Schedule::loss_tile).
  auto tile = [&](const char* key) -> int64_t {
    return spec.contains(key) && spec[key].is_number_integer() ? spec[key].get<int64_t>() : 0;
  };
  const int64_t mlp = tile("seq_tile"), loss = tile("loss_seq_tile") > 0 ? tile("loss_seq_tile") : mlp;
  std::string tiles;
  if (mlp > 0 && mlp == loss) tiles = "mlp and loss " + std::to_string(mlp) + " tokens";
  else if (mlp > 0) tiles = "mlp " + std::to_string(mlp) + " tokens";
  if (loss > 0 && loss != mlp) tiles += (tiles.empty() ? "" : ", ") + std::string("loss ") + std::to_string(loss) + " tokens";
  out += "; sequence tiles: " + (tiles.empty() ? std::string("none") : tiles) + "\n";
  // Per match the last rule wins, as in the schedule itself; a module whose
  // matches (its ops) disagree is partly recomputed.
  std::vector<std::string> order;
  std::map<std::string, std::map<std::string, std::string>> keep;  // module -> match -> keep
  if (spec.contains("values") && spec["values"].is_array())
    for (const auto& v : spec["values"]) {
      if (!v.is_object() || !v.contains("keep") || !v.contains("match") || !v["match"].is_string()) continue;
      const std::string match = v["match"].get<std::string>(), m = module_of(match);
      if (m == "*" || m.rfind("op:", 0) == 0 || m.rfind("class:", 0) == 0) continue;
      if (!keep.count(m)) order.push_back(m);
      keep[m][match] = v["keep"].is_string() ? v["keep"].get<std::string>() : "";
    }
  // Where the modules' tiles are decided one by one, the rule for every
  // tile decides nothing they do not.
  const bool tile_groups = std::any_of(order.begin(), order.end(), [](const std::string& m) {
    return m.ends_with(" tiles") && m != "sequence tiles";
  });
  if (tile_groups) std::erase(order, std::string("sequence tiles"));
  std::string recomputed, partly, kept;
  for (const auto& m : order) {
    size_t r = 0;
    for (const auto& [match, k] : keep[m]) r += k == "recompute";
    std::string& list = r == keep[m].size() ? recomputed : r > 0 ? partly : kept;
    list += (list.empty() ? "" : ", ") + m;
  }
  if (!recomputed.empty()) out += "  recomputed in the backward: " + recomputed + "\n";
  if (!partly.empty()) out += "  partly recomputed: " + partly + "\n";
  if (!kept.empty()) out += "  kept from the forward: " + kept + "\n";
  if (plan.contains("autosp") && plan["autosp"].is_object()) {
    const auto& a = plan["autosp"];
    char head[160];
    std::snprintf(head, sizeof head, "  chosen by AutoSP for %lld ranks x %s (%d plans scored in %.1f s)",
                  static_cast<long long>(a.value("ranks", 0)), mib_text(a.value("memory_per_rank_bytes", 0.0)).c_str(),
                  a.value("plans_scored", 0), a.value("seconds", 0.0));
    out += head;
    if (a.contains("one_rank_peak_bytes") && a["one_rank_peak_bytes"].is_object()) {
      const auto& one = a["one_rank_peak_bytes"];
      out += "; one rank alone would need " + mib_text(one.value("default", 0.0)) + " saving everything, " +
             mib_text(one.value("checkpoint", 0.0)) + " with every layer checkpointed";
    }
    out += "\n";
    if (a.contains("rejected") && a["rejected"].is_array())
      for (const auto& r : a["rejected"])
        if (r.is_object())
          out += "  rejected: " + r.value("what", std::string()) + ": " + r.value("reason", std::string()) + "\n";
  }
  return out;
}

}  // namespace halyard::runtime
