// AutoSP: the scheduler. Given a model, a cluster and the memory each rank
// has, it chooses the schedule: the mesh (dp x sp), the head redistribution
// of every attention, the sequence tiles of the MLP and of the LM head + loss,
// the ZeRO stage, and for every forward value whether the backward reads a
// saved copy or recomputes it. Every candidate is scored by plan(), so what
// the search optimizes is exactly what plan() predicts (and what
// halyard-plan, the generated header and llama_train print).
//
//   SearchResult r = autosp(llama_builder(), {config, 1, 131072}, Cluster::named("8xA100-80GB"), {});
//   r.best().schedule.to_json()   // pin it: a schedule file like any other
//
// The recompute decision (solve_remat) is per group: one module in every
// layer computed by one op ("model.layers.*.mlp.gate_proj op:contract"), so
// the answer is the same for identical layers and is a list of rules. It is a
// budgeted 0/1 problem: minimize predicted step time subject to predicted
// peak <= budget, with plan() as the only judge. Recomputing more never
// takes less time and, within layers, never more memory; so a branch and
// bound that takes nodes in order of time and cuts those that cannot fit is
// exact: the first completion that fits is the optimum (the tests check both
// properties and compare with enumerating plan() over every decision). Past
// a cap on plan() calls it returns the best found and a proven lower bound.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "schedules/plan.h"

