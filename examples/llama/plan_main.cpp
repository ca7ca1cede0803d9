// halyard-plan: the questions asked before renting a cluster, answered by
// the AutoSP search (schedules/autosp.h) without compiling anything.
//
//   halyard-plan --model llama-3.1-8b --cluster 8xA100-80GB --seq max
//   halyard-plan --config path/to/config.json --cluster profile.json --ranks 4 --memory-per-rank 2GiB --seq 32768
//
// It prints the chosen plan (stages by layer, collectives, memory per rank,
// predicted step and tokens/s), the runners-up and the rejected choices with
// their reasons, and a table of the longest trainable sequence of the
// families a user would otherwise pick, on the same model and cluster.
// --json FILE writes all of it, --trace FILE the predicted step as a
// Chrome/Perfetto trace, --plot FILE.png peak memory per rank against
// sequence length per family, --schedule-out FILE the chosen schedule.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <unistd.h>
#include <vector>

#include "dsl/error.h"
#include "examples/llama/llama_builder.h"
#include "examples/llama/plot_png.h"
#include "schedules/autosp.h"

using namespace halyard;
namespace fs = std::filesystem;

namespace {

const char* const kUsage = R"(usage: halyard-plan (--model NAME | --config config.json) [options]

  --model NAME            a model preset: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, llama-2-13b,
                          llama-3.1-70b, tiny (Hugging Face names like meta-llama/Llama-3.1-8B work too)
  --config FILE           a Hugging Face config.json instead
  --cluster NAME|FILE     a cluster preset (8xA100-80GB, 8xH100-80GB, 8xH200, 64xH100-80GB, local-cpu)
                          or a profile written by halyard-calibrate (default 8xA100-80GB)
  --ranks N               ranks to plan for (default: the cluster's)
  --memory-per-rank SIZE  bytes per rank, e.g. 80GiB, 512MiB (default: the cluster's)
  --seq N|max             tokens per row, or the longest that fits (default max)
  --batch N               rows per data-parallel replica (default 1)
  --seq-step N            granularity of --seq max (default 1024, or 8 tokens per rank when smaller, at
                          least 256)
  --precision P           f32 (what Halyard's CPU libraries run) or bf16-mixed (bf16 values, f32 master
                          weights and moments; planned only); default: bf16-mixed on clusters with bf16
                          peak FLOP/s (the GPU presets), else f32
  --bf16 LIST             what the search may hold or compute in bf16: store (saved values' copies for
                          the backward), contract (contractions' operands; clusters with a bf16 peak),
                          reduce (the gradients' sum over the ranks), or none (default); the plan's
                          precision is then f32, and f32 stays a candidate
  --zero LIST             ZeRO stages to consider, e.g. 1 (what llama_train runs) or 1,3 (default; 3 is
                          planned only)
  --strategies LIST       head redistributions to consider where the sequence is split: ulysses, ring
                          (contiguous and zigzag), hybrid (default: all)
  --families LIST         families for the comparison table (default
                          dp_zero3,ulysses,ulysses_checkpoint,ulysses_sac,ulysses_offload,autosp; also:
                          default, none)
  --json FILE             the whole result as JSON
  --trace FILE            the chosen plan's predicted step, Chrome/Perfetto trace format
  --plot FILE.png         predicted peak memory per rank against sequence length, per family
  --schedule-out FILE     the chosen schedule as JSON (pin it: SCHEDULE FILE in halyard_add_model)
  --help                  this text
)";

[[noreturn]] void usage_error(const std::string& msg) {
  throw UserError("error: " + msg + "\n" + kUsage);
}

int64_t count(const std::string& flag, const std::string& v) {
  try {
    return parse_count(flag, v);
  } catch (const UserError& e) {
    usage_error(std::string(e.what()).substr(7));
  }
}

// "80GiB", "512MiB", "1.5TiB", "80GB" (decimal), or plain bytes.
int64_t parse_size(const std::string& flag, const std::string& v) {
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = v.substr(used);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::vector<std::pair<std::string, double>> units = {
      {"", 1},       {"b", 1},       {"kib", 1024.0},  {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0},
      {"kb", 1e3},   {"mb", 1e6},    {"gb", 1e9},      {"tb", 1e12},       {"k", 1024.0},         {"m", 1048576.0},
      {"g", 1073741824.0}, {"t", 1099511627776.0}};
  auto it = std::find_if(units.begin(), units.end(), [&](const auto& u) { return u.first == unit; });
  if (used == 0 || it == units.end() || !(x > 0) || !std::isfinite(x))
    usage_error(flag + " \"" + v + "\" is not a size.\nlegal: bytes, or a number with KiB, MiB, GiB, TiB (or kB, MB, GB, TB).");
  return static_cast<int64_t>(x * it->second);
}

fs::path self_dir() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path(".") : p.parent_path();
}

// A preset's config: next to the installed tool, or in the source tree.
std::string model_config(std::string name) {
  const size_t slash = name.rfind('/');
  if (slash != std::string::npos) name = name.substr(slash + 1);
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (name.size() > 5 && name.substr(name.size() - 5) == ".json") name.resize(name.size() - 5);
  std::vector<fs::path> dirs;
  if (const char* d = std::getenv("HALYARD_CONFIG_DIR")) dirs.push_back(d);
  dirs.push_back(self_dir() / "../share/halyard/configs");
  dirs.push_back(HALYARD_SOURCE_DIR "/examples/llama/configs");
  std::vector<std::string> known;
  for (const fs::path& d : dirs) {
    if (fs::exists(d / (name + ".json"))) return (d / (name + ".json")).string();
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(d, ec))
      if (e.path().extension() == ".json") known.push_back(e.path().stem().string());
  }
  std::sort(known.begin(), known.end());
  known.erase(std::unique(known.begin(), known.end()), known.end());
  std::string list;
  for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
  usage_error("no model preset \"" + name + "\".\nlegal: " + list + ", or --config path/to/config.json.");
}

std::string mib(int64_t b) {
  char s[32];
  if (b >= (int64_t{1} << 30)) std::snprintf(s, sizeof s, "%.2f GiB", static_cast<double>(b) / (1 << 30));
  else std::snprintf(s, sizeof s, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return s;
}

std::string tokens(int64_t n) {
  char s[32];
  if (n >= 1048576) std::snprintf(s, sizeof s, "%.2fM", static_cast<double>(n) / 1048576);
  else if (n >= 1024) std::snprintf(s, sizeof s, "%.1fK", static_cast<double>(n) / 1024);
  else std::snprintf(s, sizeof s, "%lld", static_cast<long long>(n));
  return s;
}

// How the recompute search ended.
std::string search_note(const RematResult& r) {
  if (r.offloaded) return "no decision to save or recompute fits; the checkpoints offloaded do";
  std::string note = r.exhaustive_bound ? "optimal (branch and bound completed)"
                                        : "best found, within " +
                                              std::to_string(static_cast<int>(std::ceil(100 * (r.recompute_step_s / r.lower_bound_s - 1)))) +
                                              "% of the proven bound";
  if (std::count(r.offload.begin(), r.offload.end(), true) > 0) note += "; then offloading instead of recomputing made it faster";
  return note;
}

// What a schedule decided, in a few words.
std::string summary(const Schedule& s, const RematResult* r) {
  std::string out = "dp=" + std::to_string(s.mesh.dp) + " sp=" + std::to_string(s.mesh.sp);
  if (!s.attention.empty()) out += " " + s.attention.front().strategy;
  if (s.sequence_layout != "contiguous") out += " " + s.sequence_layout;
  out += " zero-" + std::to_string(s.mesh.zero);
  out += " tiles " + (s.seq_tile ? std::to_string(s.seq_tile) : std::string("-")) + "/" +
         (s.loss_tile() ? std::to_string(s.loss_tile()) : std::string("-"));
  if (s.stores_bf16()) out += " saved-bf16";
  if (s.contract_precision != "f32") out += " matmul-" + s.contract_precision;
  if (s.grad_reduce_precision != "f32") out += " grads-" + s.grad_reduce_precision;
  if (r && !r->groups.empty()) {
    int n = 0;
    for (bool b : r->recompute) n += b;
    out += ", " + std::to_string(n) + " of " + std::to_string(r->groups.size()) + " value groups recomputed";
    const auto off = static_cast<int>(std::count(r->offload.begin(), r->offload.end(), true));
    if (off > 0) out += " (" + std::to_string(off) + " of them offloaded to the host instead)";
    // Whether tiles were kept decides what tiling saves: say it.
    int tiles = 0, kept = 0;
    for (size_t i = 0; i < r->groups.size(); ++i)
      if (r->groups[i].tile) ++tiles, kept += !r->recompute[i];
    if (tiles > 0)
      out += "; tiles " + (kept == tiles ? std::string("kept")
                           : kept == 0   ? std::string("recomputed")
                                         : std::to_string(kept) + " of " + std::to_string(tiles) + " groups kept");
  }
  if (r && r->offloaded) out += ", every layer checkpointed and its input offloaded to the host";
  return out;
}

// The predicted step as plan() lays it out: the kernels on one track, the
// collectives on another, each from its predicted start (a collective
// finished at a later Wait runs under the kernels up to there), then the
// update.
nlohmann::json trace_of(const Plan& p) {
  nlohmann::json t = nlohmann::json::array();
  t.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", 1}, {"args", {{"name", "compute"}}}});
  t.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", 2}, {"args", {{"name", "communication"}}}});
  auto event = [&](const std::string& name, const std::string& cat, int tid, double start, double dur, nlohmann::json args) {
    t.push_back({{"name", name}, {"cat", cat}, {"ph", "X"}, {"pid", 0}, {"tid", tid}, {"ts", start * 1e6},
                 {"dur", dur * 1e6}, {"args", std::move(args)}});
  };
  for (const StageCost& s : p.stages)
    event(s.label, s.kind, 1, s.start_s, s.time_s,
          {{"flops", s.flops}, {"bytes", s.bytes}, {"layer", s.layer}, {"backward", s.backward}});
  for (const CollectiveCost& c : p.collectives)
    event(c.op + " over " + c.axis, c.kind, 2, c.start_s, c.time_s, {{"bytes_per_rank", c.bytes_per_rank}, {"degree", c.degree}});
  event("AdamW update", "optimizer", 1, p.step_s - p.optimizer_s - p.offload_s, p.optimizer_s, nlohmann::json::object());
  return {{"traceEvents", t}, {"displayTimeUnit", "ms"}};
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) throw UserError("error: cannot write \"" + path + "\".\nlegal: a path in a writable directory.");
}

int run(int argc, char** argv) {
  std::string model, config, cluster_name = "8xA100-80GB", seq_arg = "max", json_path, trace_path, plot_path, schedule_out;
  std::string family_list = "dp_zero3,ulysses,ulysses_checkpoint,ulysses_sac,ulysses_offload,autosp";
  int64_t ranks = 0, memory = 0, batch = 1, seq_step = 0;
  std::string precision, zero_list = "1,3", bf16_list = "none", strategy_list;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (i + 1 >= argc) usage_error(k.rfind("--", 0) == 0 ? k + " needs a value." : "unknown argument \"" + k + "\".");
    const std::string v = argv[++i];
    if (k == "--model") model = v;
    else if (k == "--config") config = v;
    else if (k == "--cluster") cluster_name = v;
    else if (k == "--ranks") ranks = count(k, v);
    else if (k == "--memory-per-rank") memory = parse_size(k, v);
    else if (k == "--seq") seq_arg = v == "max" ? v : std::to_string(count(k, v));
    else if (k == "--batch") batch = count(k, v);
    else if (k == "--families") family_list = v;
    else if (k == "--precision") precision = v;
    else if (k == "--zero") zero_list = v;
    else if (k == "--bf16") bf16_list = v;
    else if (k == "--strategies") strategy_list = v;
    else if (k == "--seq-step") seq_step = count(k, v);
    else if (k == "--json") json_path = v;
    else if (k == "--trace") trace_path = v;
    else if (k == "--plot") plot_path = v;
    else if (k == "--schedule-out") schedule_out = v;
    else usage_error("unknown argument \"" + k + "\".");
  }
  if (model.empty() == config.empty()) usage_error("give one of --model NAME and --config FILE.");
  if (!model.empty()) config = model_config(model);
  if (!fs::exists(config)) usage_error("config \"" + config + "\" does not exist.");
  std::vector<std::string> fams;
  if (family_list != "none") {
    std::string f;
    for (std::istringstream is(family_list); std::getline(is, f, ',');) {
      try {
        fams.push_back(family_named(f).name);
      } catch (const UserError& e) {
        usage_error("--families: " + std::string(e.what()).substr(7));
      }
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  Cluster cluster = Cluster::named(cluster_name);
  if (ranks == 0) ranks = cluster.ranks;
  if (memory == 0) memory = cluster.memory_per_rank_bytes;
  if (memory <= 0) usage_error("cluster \"" + cluster.name + "\" does not state the memory per rank: give --memory-per-rank.");
  cluster.ranks = std::max(cluster.ranks, ranks);
  const ModelBuilder build = llama::llama_builder();
  SearchOptions opts;
  opts.ranks = ranks;
  opts.memory_per_rank = memory;
  opts.max_seq = seq_arg == "max";
  opts.seq_step = seq_step;
  opts.zero.clear();
  for (const std::string& z : {std::string("0"), std::string("1"), std::string("3")})
    if (("," + zero_list + ",").find("," + z + ",") != std::string::npos) opts.zero.push_back(std::stoi(z));
  if (opts.zero.empty() || zero_list.find_first_not_of("013,") != std::string::npos)
    usage_error("--zero \"" + zero_list + "\".\nlegal: a comma-separated list of 0, 1 and 3.");
  try {
    opts.strategies = parse_strategies(strategy_list);
  } catch (const UserError& e) {
    usage_error("--strategies: " + std::string(e.what()).substr(7));
  }
  try {
    opts.bf16 = parse_bf16_choices(bf16_list);
  } catch (const UserError& e) {
    usage_error("--bf16: " + std::string(e.what()).substr(7));
  }
  // bf16 choices are what the libraries run: the plan counts values in f32 but where a choice says bf16.
  if (precision.empty()) precision = cluster.peak_flops.count("bf16") && opts.bf16.empty() ? "bf16-mixed" : "f32";
  ModelRequest req{config, batch, opts.max_seq ? 0 : std::stoll(seq_arg), precision};

  std::printf("halyard-plan: %s on %s: %lld ranks (%lld per node), %s per rank, %s\n", config.c_str(), cluster.name.c_str(),
              static_cast<long long>(ranks), static_cast<long long>(cluster.ranks_per_node), mib(memory).c_str(),
              precision.c_str());
  std::printf("cluster coefficients: %s\n\n", cluster.source.c_str());
  const SearchResult r = autosp(build, req, cluster, opts);
  nlohmann::json out = {{"config", config},          {"cluster", nlohmann::json::parse(cluster.to_json())},
                        {"ranks", ranks},            {"memory_per_rank_bytes", memory}, {"precision", precision},
                        {"seq", opts.max_seq ? nlohmann::json("max") : nlohmann::json(req.seq)}};
  nlohmann::json rejected = nlohmann::json::array();
  for (const Rejection& x : r.rejected) rejected.push_back({{"what", x.what}, {"reason", x.reason}});
  out["autosp"] = {{"feasible", r.feasible}, {"seq", r.seq}, {"plans", r.plans}, {"seconds", r.seconds}, {"rejected", rejected}};
  if (!r.feasible) {
    std::printf("autosp: no plan fits: %s\n", r.infeasible.c_str());
    out["autosp"]["infeasible"] = r.infeasible;
  } else {
    req.seq = r.seq;
    const Plan best = plan(build, req, r.best().schedule, cluster);
    std::printf("autosp chose, at seq %lld (%s):\n  %s\n\n%s\n", static_cast<long long>(r.seq),
                opts.max_seq ? "the longest that fits" : "as asked", summary(r.best().schedule, &r.remat).c_str(),
                best.report().c_str());
    std::printf("predicted: %.4f s per step, %.0f tokens/s over the mesh, %s sent per rank per step; recompute search: %s\n\n",
                best.step_s, r.best().tokens_per_s, mib(best.collective_bytes_per_rank()).c_str(),
                search_note(r.remat).c_str());
    std::printf("  %-4s %-62s %12s %10s %12s\n", "rank", "plan", "peak/rank", "step s", "tokens/s");
    for (size_t i = 0; i < r.ranked.size(); ++i)
      std::printf("  %-4zu %-62s %12s %10.4f %12.0f\n", i + 1, summary(r.ranked[i].schedule, nullptr).c_str(),
                  mib(r.ranked[i].peak_bytes).c_str(), r.ranked[i].step_s, r.ranked[i].tokens_per_s);
    if (!r.rejected.empty()) std::printf("\n  rejected:\n");
    for (const Rejection& x : r.rejected) std::printf("    %s: %s\n", x.what.c_str(), x.reason.c_str());
    std::printf("\n(%d plans scored in %.1f s)\n\n", r.plans, r.seconds);
    nlohmann::json ranked = nlohmann::json::array();
    for (const Candidate& c : r.ranked)
      ranked.push_back({{"schedule", nlohmann::json::parse(c.schedule.to_json())}, {"peak_bytes_per_rank", c.peak_bytes},
                        {"step_s", c.step_s}, {"tokens_per_s", c.tokens_per_s}});
    out["autosp"]["ranked"] = ranked;
    out["autosp"]["plan"] = nlohmann::json::parse(best.to_json());
    out["autosp"]["recompute_search"] = {{"optimal", r.remat.exhaustive_bound}, {"offloaded", r.remat.offloaded},
                                         {"groups_offloaded", std::count(r.remat.offload.begin(), r.remat.offload.end(), true)},
                                         {"lower_bound_s", r.remat.lower_bound_s},
                                         {"plans", r.remat.plans}};
    if (!schedule_out.empty()) write_file(schedule_out, r.best().schedule.to_json() + "\n");
    if (!trace_path.empty()) write_file(trace_path, trace_of(best).dump() + "\n");
  }

  // The families, each at its longest sequence.
  std::vector<FamilyResult> table;
  for (const std::string& f : fams) {
    if (f == "autosp" && r.feasible && opts.max_seq) {  // already searched
      FamilyResult a;
      a.family = f, a.schedule = r.best().schedule, a.longest = r.seq, a.peak_bytes = r.best().peak_bytes;
      a.step_s = r.best().step_s, a.tokens_per_s = r.best().tokens_per_s;
      table.push_back(a);
      continue;
    }
    table.push_back(family_longest(f, build, {config, batch, 0, precision}, cluster, ranks, memory, opts));
  }
  if (!table.empty()) {
    int64_t ours = 0;
    for (const FamilyResult& f : table)
      if (f.family == "autosp") ours = f.longest;
    std::printf("longest trainable sequence, %lld ranks with %s each (predicted):\n", static_cast<long long>(ranks), mib(memory).c_str());
    // The plan column is as wide as its widest entry: bf16 marks lengthen a summary.
    int plan_width = 42;
    for (const FamilyResult& f : table)
      if (f.applies) plan_width = std::max(plan_width, static_cast<int>(summary(f.schedule, nullptr).size()));
    std::printf("  %-30s %-*s %9s %11s %10s %10s %9s\n", "family", plan_width, "plan", "longest", "peak/rank", "step s",
                "tokens/s", "autosp is");
    nlohmann::json ft = nlohmann::json::array();
    for (const FamilyResult& f : table) {
      if (!f.applies) {
        std::printf("  %-30s %s\n", family_named(f.family).title.c_str(), f.reason.c_str());
      } else {
        char ratio[32] = "";
        if (ours > 0 && f.family != "autosp") std::snprintf(ratio, sizeof ratio, "%.2fx", static_cast<double>(ours) / static_cast<double>(f.longest));
        std::printf("  %-30s %-*s %9s %11s %10.3f %10.0f %9s\n", family_named(f.family).title.c_str(), plan_width,
                    summary(f.schedule, nullptr).c_str(), tokens(f.longest).c_str(), mib(f.peak_bytes).c_str(),
                    f.step_s, f.tokens_per_s, ratio);
      }
      ft.push_back({{"family", f.family}, {"title", family_named(f.family).title}, {"applies", f.applies}, {"reason", f.reason},
                    {"longest_seq", f.longest}, {"peak_bytes_per_rank", f.peak_bytes}, {"step_s", f.step_s},
                    {"tokens_per_s", f.tokens_per_s}, {"modelled_only", f.modelled},
                    {"schedule", f.applies ? nlohmann::json::parse(f.schedule.to_json()) : nlohmann::json()}});
    }
    out["families"] = ft;
    std::printf("\n");
  }

  if (!plot_path.empty()) {
    PlotSpec spec;
    spec.title = "predicted peak memory per rank, " + fs::path(config).stem().string() + " on " + std::to_string(ranks) + " ranks";
    spec.x_label = "sequence length (tokens)";
    spec.y_label = "GiB per rank";
    spec.log_x = true;
    spec.hline = static_cast<double>(memory) / (1 << 30);
    spec.hline_label = "memory per rank";
    int64_t top = 0;
    for (const FamilyResult& f : table) top = std::max(top, f.longest);
    top = std::max<int64_t>(top * 2, 8192);
    for (const FamilyResult& f : table) {
      if (!f.applies) continue;
      PlotSeries line{family_named(f.family).title, {}, {}};
      // autosp's line: the least-memory plan of its chosen mesh (what bounds its length).
      Schedule s = f.schedule;
      if (f.family == "autosp") {
        s.values = layer_checkpoint_rules();
        s.values.push_back(recompute_seq_tiles_rule());
      }
      for (int64_t seq = 1024; seq <= top; seq *= 2) {
        try {
          Schedule x = s;
          if (f.family == "autosp") x.seq_tile = std::max<int64_t>(64, seq / s.mesh.sp / 16 / 8 * 8), x.loss_seq_tile = 0;
          const Plan p = plan(build, {config, batch, seq, precision}, x, cluster);
          const double peak = static_cast<double>(p.memory.total()) / (1 << 30);
          line.x.push_back(static_cast<double>(seq)), line.y.push_back(peak);
          if (peak > 3 * spec.hline) break;
        } catch (const UserError&) {
        }
      }
      spec.series.push_back(line);
    }
    write_line_plot_png(plot_path, spec);
    std::printf("plot: %s\n", plot_path.c_str());
  }
  out["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!json_path.empty()) write_file(json_path, out.dump(2) + "\n");
  std::printf("halyard-plan: %.1f s\n", out["seconds"].get<double>());
  return r.feasible ? 0 : 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const UserError& e) {
    std::cerr << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
