// The plan: what one rank of a mesh runs for a model under a schedule, and
// what it is predicted to cost there. One library call shared by the
// generator (which compiles exactly the plan's stages), halyard-plan, the
// calibration tool and the tests; scoring a plan compiles nothing.
//
//   Plan p = plan(build, {config, batch, seq}, Schedule::named("ulysses"), Cluster::named("8xA100-80GB"));
//   p.step_s, p.memory.total(), p.collectives, p.report()
//
// The pipeline, in order: build the model at one rank's slice of the
// sequence; shard it over sp (schedules/sharding.h); tile the sequence
// (schedules/tiling.h); check the schedule's rules against the graph;
// differentiate, recomputing what the schedule says; partition into stages
// and plan the static memory (schedules/partition.h, schedules/program.h);
// then cost every stage and collective with the cluster's coefficients and
// add up the memory a rank holds.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dsl/graph.h"
#include "schedules/cluster.h"
#include "schedules/partition.h"
#include "schedules/program.h"
#include "schedules/schedule.h"

namespace halyard {

// A model as its example builds it (at one rank's slice of the sequence).
struct BuiltModel {
  std::unique_ptr<Graph> graph;
  Value loss;
  std::vector<Value> params;
  std::map<std::string, std::vector<int64_t>> hf_shapes;
  int64_t vocab = 0;
  int64_t ignore_index = -100;
  std::string config_json;
  int64_t layers = 0;  // repeated layers (model.layers.N) the model has
};

// A model's graph (any struct with graph, loss, params and hf_shapes, as
// the examples' build functions return) as plan() takes it.
template <class ModelGraph>
BuiltModel built_model(ModelGraph m, int64_t vocab, std::string config_json, int64_t layers) {
  BuiltModel b;
  b.graph = std::move(m.graph);
  b.loss = m.loss;
  b.params = std::move(m.params);
  b.hf_shapes = std::move(m.hf_shapes);
  b.vocab = vocab;
  b.config_json = std::move(config_json);
  b.layers = layers;
  return b;
}

// Builds a model at one rank's slice of the sequence; `layers` > 0 builds
// that many of its repeated layers instead of the config's (what the
// search extrapolates from: every layer is the same).
using ModelBuilder =
    std::function<BuiltModel(const std::string& config_path, int64_t batch, int64_t seq, int64_t layers)>;

struct ModelRequest {
  std::string config;  // path to the model's config.json
  int64_t batch = 1;
  int64_t seq = 0;  // global tokens per row
  // "f32": what Halyard's CPU libraries run. "bf16-mixed" (planned only, for
  // GPU clusters): activations, parameters and gradients in bf16 (half the
  // bytes of every value), f32 master weights and AdamW moments (12 bytes
  // per parameter, sharded by ZeRO-1).
  std::string precision = "f32";
  int64_t layers = 0;  // build this many layers instead of the config's (0: as configured)
};

struct StageCost {
  int stage = -1;
  std::string kind;   // a kernel kind (cluster.h), or the collective's name
  std::string label;  // op, node and name
  std::string layer;  // "model.layers.3", "lm_head", ... ("" when unnamed)
  bool backward = false;
  double flops = 0;
  // What the time model charges: flops at the bf16 rate, where f32 work on a
  // cluster with a bf16 peak counts peak_bf16 / peak_f32 times (plan()).
  double charged_flops = 0;
  int64_t bytes = 0;  // read + written
  int64_t scratch_estimate = 0;  // temporaries the lowering allocates for the cluster's device (kernel_scratch's estimate)
  double time_s = 0;
  double start_s = 0;  // from the step's start, on the kernels' track
};

struct CollectiveCost {
  int stage = -1;     // in the train program; -1 for the gradient reduction
  std::string op;     // seq_to_heads, heads_to_seq, gather_seq, all_reduce, all_reduce_grads, ...
  std::string kind;   // all_to_all, all_gather, all_reduce (the cluster's coefficient)
  std::string axis;   // mesh axis: "sp", "dp,sp"
  int64_t degree = 1;
  int64_t bytes_per_rank = 0;  // what each rank sends
  double time_s = 0;
  double start_s = 0;  // from the step's start, on the communication's track
};

// Bytes one rank holds at its peak, by what holds them.
struct MemoryBreakdown {
  int64_t parameters = 0, gradients = 0, optimizer_state = 0;
  int64_t activations = 0;         // the static arena (forward values kept for the backward, and transients)
  int64_t kernel_scratch = 0;      // kernels' temporaries: the most one keeps on the heap plus the most one maps
  int64_t collective_buffers = 0;  // staging of all-to-alls and gathers
  int64_t data = 0;                // token ids, labels and positions (the loader's and the model's copies)
  int64_t runtime_baseline = 0;    // the process before the model (libraries, MPI or the CUDA context)
  // Host memory holding offloaded values between forward and backward: not
  // the device's, so neither in items() nor in total().
  int64_t offloaded = 0;
  int64_t total() const;
  std::vector<std::pair<std::string, int64_t>> items() const;
};

struct Plan {
  Schedule schedule;
  Cluster cluster;
  ModelRequest request;
  int64_t local_seq = 0;  // tokens per row on each rank
  BuiltModel model;       // the scheduled joint graph (forward and backward) and its parameters
  std::vector<int> param_ids, grad_ids;
  int64_t num_params = 0;  // parameter elements
  Partition train, forward;
  Program train_program, forward_program;