namespace halyard {

// One recompute decision: every forward value whose label is `module` with
// the layer index as '*' and whose op is `op`; the wide tiles of a tiled
// region (tiling.h) are groups of their own (`tile`).
struct RematGroup {
  std::string module;  // "model.layers.*.mlp.gate_proj"
  std::string op;      // "contract"
  bool tile = false;   // the module's wide sequence tiles
  int64_t values = 0;  // forward values it covers, all layers
  int64_t bytes = 0;   // their bytes
  // Every value computed by its own layer from parameters and inputs alone
  // (the embedding): recomputing it recomputes no other layer.
  bool from_inputs = false;
  bool layer_output = false;  // read by another layer, and not from_inputs: kept (what full checkpointing keeps)
  bool inlined = false;       // computed inside its consumers (the schedule's compute rules)
  std::string match() const { return module + " op:" + op + (tile ? " seq_tiles" : ""); }
};

// The groups of a scheduled forward graph: named values that are not inputs,
// parameters or views. A tiled region's wide tiles form groups apart from
// whole values: recomputing them per tile is what makes tiling save memory,
// and keeping them (the logits of a loss tiled for a GPU's 32-bit indexing,
// say) is the faster choice where they fit.
std::vector<RematGroup> remat_groups(const Graph& g, const Schedule& base);

// `base` with one rule per group (recompute where `recompute[i]`, else save;
// offload where `offload[i]`, when given): the whole values' rules before
// base's sequence-tile rule, the tiles' after it.
Schedule with_recompute(const Schedule& base, const std::vector<RematGroup>& groups, const std::vector<bool>& recompute,
                        const std::vector<bool>& offload = {});

struct RematResult {
  bool feasible = false;
  std::vector<RematGroup> groups;
  std::vector<bool> recompute;  // per group
  // Per group (on a cluster with a host link): read back from host memory
  // instead of recomputed, where the offload pass found that faster and
  // within the budget. Empty when nothing is offloaded.
  std::vector<bool> offload;
  double recompute_step_s = 0;  // the save-or-recompute decision's step, before the offload pass
  Schedule schedule;            // base with the decisions
  int64_t peak_bytes = 0;       // predicted peak of the choice (or of the least-memory decision when infeasible)
  double step_s = 0;
  int64_t least_peak_bytes = 0;  // the least peak any decision seen reaches
  int plans = 0;                 // plan() calls made
  bool exhaustive_bound = true;  // false when the search stopped at its cap before proving the optimum
  double lower_bound_s = 0;      // no decision that fits is faster than this (proven)
  // No decision to save or recompute fits, and the choice is instead the
  // least-memory schedule with the checkpoints offloaded (offloaded_checkpoint_rules).
  bool offloaded = false;
};

// The scores one search has planned, by everything plan() reads but the
// builder (one builder per memo): a search meets the same schedule from
// several sides (the frugal schedules at each length, one option's decisions
// and another's), and a 70B probe takes tens of milliseconds to plan. With
// one, solve_remat answers a schedule planned before without planning it
// again (or counting it in `plans`).
struct ScoreMemo {
  std::map<std::string, std::pair<int64_t, double>> seen;  // peak bytes, step seconds
};

// The fastest decision whose predicted peak fits `budget` (bytes per rank).
// Groups default to remat_groups() of base's graph. After `max_plans` plan()
// calls it returns the best found so far with the proven lower bound. On a
// cluster with a host link an offload pass follows: each recomputed group of
// heavy values, the costliest to recompute first, is offloaded instead when
// plan() says that is faster and fits (the bound is then that of the
// save-or-recompute problem, which offloading only improves on).
RematResult solve_remat(const ModelBuilder& build, const ModelRequest& req, const Schedule& base, const Cluster& cluster,
                        int64_t budget, std::vector<RematGroup> groups = {}, int max_plans = 400,
                        ScoreMemo* memo = nullptr);

// Full checkpointing: cheap values inside their consumers, every layer's
// values recomputed but its output (the residual stream) kept.
std::vector<ValueRule> layer_checkpoint_rules();
// The same, with what it keeps (each layer's input, the residual stream)
// offloaded to host memory between forward and backward: ALST's offload, the
// least memory on a cluster with a host link (GPUs), where the search's
// least-memory schedules use it.
std::vector<ValueRule> offloaded_checkpoint_rules();

// The families a user would otherwise pick, for comparison tables: default
// (one rank), dp_zero3, ulysses, ulysses_checkpoint, ulysses_sac,
// ulysses_offload (GPU clusters), and autosp.
// The Ulysses ones take the largest degree the model allows on the ranks.
struct Family {
  std::string name;         // "ulysses_checkpoint"
  std::string title;        // "Ulysses + full checkpointing"
  std::string description;  // what it keeps and recomputes
};
const std::vector<Family>& families();
// The family of that name; throws UserError listing the names.
const Family& family_named(const std::string& name);

struct Candidate {
  Schedule schedule;
  int64_t peak_bytes = 0;
  double step_s = 0;
  double tokens_per_s = 0;
};

struct Rejection {
  std::string what;    // "ulysses at sp=16", "sp=1 (dp=8), tiles 0/0"
  std::string reason;  // "8 heads", "every value recomputed: 91.2 GiB > 80 GiB"
};

struct SearchOptions {
  int64_t ranks = 0;            // 0: the cluster's
  int64_t memory_per_rank = 0;  // 0: the cluster's
  std::vector<int64_t> sp;      // degrees to consider (empty: every divisor of ranks)
  bool max_seq = false;         // find the longest sequence that fits, then the fastest plan there
  int64_t seq_step = 0;         // granularity of the longest-sequence search (0: 1024, or ranks*8 when smaller)
  int64_t seq_limit = int64_t{1} << 26;  // longest sequence tried
  size_t keep = 5;              // how many runner-up plans to report
  int remat_plans = 60;         // plan() calls per recompute search before it settles for its bound
  std::vector<int> zero = {1, 3};  // ZeRO stages to consider on more than one rank (3 is planned only)
  // The head redistributions to consider where the sequence is split (of
  // Schedule::strategies(); ring in both layouts). Empty: every one.
  std::vector<std::string> strategies;
  // What the search may hold or compute in bf16: the numerics are the
  // user's to allow, and f32 stays a candidate. "store": every saved value's
  // copy for the backward in bf16 (a rule {"match": "*", "store": "bf16"});
  // "contract": contractions read bf16 copies of their operands
  // (contract_precision "bf16"), only on clusters whose bf16 peak is above
  // their f32 one (tensor cores; Halyard's CPU kernels decode bf16 to f32);
  // "reduce": the gradients summed over the ranks from bf16
  // (grad_reduce_precision "bf16": half the bytes, never slower, so taken
  // wherever there are ranks). Empty: f32 only. The search takes the fastest
  // that fits; with "store", its least-memory schedules store bf16 (the
  // longest sequence is longer).
  std::vector<std::string> bf16;
};

// "store,contract", "store" or "none" as SearchOptions::bf16 (the flag
// --bf16 of halyard-plan and llama_aot); throws UserError naming the choices.
std::vector<std::string> parse_bf16_choices(const std::string& list);

// "ulysses,ring" as SearchOptions::strategies (the flag --strategies of
// halyard-plan and llama_aot; empty: every one); throws UserError naming
// Schedule::strategies().
std::vector<std::string> parse_strategies(const std::string& list);

struct SearchResult {
  bool feasible = false;
  int64_t seq = 0;                    // the sequence planned (the longest found with max_seq)
  std::vector<Candidate> ranked;      // feasible plans, fastest first (ranked[0] is the choice)
  std::vector<Rejection> rejected;    // families that cannot apply or do not fit, and why
  RematResult remat;                  // the chosen plan's recompute decision
  int plans = 0;                      // plan() calls made
  double seconds = 0;
  std::string infeasible;             // when nothing fits: the error text (least memory, fewest ranks, closest plan)
  const Candidate& best() const { return ranked.front(); }
};

// The fastest plan (tokens/s) for `req` on `cluster`, or the longest sequence
// (opts.max_seq) and the fastest plan at it.
SearchResult autosp(const ModelBuilder& build, const ModelRequest& req, const Cluster& cluster, const SearchOptions& opts);

// The schedule a family uses on `ranks` ranks for this model (the largest
// legal Ulysses degree); throws UserError naming why it cannot apply.
Schedule family_schedule(const std::string& family, const ModelBuilder& build, const ModelRequest& req, int64_t ranks);

// The longest sequence (a multiple of `step`, at most `limit`) at which
// peak_at(seq) <= budget; 0 when none does. Memory grows with the sequence
// and nearly linearly, so a secant step from two probes, then bisection
// around it, finds it in a few plans.
int64_t longest_fitting_seq(const std::function<int64_t(int64_t seq)>& peak_at, int64_t budget, int64_t step,
                            int64_t limit, int* plans = nullptr);

// A family's longest trainable sequence on `ranks` ranks with `budget` bytes
// per rank, and its plan there; with every bf16 choice opts.bf16 allows
// (compared at the search's numerics).
struct FamilyResult {
  std::string family;
  bool applies = true;
  std::string reason;     // why not, when it does not apply or fit at all
  Schedule schedule;      // at the longest sequence (autosp: the chosen one)
  int64_t longest = 0;    // tokens per row
  int64_t peak_bytes = 0;
  double step_s = 0, tokens_per_s = 0;
  bool modelled = false;  // planned only (ZeRO-3: llama_train runs ZeRO 0 and 1)
};
// `family`: one of families().
FamilyResult family_longest(const std::string& family, const ModelBuilder& build, const ModelRequest& req,
                            const Cluster& cluster, int64_t ranks, int64_t budget, const SearchOptions& opts);

}  // namespace halyard
