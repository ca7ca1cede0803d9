// A schedule as plain data: what a model's joint graph is lowered with.
//
// Like Halide's Schedule, it is a value that prints, compares, serializes and
// diffs; directives only edit it. It says:
//   - the mesh the step runs on (dp x sp ranks, ZeRO stage of the optimizer);
//   - split_sequence(sp): activations split on seq over the mesh axis sp, and
//     per attention (by name pattern) how heads are redistributed (ulysses);
//   - per forward value (rules matched by op, op class or name pattern, the
//     last matching rule wins) whether the backward reads a saved copy,
//     recomputes it, or reads a copy held in host memory between the
//     forward and the backward (`keep`: save, recompute, offload; offload on
//     GPU targets), and whether a cheap value is computed inside
//     each consumer's kernel instead of being stored (`compute: inline`, like
//     Halide's compute_inline);
//   - per saved value, the precision of the copy the backward reads
//     (`store`: f32, or bf16, half the bytes; schedules/precision.h), and
//     the precision contractions read their operands in;
//   - the sequence tiles of the MLP and of the LM head + loss;
//   - kernel loops: Halyard's hand-written schedules (with the loop tiles
//     that are a real choice) or an autoscheduler.
// Presets (default, recompute, checkpoint, tiled, ulysses, ...) are schedules
// written in this vocabulary.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "dsl/graph.h"

namespace halyard {

// The ranks a step runs on: dp data-parallel replicas of sp ranks that split
// each sequence. zero = 1 shards the optimizer state over all dp x sp ranks;
// zero = 3 also the parameters and gradients (planned only: the runtime
// runs 0 and 1).
struct Mesh {
  int64_t dp = 1, sp = 1;
  int zero = 0;
  int64_t ranks() const { return dp * sp; }
  bool operator==(const Mesh&) const = default;
};

// Loop tiles of the hand-written CPU kernels where they are a real choice
// (0: derived from the shapes, as generators/schedule_cpu.cpp does).
struct KernelTiles {
  int attention_queries = 0;  // queries per tile of the forward, statistics and dQ kernels
  int attention_keys = 0;     // keys per tile of the dK/dV kernel
  bool operator==(const KernelTiles&) const = default;
};

enum class Keep { Save, Recompute, Offload };
enum class Compute { Root, Inline };

// Which values a rule addresses: space-separated terms that must all match.
//   *                  every value
//   op:NAME            values computed by that op (the op table's names)
//   class:CLASS        cheap | heavy | runtime (the op table's cost classes)
//   seq_tiles          the tiles sequence tiling creates (wide values, slices)
//   a name pattern     the value's label or a module holding it, '*' matching
//                      any run of characters: model.layers.*.mlp (and all
//                      inside it), model.layers.0.self_attn.q_proj, lm_head
struct ValueRule {
  std::string match;
  std::string keep;     // "" (unchanged), "save", "recompute" or "offload"
  std::string compute;  // "" (unchanged), "root" or "inline"
  // "" (unchanged), "f32" or "bf16": the copy the backward reads of a value
  // it reads saved (or offloaded); the forward reads the f32 value, but for
  // attention's operands (schedules/precision.h).
  std::string store;
  bool operator==(const ValueRule&) const = default;
};

// Head redistribution of the attentions whose label matches (same patterns).
// Hybrid (USP, LoongTrain's 2D): sp = u x r ranks; Ulysses all-to-alls
// within groups of u consecutive ranks (mesh axis "sp_u"), ring passes
// across the r groups (mesh axis "sp_r"); `ulysses_degree` is u.
struct AttentionRule {
  std::string match;
  std::string strategy;  // "ulysses", "ring" or "hybrid"
  int64_t ulysses_degree = 0;  // hybrid only
  bool operator==(const AttentionRule&) const = default;
};

struct Schedule {
  std::string name = "default";
  Mesh mesh;
  // split_sequence(sp): activations are split on seq over this mesh axis
  // ("" = one rank holds the whole sequence).
  std::string split_sequence;
  // Per attention, in order (the last match wins); with a split sequence
  // every attention needs a strategy.
  std::vector<AttentionRule> attention;
  // Which tokens each of the sp ranks holds: "contiguous" (rank r the r-th
  // slice), or "zigzag" (the sequence cut in 2*sp chunks, rank r holding
  // chunks r and 2*sp-1-r, so that causal ring attention gives every rank
  // the same work; ring attention only).
  std::string sequence_layout = "contiguous";
  // Per forward value, in order (the last match wins). Unmatched values are
  // saved and stored (root).
  std::vector<ValueRule> values;
  // tile_sequence(T): the MLP and the LM head + loss run in tiles of T tokens
  // (schedules/tiling.h); 0 = whole sequence. loss_seq_tile, when > 0, gives
  // the LM head + loss their own tile (its [seq, vocab] is often the widest).
  int64_t seq_tile = 0;
  int64_t loss_seq_tile = 0;
  int64_t loss_tile() const { return loss_seq_tile > 0 ? loss_seq_tile : seq_tile; }
  // "" for the hand-written loop schedules, or a Halide autoscheduler name.
  std::string autoscheduler;
  // Adams2019's beam: how many candidate schedules its search keeps per
  // step; compile time grows with it (the micro Llama's 41 kernels: 277 s at
  // 32, 31-45 s at 2; AMD EPYC Zen 4). 1 is refused (schedule.cpp says why).
  int autoscheduler_beam_size = 32;
  KernelTiles kernel_tiles;
  // Attention's kernels: "library" (runtime/attention_cpu.h, FlashAttention-2:
  // one backward pass writes dQ, dK and dV; a recomputed log-sum-exp is
  // its forward without P V) or "halide" (generated: a dQ
  // kernel and a dK/dV kernel). On a CUDA target the library's are
  // runtime/attention_cuda.h's. Other GPU targets and the autoscheduler
  // always get Halide's.
  std::string attention_kernel = "library";
  // (Ring attention's key blocks too: the library's _ring entry points
  // take their tokens' indices.)
  bool library_attention() const { return attention_kernel == "library" && autoscheduler.empty(); }
  // Weight-gradient contractions (a sum over the tokens, schedules/partition.h:
  // weight_grad_form): "library" (runtime/gemm_cpu.h, a packed GEMM; an
  // operand computed inline is computed once into a whole copy, which the
  // plan counts) or "halide" (generated). GPU targets and the autoscheduler
  // get Halide's.
  std::string weight_grad_kernel = "library";
  bool library_weight_grad() const { return weight_grad_kernel == "library" && autoscheduler.empty(); }
  // Contractions that are one GEMM over their buffers (schedules/partition.h:
  // gemm_form): "cublas" (the runtime's device GEMM, runtime/gemm.h, through
  // cuBLAS; CUDA targets only), "halide" (generated), or "auto" (the
  // default): cuBLAS on CUDA targets, Halide's on CPU ones (halyard_aot
  // makes it "cublas" for a CUDA target before it plans).
  std::string contract_kernel = "auto";
  static const std::vector<std::string>& contract_kernels();
  // What every contraction reads, forward and backward (mixed precision):
  // "f32" (the default), or "bf16": its f32 operands rounded to bf16 (one
  // copy of each value, shared by every contraction reading it: an
  // activation's is also what the weight gradient reads; a weight gets one
  // in the forward and one in the backward), products summed in f32 into
  // an f32 output. On a CUDA target the
  // GEMMs are cuBLAS's bf16 GEMM on tensor cores; elsewhere the kernels
  // decode the copies (schedules/precision.h: round_contractions).
  std::string contract_precision = "f32";
  // The gradients' sum over the mesh after the backward (ZeRO-1's
  // reduce-scatter, or the all-reduce without ZeRO): "f32" (the default), or
  // "bf16": each rank's gradients rounded to bf16 on the wire and summed in
  // f32 (runtime::Communicator::reduce_scatter_sum_bf16), half the bytes.
  // The runtime does the sum; llama_train follows the library's plan.
  std::string grad_reduce_precision = "f32";
  // The legal values of both precisions.
  static const std::vector<std::string>& precisions();
  // The kernels a GPU runs, "auto" decided: weight gradients are Halide's
  // (the library's are CPU code); attention keeps the schedule's choice on
  // CUDA (the library's CUDA kernels, runtime/attention_cuda.h) and is
  // Halide's on other devices; GEMM-form contractions are cuBLAS's on CUDA
  // and Halide's on other devices (an explicit "halide" stays). halyard_aot applies it for a GPU target, and
  // plan() for a GPU cluster, so that a plan counts the kernels its library runs.
  Schedule on_gpu(bool cuda) const;