  std::vector<StageCost> stages;  // the train program's kernels, in order
  std::vector<CollectiveCost> collectives;  // in the order they start; the gradients' sum bucket by bucket
  MemoryBreakdown memory;
  // communication_s is every collective's time; the step waits for
  // exposed_communication_s of it (the rest runs under the kernels).
  double compute_s = 0, communication_s = 0, exposed_communication_s = 0, optimizer_s = 0;
  double offload_s = 0;  // offloaded values out to the host and back (not overlapped yet)
  // Collectives the kernels' track waits on in a step, and the lags they
  // wait for (Cluster::lag_share summed): collective_lags times the
  // cluster's collective_lag_s is in exposed_communication_s.
  int collective_waits = 0;
  double collective_lags = 0;
  double step_s = 0;  // predicted: train step (kernels and the communication they wait for) plus the optimizer update
  // On a GPU cluster, a Halide kernel's tensor beyond 32-bit indexing
  // (partition.h: gpu_index_overflow), said as the generator refuses it;
  // "" when the library would build. The search counts such a plan as not
  // fitting.
  std::string gpu_unbuildable;

  double flops() const;
  // Saved values the backward reads as bf16 copies (schedules/precision.h):
  // the graph's store_bf16 nodes.
  int stored_bf16() const;
  // The step's useful work on a rank: the forward program's FLOPs and twice
  // them for the backward (the convention of model-FLOP utilization). Neither
  // recompute nor a backward kernel's second pass over the scores counts.
  double model_flops() const;
  // The attention FLOPs of one train step (forward and backward kernels) on
  // each sp rank: with ring attention, each rank's queries see a different
  // share of the key blocks (contiguous: the last rank sees every block,
  // the first only its own; zigzag evens them out), though every block's
  // scores are computed whole (dsl/op_table.h: ring_block_flops). Other
  // kernels do the same work on every rank.
  std::vector<double> attention_flops_per_rank() const;
  int64_t collective_bytes_per_rank() const;
  // The train program's arena at its fullest: the first call where the
  // bytes of the buffers alive on the device are the most, and those
  // buffers (indices into train_program.buffers), largest first. What to
  // recompute, tile or offload to fit is among them. The arena's size can
  // exceed live_bytes by what placement leaves between buffers.
  struct ArenaPeak {
    int call = -1;
    int64_t live_bytes = 0;
    std::vector<int> buffers;
  };
  ArenaPeak arena_peak() const;
  // A table a person reads: stages grouped by layer, memory, time, volume.
  std::string report() const;
  // The whole plan as JSON; summary_json() is what a library carries.
  std::string to_json() const;
  std::string summary_json() const;
};

// Plans `request` under `schedule` (its mesh says the ranks) on `cluster`.
// Throws UserError for a schedule the model cannot take.
Plan plan(const ModelBuilder& build, const ModelRequest& request, const Schedule& schedule, const Cluster& cluster);

// The layer a value's label belongs to: "model.layers.3.self_attn" ->
// "model.layers.3"; a label outside the layers is its own ("lm_head").
std::string layer_of(const std::string& label);

// The kernel kind a stage's root belongs to (the time model's classes).
std::string stage_kind(const Graph& g, const Node& root);

}  // namespace halyard
