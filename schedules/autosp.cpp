// The AutoSP search and the budgeted recompute solver (see autosp.h).
#include "schedules/autosp.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <queue>
#include <set>
#include <tuple>

#include "dsl/error.h"
#include "dsl/op_table.h"
#include "schedules/sharding.h"
#include "schedules/tiling.h"

namespace halyard {
namespace {

std::string gib(int64_t b) {
  char s[32];
  if (b >= (int64_t{1} << 30)) std::snprintf(s, sizeof s, "%.2f GiB", static_cast<double>(b) / (1 << 30));
  else std::snprintf(s, sizeof s, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return s;
}

// "model.layers.12.mlp.gate_proj" -> "model.layers.*.mlp.gate_proj".
std::string module_pattern(const std::string& label) {
  const std::string p = "model.layers.";
  if (label.rfind(p, 0) != 0) return label;
  size_t end = p.size();
  while (end < label.size() && std::isdigit(static_cast<unsigned char>(label[end]))) ++end;
  return end == p.size() ? label : p + "*" + label.substr(end);
}

// An error's text on one line (a row of a rejection table), without "error: ".
std::string reason_of(const UserError& e) {
  std::string s = e.what();
  if (s.rfind("error: ", 0) == 0) s = s.substr(7);
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

struct Scored {
  int64_t peak = 0;
  double step = 0;
};

// The peak given a plan that would not build (Plan::gpu_unbuildable): it
// fits no budget.
constexpr int64_t kUnbuildable = INT64_MAX / 4;
constexpr const char* kUnbuildableWhy = "a tensor beyond Halide's 32-bit GPU indexing (more ranks or finer tiles would do)";

// The repeated layers of a model (built once, at a few tokens).
int64_t layers_of(const ModelBuilder& build, const std::string& config) {
  static std::map<std::string, int64_t> known;
  auto it = known.find(config);
  if (it == known.end()) it = known.emplace(config, build(config, 1, 8, 0).layers).first;
  return it->second;
}

// Builds with this many layers stand for a deep model (see score()).
constexpr int64_t kProbeLayers = 3;

// A model scored from probe builds rather than planned at full depth.
bool deep(const ModelBuilder& build, const ModelRequest& req) {
  return req.layers == 0 && layers_of(build, req.config) > kProbeLayers + 3;
}

// A schedule's predicted peak and step. Every layer of the model is the
// same, so for a deep model they are those of a 3-layer build plus (L - 3)
// times what a fourth layer adds: two small plans instead of one of L
// layers. (autosp() plans its choice at full depth before it answers.)
Scored plan_score(const ModelBuilder& build, const ModelRequest& req, const Schedule& s, const Cluster& c, int* plans) {
  if (!deep(build, req)) {
    const Plan p = plan(build, req, s, c);
    if (plans) ++*plans;
    return {p.gpu_unbuildable.empty() ? p.memory.total() : kUnbuildable, p.step_s};
  }
  ModelRequest a = req, b = req;
  a.layers = kProbeLayers, b.layers = kProbeLayers + 1;
  const Plan pa = plan(build, a, s, c), pb = plan(build, b, s, c);
  if (plans) *plans += 2;
  if (!pa.gpu_unbuildable.empty() || !pb.gpu_unbuildable.empty()) return {kUnbuildable, pa.step_s};
  const int64_t more = layers_of(build, req.config) - kProbeLayers;
  return {pa.memory.total() + more * (pb.memory.total() - pa.memory.total()),
          pa.step_s + static_cast<double>(more) * (pb.step_s - pa.step_s)};
}

// A schedule's score, from `memo` when this search planned it before.
Scored score(const ModelBuilder& build, const ModelRequest& req, const Schedule& s, const Cluster& c, int* plans,
             ScoreMemo* memo = nullptr) {
  if (!memo) return plan_score(build, req, s, c, plans);
  const std::string key = req.config + "\n" + std::to_string(req.batch) + "\n" + std::to_string(req.seq) + "\n" +
                          std::to_string(req.layers) + "\n" + req.precision + "\n" + c.to_json() + "\n" + s.to_json();
  if (auto it = memo->seen.find(key); it != memo->seen.end()) return {it->second.first, it->second.second};
  const Scored x = plan_score(build, req, s, c, plans);
  memo->seen[key] = {x.peak, x.step};
  return x;
}

// The request a search builds groups from: few layers when the model is deep.
ModelRequest probe(const ModelBuilder& build, ModelRequest req) {
  if (deep(build, req)) req.layers = kProbeLayers;
  return req;
}

// Rules of the families a user would otherwise pick.
std::vector<ValueRule> sac_rules() {  // AutoSP's SAC: attention outputs kept, matmuls and cheap ops recomputed
  std::vector<ValueRule> r = inline_cheap_rules();
  for (const ValueRule& c : checkpoint_rules()) r.push_back(c);
  return r;
}

Schedule mesh_schedule(const std::string& name, int64_t ranks, int64_t sp, const std::string& strategy) {
  Schedule s;
  s.name = name;
  s.mesh = {ranks / sp, sp, ranks > 1 ? 1 : 0};
  if (sp > 1) s.split_sequence = "sp", s.attention = {{"*", strategy, 0}};
  return s;
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(k);
  return d;
}

// Tile candidates for a region of `local` tokens: whole, or a quarter or a
// sixteenth (multiples of 8, at least 64 tokens); the last is the smallest.
// `cap` > 0: the most tokens a tile may hold (GPU kernels' 32-bit indexing,
// gpu_tile_cap), added when smaller.
std::vector<int64_t> tile_options(int64_t local, int64_t cap) {
  std::vector<int64_t> t = {0};
  for (int64_t parts : {4, 16}) {
    const int64_t tile = (local / parts + 7) / 8 * 8;
    if (tile >= 64 && tile < local && std::find(t.begin(), t.end(), tile) == t.end()) t.push_back(tile);
  }
  const int64_t fit = cap / 8 * 8;
  if (fit >= 64 && fit < (t.size() > 1 ? t.back() : local)) t.push_back(fit);
  return t;
}

// The rule sequence tiling's tiles follow unless their groups say otherwise.
bool is_tile_rule(const ValueRule& r) { return r.match == recompute_seq_tiles_rule().match; }

// `s` with the MLP region in tiles of `mlp` tokens and the LM head + loss in
// tiles of `loss` (0: whole), the tiles recomputed in the backward (unless
// the recompute solver keeps some: their groups' rules come after this one).
Schedule with_tiles(Schedule s, int64_t mlp, int64_t loss) {
  s.seq_tile = mlp;
  s.loss_seq_tile = loss > 0 && loss != mlp ? loss : 0;
  if (mlp == 0 && loss > 0) s.seq_tile = 0, s.loss_seq_tile = loss;
  if (mlp > 0 || loss > 0) s.values.push_back(recompute_seq_tiles_rule());
  return s;
}

// On a GPU cluster, the most tokens a sequence tile may hold so that its
// widest tensor (a tile of logits: the vocabulary per token) stays within
// Halide's 32-bit GPU indexing (partition.h, gpu_index_overflow); 0
// elsewhere. Read off a one-layer build at a few tokens.
int64_t gpu_tile_cap(const ModelBuilder& build, const std::string& config, const Cluster& cluster) {
  if (!cluster.gpu()) return 0;
  static std::map<std::string, int64_t> widest;
  auto it = widest.find(config);
  if (it == widest.end()) {
    const BuiltModel m = build(config, 1, 8, 1);
    int64_t w = 1;
    for (const Node& n : m.graph->nodes())
      if (n.type.has("seq")) w = std::max(w, n.type.numel() / n.type.size("seq"));
    it = widest.emplace(config, w).first;
  }
  return kMax32Bit / it->second;
}

int64_t tokens_per_step(const ModelRequest& req, const Schedule& s) { return req.batch * req.seq * s.mesh.dp; }

int64_t default_seq_step(int64_t ranks) { return std::min<int64_t>(1024, std::max<int64_t>(8 * ranks, 256)); }

// `step` rounded up to a multiple of sp (every rank gets as many tokens).
int64_t step_for(int64_t step, int64_t sp) { return (step + sp - 1) / sp * sp; }

// The least memory a model's values take: every layer recomputed but its
// output where the values are labelled by layer (model.layers.N, as the
// Hugging Face models are), else the op table's checkpointing (what it
// keeps saved, the rest recomputed). With a host link (GPUs) what is kept is
// offloaded to host memory between forward and backward (ALST's offload).
std::vector<ValueRule> least_memory_rules(const Graph& g, bool offload) {
  const bool layered = std::any_of(g.nodes().begin(), g.nodes().end(),
                                   [](const Node& n) { return n.name.rfind("model.layers.", 0) == 0; });
  if (layered) {
    // What full checkpointing keeps, less a layer's input that its own
    // module computes from parameters and inputs alone (the embedding's
    // output, the first layer's input): recomputed, it recomputes no layer.
    std::vector<ValueRule> r = offload ? offloaded_checkpoint_rules() : layer_checkpoint_rules();
    for (const RematGroup& x : remat_groups(g, Schedule{}))
      if (x.from_inputs && !x.tile && x.module.rfind("model.layers.", 0) != 0) r.push_back({x.match(), "recompute", "", ""});
    return r;
  }
  std::vector<ValueRule> r = sac_rules();
  if (offload)
    for (ValueRule& v : r)
      if (v.keep == "save" && v.match.rfind("op:", 0) == 0) v.keep = "offload";
  return r;
}

// A precision the search gives a schedule (SearchOptions::bf16).
struct Precision {
  bool store = false, contract = false, reduce = false;
  bool operator==(const Precision&) const = default;
};

Schedule in_precision(Schedule s, Precision p) {
  if (p.store) s.values.insert(s.values.begin(), ValueRule{"*", "", "", "bf16"});
  if (p.contract) s.contract_precision = "bf16";
  if (p.reduce && s.mesh.ranks() > 1) s.grad_reduce_precision = "bf16";
  return s;
}

bool allows(const SearchOptions& o, const char* what) {
  return std::find(o.bf16.begin(), o.bf16.end(), what) != o.bf16.end();
}

// Every bf16 choice the options allow, taken.
Precision all_allowed(const SearchOptions& o) { return {allows(o, "store"), allows(o, "contract"), allows(o, "reduce")}; }

// Every precision the options allow, f32 first. Gradients summed from bf16
// are not a choice to weigh: they halve the reduction's bytes, hold no more
// memory, and the rounding costs the host next to nothing, so where they are
// allowed every candidate takes them.
std::vector<Precision> precisions(const SearchOptions& o) {
  std::vector<Precision> out;
  for (bool store : {false, true})
    for (bool contract : {false, true})
      if ((!store || allows(o, "store")) && (!contract || allows(o, "contract")))
        out.push_back({store, contract, allows(o, "reduce")});
  return out;
}

// The least memory: saved values in bf16 when allowed (contractions' copies
// only add bytes).
Precision frugal_precision(const SearchOptions& o) {
  Precision p = all_allowed(o);
  p.contract = false;
  return p;
}

// The group a forward node's value belongs to ("" module: none).
using GroupKey = std::tuple<std::string, std::string, bool>;
GroupKey group_key(const Node& n) {
  if (n.backward || n.name.empty()) return {};
  const OpClass cls = op_info(n.op).cls;
  if (cls == OpClass::Leaf || cls == OpClass::View) return {};
  // bf16 copies follow their values' decisions (schedules/precision.h): not a decision of their own.
  if (n.op == Op::StoreBf16 || n.op == Op::LoadBf16) return {};
  return {module_pattern(n.name), op_info(n.op).name, is_wide_tile(n)};
}

// Per group, the bytes the backward holds of its values in `p`, a plan that
// saves every group: values a backward kernel reads (directly, through
// their bf16 copies or through views of them), with those copies; values
// computed inside their readers hold nothing. Recomputing a set of groups
// frees at most the sum over it at any point of the step: a value no
// backward kernel reads is not held, and one that is stays held unless
// recomputed (recomputing a cheap one may fuse it into its forward reader
// as well, which frees the same bytes, earlier).
std::vector<double> held_bytes(const Plan& p, const std::vector<RematGroup>& groups) {
  const Graph& g = *p.model.graph;
  std::map<GroupKey, size_t> index;
  for (size_t i = 0; i < groups.size(); ++i) index[{groups[i].module, groups[i].op, groups[i].tile}] = i;
  std::vector<bool> stored(static_cast<size_t>(g.size()), false), held(stored);
  for (const Stage& st : p.train.stages) {
    stored[static_cast<size_t>(st.root)] = true;
    for (int v : st.extra_outputs) stored[static_cast<size_t>(v)] = true;
  }
  auto through = [&](const Node& n) {  // a copy or a view of its first input
    return !n.inputs.empty() && (n.op == Op::StoreBf16 || n.op == Op::LoadBf16 || op_info(n.op).cls == OpClass::View);
  };
  for (const Stage& st : p.train.stages) {
    if (!g.node(st.root).backward) continue;
    for (int i : st.inputs)
      for (int v = i; !g.node(v).backward; v = g.node(v).inputs[0]) {
        held[static_cast<size_t>(v)] = true;
        if (!through(g.node(v))) break;
      }
  }
  std::vector<double> out(groups.size(), 0.0);
  for (const Node& n : g.nodes()) {
    if (!held[static_cast<size_t>(n.id)] || !stored[static_cast<size_t>(n.id)]) continue;
    const Node* v = &n;  // a copy's bytes count for its value's group
    while (through(*v)) v = &g.node(v->inputs[0]);
    if (auto it = index.find(group_key(*v)); it != index.end()) out[it->second] += static_cast<double>(value_bytes(n.type));
  }
  return out;
}

}  // namespace

std::vector<RematGroup> remat_groups(const Graph& g, const Schedule& base) {
  std::vector<RematGroup> out;
  std::map<GroupKey, size_t> index;
  // Values read by a node of another layer: what full checkpointing keeps,
  // since recomputing one recomputes the layers before it. Not those its
  // own layer computes from parameters and inputs alone (the embedding):
  // recomputing such a value recomputes no other layer.
  std::vector<bool> leaves_layer(static_cast<size_t>(g.size()), false), from_leaves(leaves_layer);
  for (const Node& n : g.nodes()) {
    if (n.backward) continue;
    bool own = true;
    for (int i : n.inputs) {
      const Node& x = g.node(i);
      own = own && (op_info(x.op).cls == OpClass::Leaf ||
                    (from_leaves[static_cast<size_t>(i)] && layer_of(x.name) == layer_of(n.name)));
    }
    from_leaves[static_cast<size_t>(n.id)] = own;
  }
  for (const Node& n : g.nodes())
    if (!n.backward && !n.name.empty())
      for (int i : n.inputs)
        if (layer_of(g.node(i).name) != layer_of(n.name) && !from_leaves[static_cast<size_t>(i)])
          leaves_layer[static_cast<size_t>(i)] = true;
  for (const Node& n : g.nodes()) {
    const GroupKey key = group_key(n);
    if (std::get<0>(key).empty()) continue;
    auto [it, fresh] = index.try_emplace(key, out.size());
    if (fresh) out.push_back({std::get<0>(key), std::get<1>(key), std::get<2>(key)});
    ++out[it->second].values;
    out[it->second].bytes += value_bytes(n.type);
    out[it->second].layer_output = out[it->second].layer_output || leaves_layer[static_cast<size_t>(n.id)];
    out[it->second].from_inputs = (fresh || out[it->second].from_inputs) && from_leaves[static_cast<size_t>(n.id)];
    out[it->second].inlined = base.compute(n) == Compute::Inline;
  }
  return out;
}

Schedule with_recompute(const Schedule& base, const std::vector<RematGroup>& groups, const std::vector<bool>& recompute,
                        const std::vector<bool>& offload) {
  Schedule s = base;
  s.values.clear();
  std::vector<ValueRule> tile_rules;
  for (const ValueRule& r : base.values) (is_tile_rule(r) ? tile_rules : s.values).push_back(r);
  for (bool tiles : {false, true}) {
    if (tiles) s.values.insert(s.values.end(), tile_rules.begin(), tile_rules.end());
    for (size_t i = 0; i < groups.size(); ++i)
      if (groups[i].tile == tiles)
        s.values.push_back({groups[i].match(), !offload.empty() && offload[i] ? "offload" : recompute[i] ? "recompute" : "save", "", ""});
  }
  return s;
}

RematResult solve_remat(const ModelBuilder& build, const ModelRequest& req, const Schedule& base, const Cluster& cluster,
                        int64_t budget, std::vector<RematGroup> groups, int max_plans, ScoreMemo* memo) {
  RematResult r;
  if (groups.empty()) {
    const Plan p = plan(build, probe(build, req), base, cluster);
    ++r.plans;
    groups = remat_groups(*p.model.graph, base);
  }
  r.groups = groups;
  const size_t n = groups.size();
  std::map<std::vector<bool>, Scored> seen;
  auto eval = [&](const std::vector<bool>& d) {
    if (auto it = seen.find(d); it != seen.end()) return it->second;
    return seen[d] = score(build, req, with_recompute(base, groups, d), cluster, &r.plans, memo);
  };
  // The decisions. A layer's output is kept: recomputing it would recompute
  // every layer before it. A cheap value fused into its only forward
  // consumer once the backward no longer reads it saves a store as well as
  // its bytes: when that costs no time (within the slack below) and holds no
  // more memory, it is recomputed outright.
  std::vector<bool> start(n, false);
  std::vector<size_t> decide;
  const Scored s0 = eval(start);
  const int64_t slack_bytes = std::max<int64_t>(int64_t{2} << 20, budget / 50);
  const double slack_time = 1e-3 * s0.step;
  for (size_t i = 0; i < n; ++i) {
    if (groups[i].layer_output) continue;
    if (op_info(op_by_name(groups[i].op)).cls == OpClass::Cheap && !groups[i].inlined) {
      std::vector<bool> d(n, false);
      d[i] = true;
      const Scored x = eval(d);
      if (x.step <= s0.step + slack_time && x.peak <= s0.peak) {
        start[i] = true;
        continue;
      }
    }
    decide.push_back(i);
  }
  // The biggest first: cuts come sooner.
  std::stable_sort(decide.begin(), decide.end(), [&](size_t a, size_t b) { return groups[a].bytes > groups[b].bytes; });
  // What recomputing each group adds to the step alone (measured), and the
  // most bytes it can free (held_bytes, at full depth: a deep model's plans
  // are probes of kProbeLayers layers). Where saving the rest misses the
  // budget by D bytes, any completion recomputes groups that free at least D
  // and adds at least their times: so the cheapest fractional cover of D by
  // time per byte (a knapsack's relaxation) adds to a node's bound. It holds
  // as far as recompute times add up, which plan() keeps within the slack
  // below (the tests compare with enumeration). (Covering the saved plan's
  // excess at each call of the step instead, jointly as a linear program,
  // bound the tiny Llama's 4 x 88 MiB no tighter: recomputing a group alone
  // moved the peak elsewhere rather than lower.)
  std::vector<double> adds(n, 0.0), frees(n, 0.0);
  std::vector<size_t> by_rate;  // positions in `decide`, least time per byte first
  if (s0.peak > budget) {
    const Plan saved = plan(build, probe(build, req), with_recompute(base, groups, std::vector<bool>(n, false)), cluster);
    ++r.plans;
    const std::vector<double> held = held_bytes(saved, groups);
    const double depth = deep(build, req) ? static_cast<double>(layers_of(build, req.config)) / kProbeLayers : 1.0;
    for (size_t q = 0; q < decide.size(); ++q) {
      const size_t j = decide[q];
      frees[j] = held[j] * (groups[j].module.rfind("model.layers.", 0) == 0 ? depth : 1.0);
      if (frees[j] <= 0) continue;
      std::vector<bool> d = start;
      d[j] = true;
      adds[j] = std::max(0.0, eval(d).step - s0.step);
      by_rate.push_back(q);
    }
    std::stable_sort(by_rate.begin(), by_rate.end(), [&](size_t a, size_t b) {
      return adds[decide[a]] * frees[decide[b]] < adds[decide[b]] * frees[decide[a]];
    });
  }
  // A node's bound: its decisions with the rest saved (x), plus the least
  // time the undecided groups (positions k on) must add to fit.
  auto bound = [&](const Scored& x, size_t k) {
    double missing = static_cast<double>(x.peak - budget - slack_bytes), more = 0;
    for (size_t q : by_rate) {
      if (missing <= 0) break;
      if (q < k) continue;
      const size_t j = decide[q];
      const double part = std::min(1.0, missing / frees[j]);
      more += part * adds[j];
      missing -= part * frees[j];
    }
    return x.step + more;
  };
  // Branch and bound over the decisions in order. A node has decided the
  // first k; its time bound is that of saving the rest (recomputing more
  // adds work and removes none) plus what fitting the budget must add
  // (`bound`), and its memory bound is that of recomputing the rest
  // (recomputing more within layers holds fewer values). Both hold for
  // plan() up to what its arena packing and its fusion of single-use cheap
  // values move: `slack` (a node is cut only when its bound misses by more;
  // the search stops only when no open node can be faster by more). Nodes
  // come up in order of their bound, so the first completions that fit are
  // the optimum. The tests check the properties within the slack and the
  // optimum against enumerating plan() over every decision.
  struct Node {
    double time;          // no completion is faster (bound)
    std::vector<bool> d;  // the decisions so far, the rest saved
    size_t k;
  };
  auto later = [](const Node& a, const Node& b) { return a.time > b.time; };
  std::priority_queue<Node, std::vector<Node>, decltype(later)> open(later);
  auto lean = [&](std::vector<bool> d, size_t k) {
    for (size_t j = k; j < decide.size(); ++j) d[decide[j]] = true;
    return eval(d);
  };
  std::optional<std::pair<std::vector<bool>, Scored>> best;
  auto consider = [&](const std::vector<bool>& d, const Scored& x) {
    if (x.peak <= budget && (!best || x.step < best->second.step)) best = {d, x};
  };
  // Incumbents, so that a capped search still answers: every decision
  // recomputed; full checkpointing (every layer's values recomputed, the
  // rest kept); the op table's checkpointing (SAC: keep what checkpointing
  // keeps); the tiles recomputed and the rest kept (what the tiling rule
  // alone does); and, below, a greedy fill by bytes saved per second added.
  for (int policy = 0; policy < 4; ++policy) {
    std::vector<bool> d = start;
    for (size_t j : decide)
      d[j] = policy == 0   ? true
             : policy == 1 ? groups[j].module.rfind("model.layers.", 0) == 0
             : policy == 2 ? !op_info(op_by_name(groups[j].op)).checkpoint_keeps
                           : groups[j].tile;
    consider(d, eval(d));
  }
  if (s0.peak > budget && decide.size() > 8) {
    std::vector<std::pair<double, size_t>> worth;  // bytes saved per second, each alone
    for (size_t j : decide) {
      std::vector<bool> d = start;
      d[j] = true;
      const Scored x = eval(d);
      const double saved = static_cast<double>(s0.peak - x.peak), cost = std::max(x.step - s0.step, 1e-9);
      if (saved > 0) worth.push_back({saved / cost, j});
    }
    std::sort(worth.rbegin(), worth.rend());
    std::vector<bool> d = start;
    for (const auto& [w, j] : worth) {
      d[j] = true;
      const Scored x = eval(d);
      if (x.peak <= budget) {
        consider(d, x);
        break;
      }
    }
    // Then give back what is not needed, one group at a time in the order
    // they were taken.
    if (best) {
      d = best->first;
      for (auto it = worth.begin(); it != worth.end(); ++it) {
        if (!d[it->second]) continue;
        d[it->second] = false;
        const Scored x = eval(d);
        if (x.peak <= budget && x.step < best->second.step) consider(d, x);
        else d[it->second] = true;
      }
    }
  }
  if (lean(start, 0).peak - slack_bytes <= budget) open.push({bound(eval(start), 0), start, 0});
  while (!open.empty()) {
    Node x = open.top();
    open.pop();
    if (best && x.time - slack_time >= best->second.step) break;  // nothing left can be faster
    consider(x.d, eval(x.d));
    if (x.k == decide.size()) continue;
    if (r.plans >= max_plans) {
      r.exhaustive_bound = false;
      r.lower_bound_s = x.time - slack_time;
      break;
    }
    const size_t j = decide[x.k];
    if (lean(x.d, x.k + 1).peak - slack_bytes <= budget) open.push({bound(eval(x.d), x.k + 1), x.d, x.k + 1});  // save j
    std::vector<bool> d = x.d;  // recompute j: its memory bound is this node's
    d[j] = true;
    open.push({bound(eval(d), x.k + 1), d, x.k + 1});
  }
  if (best) {
    r.feasible = true;
    r.recompute = best->first;
    r.peak_bytes = best->second.peak;
    r.step_s = best->second.step;
    if (r.exhaustive_bound) r.lower_bound_s = r.step_s;
  } else {
    auto least = std::min_element(seen.begin(), seen.end(),
                                  [](const auto& a, const auto& b) { return a.second.peak < b.second.peak; });
    r.recompute = least->first;
    r.peak_bytes = least->second.peak;
    r.step_s = least->second.step;
  }
  r.least_peak_bytes = INT64_MAX;
  for (const auto& [d, x] : seen) r.least_peak_bytes = std::min(r.least_peak_bytes, x.peak);
  // The offload pass: a recomputed heavy group read back from the host
  // instead, the costliest recompute first, kept when faster and within
  // the budget. (Cheap groups cost less to recompute than to copy.)
  r.recompute_step_s = r.step_s;
  if (r.feasible && cluster.has_host_link()) {
    std::vector<std::pair<double, size_t>> costly;  // time its recompute adds, alone
    for (size_t j = 0; j < n; ++j) {
      if (!r.recompute[j] || op_info(op_by_name(groups[j].op)).cls != OpClass::Heavy) continue;
      std::vector<bool> d = r.recompute;
      d[j] = false;
      costly.push_back({r.step_s - eval(d).step, j});
    }
    std::sort(costly.rbegin(), costly.rend());
    std::vector<bool> off(n, false);
    for (const auto& [gain, j] : costly) {
      off[j] = true;
      const Scored x = score(build, req, with_recompute(base, groups, r.recompute, off), cluster, &r.plans, memo);
      if (x.peak <= budget && x.step < r.step_s) {
        r.peak_bytes = x.peak, r.step_s = x.step;
        r.offload = off;
      } else {
        off[j] = false;
      }
    }
  }
  r.schedule = with_recompute(base, groups, r.recompute, r.offload);
  return r;
}

std::vector<ValueRule> layer_checkpoint_rules() {
  std::vector<ValueRule> r = inline_cheap_rules();
  r.push_back({"model.layers.*", "recompute", "", ""});
  r.push_back({"model.layers.*.mlp.residual", "save", "", ""});
  return r;
}

std::vector<ValueRule> offloaded_checkpoint_rules() {
  std::vector<ValueRule> r = layer_checkpoint_rules();
  for (ValueRule& v : r)
    if (v.keep == "save") v.keep = "offload";
  return r;
}

int64_t longest_fitting_seq(const std::function<int64_t(int64_t)>& peak_at, int64_t budget, int64_t step, int64_t limit,
                            int* plans) {
  std::map<int64_t, int64_t> peaks;  // seq -> peak (INT64_MAX when it cannot be planned)
  auto peak = [&](int64_t seq) {
    if (auto it = peaks.find(seq); it != peaks.end()) return it->second;
    if (plans) ++*plans;
    int64_t p = INT64_MAX;
    try {
      p = peak_at(seq);
    } catch (const UserError&) {
    }
    return peaks[seq] = p;
  };
  auto down = [&](double s) { return std::max<int64_t>(step, static_cast<int64_t>(s) / step * step); };
  limit = limit / step * step;
  if (peak(step) > budget) return 0;
  int64_t lo = step, hi = 0;  // lo fits; hi (when > 0) does not
  // Secant steps from the two largest probes that fit.
  int64_t a = step, b = std::min(limit, 8 * step);
  for (int k = 0; k < 6 && hi == 0; ++k) {
    if (b <= lo) break;
    if (peak(b) > budget) {
      hi = b;
      break;
    }
    lo = b;
    if (b == limit) return limit;
    const double slope = static_cast<double>(peak(b) - peak(a)) / static_cast<double>(b - a);
    const int64_t next = slope > 0 ? down(static_cast<double>(b) + static_cast<double>(budget - peak(b)) / slope)
                                   : std::min(limit, 4 * b);
    a = b, b = std::min(limit, std::max(next, b + step));
  }
  while (hi == 0) {  // still growing: double
    if (lo >= limit) return limit;
    const int64_t next = std::min(limit, 2 * lo);
    (peak(next) <= budget ? lo : hi) = next;
  }
  // Just above the secant's estimate first, then bisect.
  if (hi - lo > step && peak(lo + step) > budget) return lo;
  if (hi - lo > step) lo += step;
  while (hi - lo > step) {
    const int64_t mid = down(static_cast<double>(lo + hi) / 2);
    if (mid <= lo) break;
    (peak(mid) <= budget ? lo : hi) = mid;
  }
  return lo;
}

const std::vector<Family>& families() {
  static const std::vector<Family> f = {
      {"default", "one rank, nothing recomputed", "the whole sequence on one rank, every value saved"},
      {"dp_zero3", "DP + ZeRO-3, no SP",
       "data parallel over every rank, parameters, gradients and optimizer state sharded (ZeRO-3, planned only: "
       "llama_train runs ZeRO-1), no sequence split, nothing recomputed"},
      {"ulysses", "Ulysses", "Ulysses over the largest legal sp, ZeRO-1, nothing recomputed, no tiles"},
      {"ulysses_checkpoint", "Ulysses + full checkpointing",
       "Ulysses, each layer's input saved and the layer recomputed (full checkpointing)"},
      {"ulysses_sac", "Ulysses + AutoSP's SAC",
       "Ulysses with AutoSP's sequence-aware checkpointing: attention outputs and the residual stream kept, matmuls "
       "and cheap ops recomputed"},
      {"ulysses_offload", "Ulysses + checkpoint offload",
       "Ulysses with full checkpointing, each layer's saved input offloaded to host memory between the forward and "
       "the backward (ALST's offload; clusters with a host link, i.e. GPUs)"},
      {"autosp", "Halyard autosp", "Halyard's search: mesh, strategy, tiles, ZeRO stage and recompute set chosen by plan()"},
  };
  return f;
}

const Family& family_named(const std::string& name) {
  std::string names;
  for (const Family& f : families()) {
    if (f.name == name) return f;
    names += (names.empty() ? "" : ", ") + f.name;
  }
  throw UserError("error: no family \"" + name + "\".\nlegal: " + names + ".");
}

Schedule family_schedule(const std::string& family, const ModelBuilder& build, const ModelRequest& req, int64_t ranks) {
  if (family == "dp_zero3" || family == "default") {
    Schedule s = mesh_schedule(family, ranks, 1, "");
    if (family == "dp_zero3" && ranks > 1) s.mesh.zero = 3;
    return s;
  }
  if (family_named(family).name == "autosp")
    throw UserError("error: family \"autosp\" is a search, not a fixed schedule.\nlegal: autosp() or family_longest().");
  // The largest Ulysses degree the model takes (its heads bound it).
  std::string why;
  for (int64_t sp = ranks; sp > 1; --sp) {
    if (ranks % sp != 0) continue;
    Schedule s = mesh_schedule(family, ranks, sp, "ulysses");
    if (family == "ulysses_checkpoint" || family == "ulysses_offload") s.values = layer_checkpoint_rules();
    if (family == "ulysses_sac") s.values = sac_rules();
    try {
      ModelRequest small = probe(build, req);
      small.seq = sp * 8;
      plan(build, small, s, Cluster{});  // (no host link: the degree's legality does not depend on offloading)
      if (family == "ulysses_offload") s.values = offloaded_checkpoint_rules();
      return s;
    } catch (const UserError& e) {
      if (why.empty()) why = reason_of(e);
    }
  }
  throw UserError("error: " + family + " on " + std::to_string(ranks) + " ranks: no sequence-parallel degree applies" +
                  (why.empty() ? std::string(".") : ": " + why));
}

FamilyResult family_longest(const std::string& family, const ModelBuilder& build, const ModelRequest& req_in,
                            const Cluster& cluster, int64_t ranks, int64_t budget, const SearchOptions& opts) {
  FamilyResult f;
  f.family = family;
  ModelRequest req = req_in;
  if (family == "autosp") {
    SearchOptions o = opts;
    o.ranks = ranks, o.memory_per_rank = budget, o.max_seq = true;
    const SearchResult r = autosp(build, req, cluster, o);
    if (!r.feasible) {
      f.applies = false, f.reason = r.infeasible;
      return f;
    }
    f.schedule = r.best().schedule, f.longest = r.seq;
    f.peak_bytes = r.best().peak_bytes, f.step_s = r.best().step_s, f.tokens_per_s = r.best().tokens_per_s;
    return f;
  }
  const int64_t on = family == "default" ? 1 : ranks;
  if (family == "ulysses_offload" && !cluster.has_host_link()) {
    f.applies = false, f.reason = "cluster \"" + cluster.name + "\" has no host link (CPU ranks' memory is host memory)";
    return f;
  }
  try {
    // The same numerics as the search's: every bf16 choice allowed, taken.
    f.schedule = in_precision(family_schedule(family, build, req, on), all_allowed(opts));
  } catch (const UserError& e) {
    f.applies = false, f.reason = reason_of(e);
    return f;
  }
  f.modelled = f.schedule.mesh.zero == 3;

  Cluster c = cluster;
  c.ranks = std::max(c.ranks, on);
  const int64_t sp = f.schedule.mesh.sp;
  const int64_t step = step_for(opts.seq_step > 0 ? opts.seq_step : default_seq_step(ranks), sp);
  // On GPUs the loss is tiled where whole it would be beyond Halide's 32-bit
  // indexing: what building the family's plan takes, not its policy.
  const int64_t fit = gpu_tile_cap(build, req.config, cluster) / 8 * 8;
  auto indexable = [&](Schedule s, int64_t seq) {
    if (fit < 64 || local_seq(seq, sp, s.sequence_layout == "zigzag") <= fit || (s.loss_tile() > 0 && s.loss_tile() <= fit))
      return s;
    return with_tiles(s, s.seq_tile, fit);
  };
  auto longest = [&] {
    return longest_fitting_seq(
        [&](int64_t seq) {
          ModelRequest r = req;
          r.seq = seq;
          return score(build, r, indexable(f.schedule, seq), c, nullptr).peak;
        },
        budget, step, opts.seq_limit);
  };
  f.longest = longest();
  if (f.longest == 0 && f.schedule.mesh.zero == 1) {  // what its users do when the states do not fit: ZeRO-3
    f.schedule.mesh.zero = 3;
    f.modelled = true;
    f.longest = longest();
  }
  if (f.longest == 0) {
    f.applies = false, f.reason = std::to_string(step) + " tokens do not fit " + gib(budget) + " per rank";
    return f;
  }
  req.seq = f.longest;
  f.schedule = indexable(f.schedule, f.longest);
  const Scored x = score(build, req, f.schedule, c, nullptr);
  f.peak_bytes = x.peak, f.step_s = x.step;
  f.tokens_per_s = static_cast<double>(tokens_per_step(req, f.schedule)) / f.step_s;
  return f;
}

namespace {
SearchResult search(const ModelBuilder& build, const ModelRequest& req_in, const Cluster& cluster,
                    const SearchOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  SearchResult out;
  ScoreMemo memo;
  const int64_t ranks = opts.ranks, budget = opts.memory_per_rank;
  const std::vector<int64_t> sps = opts.sp.empty() ? divisors(ranks) : opts.sp;

  // The configurations: a mesh and a strategy per attention (every strategy
  // of the schedule vocabulary), with the cheap ops computed inside their
  // consumers. Those that cannot apply are rejected with plan()'s reason.
  struct Config {
    Schedule base;
    std::string what;
  };
  std::vector<Config> configs;
  for (int64_t sp : sps) {
    const std::vector<std::string> strategies = sp > 1 ? Schedule::strategies() : std::vector<std::string>{""};
    for (const std::string& st : strategies) {
      if (sp > 1 && !opts.strategies.empty() &&
          std::find(opts.strategies.begin(), opts.strategies.end(), st) == opts.strategies.end())
        continue;
      // hybrid: every Ulysses degree u strictly between 1 and sp that divides it
      std::vector<int64_t> us = {0};
      if (st == "hybrid") {
        us.clear();
        for (int64_t u = 2; u < sp; ++u)
          if (sp % u == 0) us.push_back(u);
      }
      // ring in either layout: zigzag gives every rank the same causal work,
      // where contiguous gives the last rank sp times the first's (hybrid's
      // all-to-alls need the contiguous one)
      const std::vector<std::string> layouts =
          st == "ring" ? std::vector<std::string>{"contiguous", "zigzag"} : std::vector<std::string>{"contiguous"};
      for (const std::string& layout : layouts) {
        for (int64_t u : us) {
          for (int zero : ranks > 1 ? opts.zero : std::vector<int>{0}) {
            Config c{mesh_schedule("autosp", ranks, sp, st), ""};
            c.base.mesh.zero = zero;
            c.base.sequence_layout = layout;
            c.base.values = inline_cheap_rules();
            if (u > 0) c.base.attention[0].ulysses_degree = u;
            std::string how = st;
            if (u > 0) how = "hybrid (ulysses " + std::to_string(u) + " x ring " + std::to_string(sp / u) + ")";
            if (layout == "zigzag") how += " (zigzag)";
            c.what = (sp > 1 ? how + " at sp=" + std::to_string(sp) + " (dp=" + std::to_string(ranks / sp) + ")"
                             : "no sequence split (dp=" + std::to_string(ranks) + ")") +
                     (zero == 3 ? ", ZeRO-3" : "");
            configs.push_back(c);
          }
        }
      }
    }
  }
  // The least-memory schedules of a configuration: every layer checkpointed
  // (lean_rules, below), with both regions in sixteenths or whole (tiles cost
  // a partial weight gradient per tile, which short sequences of wide models
  // do not repay).
  const bool can_offload = cluster.has_host_link();
  const int64_t tile_cap = gpu_tile_cap(build, req_in.config, cluster);
  std::vector<ValueRule> lean_rules;
  const Precision least_precision = frugal_precision(opts);
  // On CPU ranks a weight gradient through the library (gemm_cpu.h) copies
  // an operand computed inline whole first (a norm's output: 8 MiB at 8,192
  // tokens a rank of the tiny Llama); Halide's kernel stages it a panel of
  // rows at a time. The plan prices both as one kind (contract_seq; on a Zen
  // 5 at 29,440 tokens over 4 ranks their steps measured alike), so the
  // library stays the choice and Halide's is the lever where no plan with
  // the library fits: the least-memory schedules take whichever holds less.
  const bool wg_lever = !cluster.gpu();
  auto halide_wg = [](Schedule s) {
    s.weight_grad_kernel = "halide";
    return s;
  };
  auto frugal = [&](const Config& c, int64_t seq, bool tiled, bool halide) {
    Schedule s = c.base;
    s.values = lean_rules;
    const std::vector<int64_t> t = tile_options(local_seq(seq, s.mesh.sp, s.sequence_layout == "zigzag"), tile_cap);
    s = in_precision(tiled ? with_tiles(s, t.back(), t.back()) : s, least_precision);
    return halide ? halide_wg(s) : s;
  };

  ModelRequest req = req_in;
  std::vector<bool> applies(configs.size(), true);
  for (size_t i = 0; i < configs.size(); ++i) {
    const Schedule& s = configs[i].base;
    try {
      ModelRequest small = probe(build, req);
      small.seq = s.mesh.sp * 8;
      const Plan p = plan(build, small, s, cluster);
      ++out.plans;
      if (lean_rules.empty()) lean_rules = least_memory_rules(*p.model.graph, can_offload);
    } catch (const UserError& e) {
      applies[i] = false;
      out.rejected.push_back({configs[i].what, reason_of(e)});
    }
  }

  // The longest sequence (up to `limit`) that the frugal schedules fit, at
  // the largest degree that applies: splitting the sequence further only
  // shortens what each rank holds. `zero` < 0 takes every ZeRO stage.
  const int64_t step = opts.seq_step > 0 ? opts.seq_step : default_seq_step(ranks);
  auto longest_frugal = [&](int64_t limit, int zero) {
    int64_t top_sp = 0, longest = 0;
    for (size_t i = 0; i < configs.size(); ++i)
      if (applies[i]) top_sp = std::max(top_sp, configs[i].base.mesh.sp);
    const int64_t st = step_for(step, top_sp);
    for (size_t i = 0; i < configs.size(); ++i) {
      if (!applies[i] || configs[i].base.mesh.sp != top_sp || (zero >= 0 && configs[i].base.mesh.zero != zero)) continue;
      for (bool tiled : {true, false}) {
        auto peak_at = [&](int64_t seq) {
          ModelRequest r = req;
          r.seq = seq;
          int64_t least_peak = score(build, r, frugal(configs[i], seq, tiled, false), cluster, &out.plans, &memo).peak;
          if (wg_lever && least_peak > budget)
            least_peak = std::min(least_peak, score(build, r, frugal(configs[i], seq, tiled, true), cluster, &out.plans, &memo).peak);
          return least_peak;
        };
        // Only a longer sequence than the longest so far counts: where one
        // step more does not fit, this schedule fits no longer (memory grows
        // with the sequence, as longest_fitting_seq assumes). This skips
        // most of the searches at a 70B's --seq max.
        if (longest > 0) {
          if (longest + st > limit / st * st) continue;
          try {
            if (peak_at(longest + st) > budget) continue;
          } catch (const UserError&) {
            continue;
          }
        }
        longest = std::max(longest, longest_fitting_seq(peak_at, budget, st, limit));
      }
    }
    return longest;
  };

  if (opts.max_seq) {
    const int64_t longest = longest_frugal(opts.seq_limit, -1);
    if (longest == 0) {
      out.infeasible = "no plan fits even " + std::to_string(step) + " tokens";
      req.seq = step;
    } else {
      req.seq = longest;
    }
  }
  out.seq = req.seq;

  // At the sequence: per configuration and tiles, the fastest plan that fits.
  // Each (configuration, tiles) is bounded below by saving everything (recompute
  // only adds time) and is hopeless when even the frugal schedule does not fit.
  struct Option {
    size_t config;
    Schedule base, lean_schedule;
    Scored fast, lean;
  };
  std::vector<Option> options;
  std::vector<int64_t> least(configs.size(), INT64_MAX);
  for (size_t i = 0; i < configs.size(); ++i) {
    if (!applies[i]) continue;
    if (req.seq < configs[i].base.mesh.sp) {
      out.rejected.push_back({configs[i].what, "seq " + std::to_string(req.seq) + " < sp=" +
                                                   std::to_string(configs[i].base.mesh.sp) + ": a rank needs a token"});
      continue;
    }
    const std::vector<int64_t> t =
        tile_options(local_seq(req.seq, configs[i].base.mesh.sp, configs[i].base.sequence_layout == "zigzag"), tile_cap);
    auto lean_of = [&](int64_t mlp, int64_t loss, Precision pr, bool halide) {
      Schedule lean = configs[i].base;
      lean.values = lean_rules;
      lean = in_precision(with_tiles(lean, mlp, loss), pr);
      return halide ? halide_wg(lean) : lean;
    };
    try {
      // The least memory first (checkpointed, whole or in sixteenths): a
      // configuration that cannot fit that way is out.
      auto leans_now = [&](bool halide, int64_t& least_peak) {
        std::map<std::pair<int64_t, int64_t>, Scored> l;
        for (int64_t tile : {int64_t{0}, t.back()}) {
          l[{tile, tile}] = score(build, req, lean_of(tile, tile, least_precision, halide), cluster, &out.plans, &memo);
          least_peak = std::min(least_peak, l[{tile, tile}].peak);
        }
        return l;
      };
      // Halide's weight gradients (wg_lever, above) where they alone fit.
      std::map<std::pair<int64_t, int64_t>, Scored> leans = leans_now(false, least[i]);
      bool halide = false;
      if (wg_lever && least[i] > budget) {
        int64_t least_halide = INT64_MAX;
        auto l = leans_now(true, least_halide);
        if (least_halide < least[i]) leans = std::move(l), least[i] = least_halide, halide = true;
      }
      if (least[i] > budget) continue;
      // Loss tiles: whole or the smallest (a [seq, vocab] tile rarely pays
      // in between); MLP tiles: every option; every precision allowed.
      for (int64_t mlp : t)
        for (int64_t loss : {int64_t{0}, t.back()})
          for (Precision pr : precisions(opts)) {
            Schedule base = in_precision(with_tiles(configs[i].base, mlp, loss), pr);
            if (halide) base = halide_wg(base);
            // (The bound saves every value, the tiles too.)
            Schedule fastest = base;
            std::erase_if(fastest.values, is_tile_rule);
            const Scored f = score(build, req, fastest, cluster, &out.plans, &memo);
            auto it = pr == least_precision ? leans.find({mlp, loss}) : leans.end();
            const Scored l =
                it != leans.end() ? it->second : score(build, req, lean_of(mlp, loss, pr, halide), cluster, &out.plans, &memo);
            options.push_back({i, base, lean_of(mlp, loss, pr, halide), f, l});
          }
    } catch (const UserError& e) {
      out.rejected.push_back({configs[i].what, reason_of(e)});
    }
  }
  for (size_t i = 0; i < configs.size(); ++i)
    if (applies[i] && least[i] != INT64_MAX && least[i] > budget)
      out.rejected.push_back({configs[i].what, std::string("every layer checkpointed") +
                                                   (can_offload ? " (its input offloaded)" : "") +
                                                   (least_precision.store ? ", saved values in bf16" : "") +
                                                   " and both regions tiled: " +
                                                   (least[i] >= kUnbuildable ? std::string(kUnbuildableWhy)
                                                                             : gib(least[i]) + " > " + gib(budget) + " per rank")});
  std::sort(options.begin(), options.end(), [](const Option& a, const Option& b) { return a.fast.step < b.fast.step; });
  std::vector<std::pair<Candidate, RematResult>> found;
  std::vector<bool> config_found(configs.size(), false);
  double best_step = INFINITY;
  for (const Option& o : options) {
    if (o.lean.peak > budget && o.fast.peak > budget) continue;
    // Keep looking while this option could beat the best, or its
    // configuration has no plan yet (for the runner-up table).
    if (o.fast.step >= best_step && config_found[o.config]) continue;
    RematResult r = solve_remat(build, req, o.base, cluster, budget, {}, opts.remat_plans, &memo);
    out.plans += r.plans;
    if (!r.feasible && can_offload && o.lean.peak <= budget) {
      // Saving or recomputing cannot fit; offloading the checkpoints does.
      r.feasible = true;
      r.schedule = o.lean_schedule;
      r.peak_bytes = o.lean.peak;
      r.step_s = o.lean.step;
      r.groups.clear(), r.recompute.clear();  // (no per-group decision)
      r.offloaded = true;
    }
    if (!r.feasible) continue;
    Candidate c{r.schedule, r.peak_bytes, r.step_s, 0};
    c.tokens_per_s = static_cast<double>(tokens_per_step(req, c.schedule)) / c.step_s;
    best_step = std::min(best_step, c.step_s);
    config_found[o.config] = true;
    found.push_back({c, r});
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first.step_s < b.first.step_s; });
  // ZeRO: the optimizer state sharded (ZeRO-1) or replicated, whichever is faster and fits.
  if (!found.empty() && ranks > 1) {
    Candidate c = found.front().first;
    c.schedule.mesh.zero = 0;
    try {
      const Scored z = score(build, req, c.schedule, cluster, &out.plans, &memo);
      if (z.peak <= budget && z.step < c.step_s) {
        c.peak_bytes = z.peak, c.step_s = z.step;
        c.tokens_per_s = static_cast<double>(tokens_per_step(req, c.schedule)) / c.step_s;
        found.insert(found.begin(), {c, found.front().second});
      }
    } catch (const UserError&) {
    }
  }
  // One plan per configuration in the table of runners-up.
  std::set<std::string> shown;
  for (auto& [c, r] : found) {
    const std::string key = std::to_string(c.schedule.mesh.sp) + "/" + std::to_string(c.schedule.mesh.zero) + "/" +
                            std::to_string(c.schedule.seq_tile) + "/" + std::to_string(c.schedule.loss_seq_tile) + "/" +
                            (c.schedule.stores_bf16() ? "bf16" : "f32") + "/" + c.schedule.contract_precision;
    if (!shown.insert(key).second) continue;
    if (out.ranked.empty()) out.remat = r;
    out.ranked.push_back(c);
    if (out.ranked.size() > opts.keep) break;
  }
  out.feasible = !out.ranked.empty();
  if (out.feasible) {
    out.ranked.front().schedule.name = "autosp";
  } else if (out.infeasible.empty()) {
    int64_t least_all = INT64_MAX;
    std::string where;
    for (size_t i = 0; i < configs.size(); ++i)
      if (least[i] < least_all) least_all = least[i], where = configs[i].what;
    out.infeasible = least_all == INT64_MAX ? "no configuration applies" +
                                                  (out.rejected.empty() ? std::string()
                                                                        : " (" + out.rejected.front().what + ": " +
                                                                              out.rejected.front().reason + ")")
                                            : least_all >= kUnbuildable
                                                ? "every plan holds " + std::string(kUnbuildableWhy) + " (" + where + ")"
                                            : "the least memory any plan needs is " + gib(least_all) + " per rank (" +
                                                  where + ", every layer checkpointed" +
                                                  (can_offload ? " and its input offloaded" : "") +
                                                  (least_precision.store ? ", saved values in bf16" : "") + ", tiled)";
    // The longest sequence that fits these ranks (when some does).
    const int lean_zero = ranks > 1 ? *std::max_element(opts.zero.begin(), opts.zero.end()) : 0;
    const int64_t fits = least_all == INT64_MAX ? 0 : longest_frugal(req.seq, lean_zero);
    if (fits > 0) out.infeasible += "; on " + std::to_string(ranks) + " ranks at most " + std::to_string(fits) + " tokens fit";
    // The fewest ranks that would fit: the same frugal schedule on more.
    for (int64_t more = ranks * 2; more <= ranks * 64 && least_all != INT64_MAX; more *= 2) {
      try {
        Schedule s = family_schedule("ulysses_checkpoint", build, req, more);
        const std::vector<int64_t> t = tile_options(local_seq(req.seq, s.mesh.sp, s.sequence_layout == "zigzag"), tile_cap);
        s = in_precision(with_tiles(s, t.back(), t.back()), least_precision);
        Cluster bigger = cluster;
        bigger.ranks = more;
        const Scored x = score(build, req, s, bigger, &out.plans, &memo);
        if (x.peak <= budget) {
          out.infeasible += "; " + std::to_string(more) + " ranks would fit (" + s.str() + ": " + gib(x.peak) + ")";
          break;
        }
      } catch (const UserError&) {
      }
    }
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

// "a,b,a" -> {a, b}: the choices in their first order, once each.
std::vector<std::string> split_choices(const std::string& list) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string b = list.substr(at, comma - at);
    if (std::find(out.begin(), out.end(), b) == out.end()) out.push_back(b);
    at = comma + 1;
  }
  return out;
}

void check_bf16_choice(const std::string& b, const std::string& list) {
  if (b != "store" && b != "contract" && b != "reduce")
    throw UserError("error: bf16 choice \"" + b + "\" (in \"" + list + "\").\nlegal: a comma-separated list of "
                    "store (saved values' copies for the backward), contract (contractions' operands) and reduce "
                    "(the gradients' sum over the ranks), or none.");
}

void check_strategy(const std::string& st) {
  const std::vector<std::string>& legal = Schedule::strategies();
  if (std::find(legal.begin(), legal.end(), st) != legal.end()) return;
  std::string names;
  for (const std::string& x : legal) names += (names.empty() ? "" : ", ") + x;
  throw UserError("error: autosp strategy \"" + st + "\".\nlegal: one or more of " + names + ".");
}

}  // namespace

std::vector<std::string> parse_bf16_choices(const std::string& list) {
  if (list == "none") return {};
  std::vector<std::string> out = split_choices(list);
  for (const std::string& b : out) check_bf16_choice(b, list);
  return out;
}

std::vector<std::string> parse_strategies(const std::string& list) {
  if (list.empty()) return {};
  std::vector<std::string> out = split_choices(list);
  for (const std::string& st : out) check_strategy(st);
  return out;
}

SearchResult autosp(const ModelBuilder& build, const ModelRequest& req, const Cluster& cluster, const SearchOptions& opts) {
  const int64_t ranks = opts.ranks > 0 ? opts.ranks : cluster.ranks;
  const int64_t budget = opts.memory_per_rank > 0 ? opts.memory_per_rank : cluster.memory_per_rank_bytes;
  if (budget <= 0)
    throw UserError("error: autosp needs the memory of each rank, and cluster \"" + cluster.name +
                    "\" does not state it.\nlegal: MEMORY_PER_RANK bytes (or --memory-per-rank 80GiB), or a cluster "
                    "with memory_per_rank_bytes.");
  if (ranks < 1) throw UserError("error: autosp on " + std::to_string(ranks) + " ranks.\nlegal: ranks >= 1.");
  for (int z : opts.zero)
    if (z != 0 && z != 1 && z != 3) throw UserError("error: autosp ZeRO stage " + std::to_string(z) + ".\nlegal: 0, 1, 3.");
  if (opts.zero.empty()) throw UserError("error: autosp with no ZeRO stage to consider.\nlegal: one or more of 0, 1, 3.");
  // (one name each: "ring,ulysses" or "none" here would match no choice)
  for (const std::string& st : opts.strategies) check_strategy(st);
  for (const std::string& b : opts.bf16) check_bf16_choice(b, join(opts.bf16, ","));  // (named as a --bf16 list)
  if (!opts.bf16.empty() && req.precision != "f32")
    throw UserError("error: autosp with bf16 choices, and plan precision " + req.precision +
                    ", which counts every value in bf16 already.\nfix: plan precision f32 with the bf16 choices (what "
                    "the libraries run), or " + req.precision + " without them (planned only).");
  if (allows(opts, "contract")) {
    const auto bf16 = cluster.peak_flops.find("bf16"), f32 = cluster.peak_flops.find("f32");
    if (bf16 == cluster.peak_flops.end() || (f32 != cluster.peak_flops.end() && bf16->second <= f32->second))
      throw UserError("error: autosp may compute contractions in bf16, but cluster \"" + cluster.name +
                      "\" states no bf16 peak above its f32 one: its ranks have no faster bf16 arithmetic (Halyard's "
                      "CPU kernels decode bf16 to f32), so bf16 contractions would only add copies.\nfix: allow bf16 "
                      "store alone on such ranks; contract is for clusters with tensor cores (the GPU presets, or a "
                      "cluster file with a bf16 peak_flops).");
  }
  for (int64_t sp : opts.sp)
    if (sp < 1 || ranks % sp != 0)
      throw UserError("error: autosp sp degree " + std::to_string(sp) + " does not divide " + std::to_string(ranks) +
                      " ranks.\nlegal: " + [&] {
                        std::string s;
                        for (int64_t d : divisors(ranks)) s += (s.empty() ? "" : ", ") + std::to_string(d);
                        return s;
                      }() + ".");

  SearchOptions o = opts;
  o.ranks = ranks, o.memory_per_rank = budget;
  for (int attempt = 0;; ++attempt) {
    SearchResult r = search(build, req, cluster, o);
    if (!r.feasible || !deep(build, req)) return r;
    // The choice planned at full depth: the extrapolation from a few layers
    // is checked, and the search repeated with less memory if it missed.
    ModelRequest full = req;
    full.seq = r.seq;
    const Plan p = plan(build, full, r.best().schedule, cluster);
    ++r.plans;
    Candidate& c = r.ranked.front();
    c.peak_bytes = p.memory.total(), c.step_s = p.step_s;
    c.tokens_per_s = static_cast<double>(tokens_per_step(full, c.schedule)) / c.step_s;
    if (c.peak_bytes <= budget || attempt == 2) {
      if (c.peak_bytes > budget) r.feasible = false, r.infeasible = "the extrapolated plan misses at full depth";
      return r;
    }
    o.memory_per_rank -= (c.peak_bytes - budget) + (int64_t{1} << 20);
  }
}

}  // namespace halyard