  // Decisions for one value (inputs and parameters are always buffers).
  Keep keep(const Node& n) const;
  bool offloads() const;  // a value rule says keep "offload"
  bool stores_bf16() const;  // a value rule says store "bf16"
  Compute compute(const Node& n) const;
  bool stores_bf16(const Node& n) const;  // the backward's copy of n is bf16 (by the rules; f32 unless one says so)
  // The strategy of an attention node ("" when the sequence is not split),
  // and the rule that gives it (nullptr then).
  std::string strategy(const Node& attention) const;
  const AttentionRule* attention_rule(const Node& attention) const;
  // The predicate grad() uses: forward values the backward recomputes
  // (empty when none is). It holds a copy of the rules.
  std::function<bool(const Node&)> rematerialize() const;
  // Checks every rule against the graph: a rule that matches nothing, inline
  // on a value that is not cheap, or recompute of an input is an error naming
  // the value, the rule and the legal choices.
  void check(const Graph& g) const;

  bool operator==(const Schedule&) const = default;
  std::string to_json() const;
  std::string str() const;  // one line, for plan reports and generated headers

  // A preset (presets()) or a path to a schedule .json file.
  static Schedule named(const std::string& name_or_path);
  static Schedule parse(const std::string& json_text, const std::string& what);
  static const std::vector<std::string>& presets();
  // The head redistributions the vocabulary offers (what the search tries).
  static const std::vector<std::string>& strategies();
  static const std::vector<std::string>& sequence_layouts();
  static const std::vector<std::string>& attention_kernels();  // (also the weight-gradient kernels)
};

// Rules of the classic policies, for presets and for the search.
std::vector<ValueRule> inline_cheap_rules();      // norms, RoPE, SiLU, products inside their consumers
std::vector<ValueRule> checkpoint_rules();        // recompute all but what the op table says checkpointing keeps
ValueRule recompute_seq_tiles_rule();             // tiles recomputed per tile in the backward

// '*' matches any run of characters.
bool glob_match(std::string_view pattern, std::string_view text);

}  // namespace halyard
