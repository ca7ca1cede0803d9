// A GPU-legal schedule for CUDA targets: every Func that is not inlined is
// computed at root, one GPU thread per element; a long sum into few elements
// also one thread per chunk of it. It is correct, not fast: it exists so
// that every model AOT-compiles for CUDA today; tuned GPU schedules replace
// it when GPU training lands. Contractions of GEMM form call cuBLAS instead
// (Schedule::contract_kernel, runtime/gemm.h). Attention is the exception to
// "at root": its memory stays O(S) (see below).
#include "dsl/error.h"
#include "generators/lowering.h"

namespace halyard {

using namespace Halide;

namespace {

// Pure vars that an update definition keeps on its left-hand side.
std::vector<Var> pure_update_vars(Func f, int u) {
  std::vector<Var> out;
  auto lhs = f.update_args(u);
  for (const Var& a : f.args())
    for (const Expr& e : lhs)
      if (const auto* v = e.as<Internal::Variable>(); v && v->name == a.name()) out.push_back(a);
  return out;
}

// Every pure loop fused into one, 256 threads a block: every element of
// the Func has a thread. (Tiling only the two innermost loops ran the rest
// serially in each thread: RoPE's [head_dim, heads, seq] took 115 ms at
// 32,768 tokens on an H200, 32 x 8 threads each walking the sequence.)
template <class S>
void tile(S s, const std::vector<Var>& vars) {
  if (vars.empty()) {
    s.gpu_single_thread();
    return;
  }
  Var all = vars[0];
  for (size_t k = 1; k < vars.size(); ++k) {
    Var fused(all.name() + "_" + vars[k].name());
    s.fuse(all, vars[k], fused);
    all = fused;
  }
  Var block("b"), thread("t");
  s.gpu_tile(all, block, thread, 256, TailStrategy::GuardWithIf);
}

// Attention's row statistics compute a score Func inside each thread's
// reduction: over a fused loop Halide cannot size it, so these keep the two
// innermost loops as 16 x 16 tiles and the rest serial in each thread.
template <class S>
void tile_rows(S s, const std::vector<Var>& vars) {
  Var bx, by, tx, ty;
  if (vars.empty()) s.gpu_single_thread();
  else if (vars.size() == 1) s.gpu_tile(vars[0], bx, tx, 64, TailStrategy::GuardWithIf);
  else s.gpu_tile(vars[0], vars[1], bx, by, tx, ty, 16, 16, TailStrategy::GuardWithIf);
}

// A long sum split into chunks of `split.length` along its longest summed
// axis, each chunk's partial sums a thread's (schedules/partition.h:
// gpu_sum_split decides which sums, and how). A scatter (an update that does
// not write where its pure vars say) keeps its sum whole.
void split_long_sum(Func f, const GpuSumSplit& split) {
  for (int u = 0; u < f.num_update_definitions(); ++u) {
    if (pure_update_vars(f, u).size() != f.args().size()) continue;
    const auto rvars = f.update(u).get_schedule().rvars();
    size_t longest = 0;
    int64_t summed = 0;
    for (size_t k = 0; k < rvars.size(); ++k)
      if (const auto e = Internal::as_const_int(rvars[k].extent); e && *e > summed) summed = *e, longest = k;
    if (summed <= split.length) continue;
    const std::string name = rvars[longest].var;
    RVar r(name), outer(name + "_chunk"), inner(name + "_in");
    f.update(u).split(r, outer, inner, static_cast<int>(split.length), TailStrategy::GuardWithIf);
    Func partial = f.update(u).rfactor(outer, Var("chunk"));
    partial.compute_root();
    tile(partial, partial.args());
    tile(partial.update(), pure_update_vars(partial, 0));
  }
}

void on_gpu(Func f, bool rows = false, const GpuSumSplit& split = {}) {
  if (split.chunks > 0) split_long_sum(f, split);
  f.compute_root();
  auto place = [rows](auto stage, const std::vector<Var>& vars) { rows ? tile_rows(stage, vars) : tile(stage, vars); };
  place(f, f.args());
  for (int u = 0; u < f.num_update_definitions(); ++u) place(f.update(u), pure_update_vars(f, u));
}

// Attention in O(S) memory, flash-style without tiles: one GPU thread per
// output row (a query; a key for dK and dV) and head, its accumulator over
// head_dim in the thread's own memory, summed one key (or one query of one
// head) at a time. That key's score, probability (and dP, dS) are computed
// inside the reduction loop, once for all of head_dim, so no [keys x
// queries] matrix exists anywhere: at root there are only the operands'
// copies and the [queries x heads] row statistics. The row max and sum are
// kernels of their own (one thread per query row), each computing the scores
// it reads itself (lower_stage(..., gpu) gives them Funcs of their own):
// a score Func with two consumers would have to be computed at root.
// Memory-bound, not fast: a tensor-core kernel (cuDNN's SDPA) is the fast
// path this leaves open.
void schedule_attention(StageFuncs& F) {
  AttentionFuncs& A = F.attn;
  HALYARD_CHECK(A.row_products.size() == A.row_reductions.size(), "attention lowered without lower_stage(..., gpu)");
  for (size_t k = 0; k < A.row_reductions.size(); ++k) {
    Func f = A.row_reductions[k];
    A.row_products[k].acc.compute_at(f, RVar(f.update().get_schedule().rvars().front().var));
    on_gpu(f, true);
  }
  Func out = F.out;
  auto args = out.args();
  if (A.kind == static_cast<int>(Op::AttentionLse)) {  // out(h, i, b): the statistics alone
    on_gpu(out, true);
    return;
  }
  Var d = args[0], h = args[1], t = args[2], b = args[3], to("to"), tt("tt");
  out.compute_root()
      .split(t, to, tt, 64, TailStrategy::GuardWithIf)
      .reorder(d, tt, to, h, b)
      .gpu_blocks(to, h, b)
      .gpu_threads(tt);
  Func acc = A.out_acc;
  acc.compute_at(out, tt);
  // head_dim innermost (Halide puts reductions inside the pure loops), then
  // the innermost reduction variable: one key (one query of one head), whose
  // scores are computed once, outside the loop over head_dim.
  std::vector<VarOrRVar> order = {acc.args()[0]};
  for (const auto& r : acc.update().get_schedule().rvars()) order.push_back(RVar(r.var));
  acc.update().reorder(order);
  const RVar one = order[1].rvar;
  // One element each: Halide cannot prove that size from the causal bounds,
  // and unbounded it would allocate them in device memory, sized at run time
  // (or, in registers, as long as a row).
  auto one_element = [&](Func f) {
    f.compute_at(acc, one);
    for (const Var& v : f.args()) f.bound_storage(v, 1);
  };
  for (const AttentionProduct& pr : A.products) one_element(pr.acc);
  for (Func f : A.pointwise) one_element(f);
}

}  // namespace

void schedule_gpu(LoweredStage& ls, const Graph& g, const Stage& st, const Target&) {
  StageFuncs& F = ls.funcs;
  std::vector<Func> all = F.small;
  all.insert(all.end(), F.tables.begin(), F.tables.end());
  for (auto* list : {&F.staged, &F.root_copies}) all.insert(all.end(), list->begin(), list->end());
  if (F.contract_acc.defined()) all.push_back(F.contract_acc);
  // The loss's total over the tokens is the one scalar among them; its
  // split is the loss node's.
  const GpuSumSplit root_split = gpu_sum_split(g, g.node(st.root));
  for (Func f : all) on_gpu(f, false, f.args().empty() ? root_split : GpuSumSplit{});
  auto extra_outs = [&] {
    for (size_t k = 0; k < F.extra_outs.size(); ++k)
      on_gpu(F.extra_outs[k], false, gpu_sum_split(g, g.node(st.extra_outputs.at(k))));
  };
  if (F.attn.kind >= 0) {
    schedule_attention(F);
    extra_outs();
    return;
  }
  if (F.library) return;  // the runtime's GEMM, an extern stage on the device writing the output
  on_gpu(F.out, false, root_split);
  extra_outs();
}

void set_estimates(LoweredStage& ls, const Graph& g, const Stage& st) {
  for (size_t k = 0; k < st.inputs.size(); ++k) {
    const TensorType& t = g.node(st.inputs[k]).type;
    for (int d = 0; d < t.rank(); ++d)
      ls.inputs[k].dim(d).set_estimate(0, static_cast<int>(t.axes[static_cast<size_t>(t.rank() - 1 - d)].size));
  }
  const TensorType& t = g.node(st.root).type;
  Region r;
  for (int d = t.rank() - 1; d >= 0; --d) r.push_back({0, static_cast<int>(t.axes[static_cast<size_t>(d)].size)});
  ls.funcs.out.set_estimates(r);
  for (size_t k = 0; k < ls.funcs.extra_outs.size(); ++k) {
    const TensorType& x = g.node(st.extra_outputs.at(k)).type;
    Region rx;
    for (int d = x.rank() - 1; d >= 0; --d) rx.push_back({0, static_cast<int>(x.axes[static_cast<size_t>(d)].size)});
    ls.funcs.extra_outs[k].set_estimates(rx);
  }
}

}  // namespace halyard
