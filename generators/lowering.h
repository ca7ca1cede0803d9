// Lowering one stage of a scheduled graph to a Halide pipeline.
//
// The algorithm (lower.cpp) turns each node of the stage into Halide Funcs:
// named axes become Vars (the last axis is Halide's innermost dimension),
// contracted axes become RDoms, inlined nodes become Funcs that Halide inlines
// or computes inside the consumer. The loop schedule is applied afterwards:
// Halyard's hand-written CPU schedules (schedule_cpu.cpp), a GPU-legal
// schedule for CUDA targets (schedule_gpu.cpp), or Halide's autoscheduler.
#pragma once

#include <Halide.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dsl/graph.h"
#include "schedules/partition.h"
#include "schedules/schedule.h"

namespace halyard {

// A product of two matrices inside attention: `wrapper` stores what the
// accumulator `acc` sums; `col` is vectorized, `row` register-blocked.
struct AttentionProduct {
  Halide::Func wrapper, acc;
  Halide::Var col, row;
};

// The Funcs of an attention kernel, for its schedule.
struct AttentionFuncs {
  int kind = -1;                               // the Op (as int), -1 for other kernels
  int S = 0, D = 0, grp = 1;
  Halide::Var tile_var;                        // the output axis tiled: queries (i) or keys (j)
  std::vector<AttentionProduct> products;      // scores, dP: computed per tile
  std::vector<Halide::Func> pointwise;         // probabilities, dS: per tile, vectorized
  std::vector<Halide::Func> row_reductions;    // row max and sum: per tile
  std::vector<AttentionProduct> row_products;  // GPU only: each row reduction's own scores
  Halide::Func out_acc;                        // the output's accumulator (register tile)
};

// What the schedulers need to know about the Funcs a stage was lowered to.
struct StageFuncs {
  Halide::Func out;                         // the root, named "out"
  std::vector<Halide::Func> extra_outs;     // outputs of other shapes, one per Stage::extra_outputs (attention's
                                            // log-sum-exp; the library backward's dV and dQ), or none (a Tuple)
  std::vector<Halide::Var> out_vars;        // Halide order (innermost first)
  std::vector<Halide::Func> small;          // per-token/row helpers (norm scales, lse)
  std::vector<Halide::Func> tables;         // per-token tables worth computing in parallel (RoPE's cos, sin)
  std::vector<Halide::Func> staged;         // operands a heavy op reads many times
  std::vector<Halide::Func> root_copies;    // transposed copies computed once per call
  AttentionFuncs attn;                      // attention kernels only (attn.kind >= 0)
  bool library = false;                     // `out` is an extern call writing the outputs: a library kernel
                                            // (Stage::library) or the runtime's GEMM (Stage::gemm)
  bool is_contract = false;
  Halide::RDom contract_rdom;
  Halide::Func contract_acc;                // the reduction; `out` copies it
  int contract_b_operand = -1;              // which operand supplies the innermost output axis
  // ... read from a copy in panels (ContractLayout): the accumulator's
  // vars for a column within a panel and for the panel (acc(vi, rows..., vo)).
  std::vector<Halide::Var> contract_panel_vars;
};

struct LoweredStage {
  Halide::Pipeline pipeline;
  std::vector<Halide::Argument> args;       // the stage's input buffers, in order
  StageFuncs funcs;
  std::vector<Halide::ImageParam> inputs;
};

// Builds the algorithm of a stage (no schedule yet). `for_autoscheduler`
// reduces contractions straight into the output: with a separate accumulator
// Func, Adams2019's tiles read past input edges (Halide issue #5070).
// Library kernels are extern stages; their addresses are set as the
// pipeline's JIT externs, so JIT and AOT callers alike need nothing more.
// vector_floats: the target's vector of floats (0: the host's), the width
// of a contraction's panels of B. library_device: where the runtime's calls
// run, a Stage::gemm contraction's GEMM (runtime/gemm.h) and library
// attention: CUDA for CUDA targets (cuBLAS; runtime/attention_cuda.h); Host
// runs the runtime's reference GEMM, which the tests compare with Halide's,
// and the CPU attention kernels. gpu: the stage will be scheduled by
// schedule_gpu (attention's row statistics then get scores of their own).
LoweredStage lower_stage(const Graph& g, const Stage& st, bool for_autoscheduler = false, const KernelTiles& tiles = {},
                         int vector_floats = 0, Halide::DeviceAPI library_device = Halide::DeviceAPI::Host,
                         bool gpu = false);

// The data caches the CPU schedules size their blocks by. Halide's Target
// carries no cache sizes, so they are read from the build host (sysfs); the
// defaults (32 KiB, 1 MiB) stand where it tells nothing. An AOT library is
// tuned for the machine that builds it: the README's flow builds where it runs.
struct CacheSizes {
  int64_t l1d = 32 << 10, l2 = 1 << 20;
};
CacheSizes build_host_caches();

void schedule_cpu(LoweredStage& ls, const Graph& g, const Stage& st, const Halide::Target& t,
                  const KernelTiles& tiles = {});
void schedule_gpu(LoweredStage& ls, const Graph& g, const Stage& st, const Halide::Target& t);
// Sets input and output estimates from the graph's types (autoscheduler, bounds).
void set_estimates(LoweredStage& ls, const Graph& g, const Stage& st);

// The Halide type a value of `t` is computed in, and the one its buffers hold:
// the same but for bf16, computed in f32 and stored as UInt(16) (bf16.h).
Halide::Type halide_type(DType t);
Halide::Type halide_storage_type(DType t);

// The library kernels (runtime/attention_cpu.h, gemm_cpu.h) as a pipeline
// JIT-compiled in this process calls them: programs that realize lowered
// stages call use_library_kernels_in_jit() (generators/jit_library.h) once,
// before lowering. AOT builds need nothing: a generated library calls the
// kernels by name and the program linking it links them, so the generators
// themselves do not (and a kernel change regenerates no model).
void set_library_jit_externs(std::map<std::string, Halide::JITExtern> externs);

// The lowering of an elementwise op added through the op table
// (dsl/op_table.h: register_op): its output element from its operands'
// elements at the same index.
void register_pointwise_lowering(Op op, std::function<Halide::Expr(const std::vector<Halide::Expr>&)> element);
std::map<int, std::function<Halide::Expr(const std::vector<Halide::Expr>&)>>& pointwise_lowerings();

}  // namespace halyard
