// A GPU-legal schedule for CUDA targets: every Func that is not inlined is
// computed at root and tiled over GPU blocks and threads. It is correct, not
// fast: it exists so that every model AOT-compiles for CUDA today; tuned GPU
// schedules replace it when GPU training lands. Contractions of GEMM form
// call cuBLAS instead (Schedule::contract_kernel, runtime/gemm.h).
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

template <class S>
void tile(S s, const std::vector<Var>& vars) {
  Var bx, by, tx, ty;
  if (vars.empty()) s.gpu_single_thread();
  else if (vars.size() == 1) s.gpu_tile(vars[0], bx, tx, 64, TailStrategy::GuardWithIf);
  else s.gpu_tile(vars[0], vars[1], bx, by, tx, ty, 16, 16, TailStrategy::GuardWithIf);
}

void on_gpu(Func f) {
  f.compute_root();
  tile(f, f.args());
  for (int u = 0; u < f.num_update_definitions(); ++u) tile(f.update(u), pure_update_vars(f, u));
}

}  // namespace

void schedule_gpu(LoweredStage& ls, const Graph&, const Stage&, const Target&) {
  StageFuncs& F = ls.funcs;
  std::vector<Func> all = F.small;
  all.insert(all.end(), F.tables.begin(), F.tables.end());
  for (auto* list : {&F.staged, &F.root_copies, &F.attn.pointwise, &F.attn.row_reductions})
    all.insert(all.end(), list->begin(), list->end());
  for (const AttentionProduct& p : F.attn.products) all.insert(all.end(), {p.wrapper, p.acc});
  if (F.attn.out_acc.defined()) all.push_back(F.attn.out_acc);
  if (F.contract_acc.defined()) all.push_back(F.contract_acc);
  for (Func f : all) on_gpu(f);
  if (F.library.defined()) F.library.compute_root();  // the runtime's GEMM, an extern stage on the device
  on_gpu(F.out);
  for (Func f : F.extra_outs) on_gpu(f);
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
