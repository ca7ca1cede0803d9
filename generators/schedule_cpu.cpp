// Hand-written CPU loop schedules for the kernels of a stage.
//
// Contractions get a register-blocked GEMM schedule: the output axis that is
// contiguous in one operand is vectorized, rows from the other operand are
// blocked in L2-sized panels and 4-row register tiles, panels run in
// parallel. Attention runs per (batch, head, tile of queries or keys) in
// parallel, its scores living only inside the tile. Everything else is
// vectorized along its innermost axis and parallel over the outermost.
#include "dsl/error.h"
#include "generators/lowering.h"

namespace halyard {

using namespace Halide;

namespace {

constexpr TailStrategy kGuard = TailStrategy::GuardWithIf;

// Parallel over the outermost pure var, vectorized along the innermost.
void pointwise(Func f, int vec, bool parallel = true) {
  auto args = f.args();
  if (args.empty()) return;
  if (args.size() > 1 && parallel) f.parallel(args.back());
  f.vectorize(args.front(), vec, kGuard);
}

void schedule_contract(StageFuncs& F, const Graph& g, const Stage& st, int vec) {
  const Node& n = g.node(st.root);
  Func C = F.out;
  const auto& vars = F.out_vars;  // innermost first
  const int rank = static_cast<int>(vars.size());
  if (rank == 0) return;
  const TensorType& bt = g.node(n.inputs[static_cast<size_t>(F.contract_b_operand)]).type;
  const TensorType& at = g.node(n.inputs[static_cast<size_t>(1 - F.contract_b_operand)]).type;
  auto axis = [&](int k) { return n.type.axes[static_cast<size_t>(rank - 1 - k)].name; };
  auto only_b = [&](int k) { return bt.has(axis(k)) && !at.has(axis(k)); };
  auto only_a = [&](int k) { return at.has(axis(k)) && !bt.has(axis(k)); };

  // Column var: the run of innermost output axes that come from B.
  Halide::Stage U = C.update();
  VarOrRVar col = vars[0];
  int k = 1;
  int64_t col_extent = n.type.size(axis(0));
  if (only_b(0)) {
    for (; k < rank && only_b(k); ++k) {
      Var fused(vars[0].name() + "_c" + std::to_string(k));
      C.fuse(col.var, vars[static_cast<size_t>(k)], fused);
      U.fuse(col.var, vars[static_cast<size_t>(k)], fused);
      col = fused;
      col_extent *= n.type.size(axis(k));
    }
  }
  // Row var: the next run of axes that come from A.
  bool has_row = k < rank && only_a(k);
  Var row;
  if (has_row) {
    row = vars[static_cast<size_t>(k)];
    int k0 = k++;
    for (; k < rank && only_a(k); ++k) {
      Var fused(row.name() + "_r" + std::to_string(k));
      C.fuse(row, vars[static_cast<size_t>(k)], fused);
      U.fuse(row, vars[static_cast<size_t>(k)], fused);
      row = fused;
    }
    (void)k0;
  }
  std::vector<Var> outer(vars.begin() + k, vars.end());

  // Initialization: vectorized, parallel over the outermost loop.
  C.vectorize(col.var, vec, kGuard);
  if (!outer.empty()) C.parallel(outer.back());
  else if (has_row) C.parallel(row);

  const int VN = col_extent >= 2 * vec ? 2 * vec : vec;
  Var co("co"), ci("ci"), cii("cii"), cio("cio"), rb("rb"), rt("rt"), rti("rti"), ri("ri");
  U.split(col.var, co, ci, VN, kGuard).split(ci, cio, cii, vec, kGuard);
  std::vector<VarOrRVar> order = {cii, cio};
  if (has_row) {
    U.split(row, rb, rt, 64, kGuard).split(rt, rti, ri, 4, kGuard);
    order.push_back(ri);
  }
  for (int d = 0; d < F.contract_rdom.dimensions(); ++d) order.push_back(F.contract_rdom[d]);
  if (has_row) order.push_back(rti);
  order.push_back(co);
  if (has_row) order.push_back(rb);
  for (const Var& o : outer) order.push_back(o);
  U.reorder(order).vectorize(cii).unroll(cio);
  if (has_row) U.unroll(ri);
  // Parallel over row panels (fused with the outer loops).
  if (has_row) {
    Var par = rb;
    for (const Var& o : outer) {
      Var f(par.name() + "_" + o.name());
      U.fuse(par, o, f);
      par = f;
    }
    U.parallel(par);
    // Inlined A operands (a norm, an add chain) are computed once per row panel.
    for (Func s : F.staged) s.compute_at(C, par).vectorize(s.args().front(), vec, kGuard);
  } else {
    if (!outer.empty()) U.parallel(outer.back());
    for (Func s : F.staged) s.compute_root();
  }
}

void schedule_attention(StageFuncs& F, int vec) {
  Func out = F.out;
  auto args = out.args();  // (d, h|g, i|j, b)
  Var d = args[0], h = args[1], t = args[2], b = args[3];
  Var to("to"), ti("ti"), par("par"), par2("par2");
  const bool query_tiles = F.tile_var.name() == "i";
  out.split(t, to, ti, query_tiles ? 32 : 16, kGuard)
      .reorder(d, ti, h, to, b)
      .fuse(h, to, par)
      .fuse(par, b, par2)
      .parallel(par2)
      .vectorize(d, vec, kGuard);
  for (Func f : F.tile_funcs) {
    f.compute_at(out, par2);
    auto fa = f.args();
    f.vectorize(fa.front(), vec, kGuard);
    // The online (max, sum) statistics run along keys; nothing to vectorize.
    if (f.outputs() > 1) f.update().unscheduled();
  }
  for (Func f : F.tile_reductions) {
    auto fa = f.args();
    f.update().vectorize(fa.front(), vec, kGuard);
  }
  if (F.row_owner.defined()) {
    auto ra = F.row_owner.args();  // (i, h, b)
    F.row_owner.compute_root().parallel(ra[2]).parallel(ra[1]);
    for (Func f : F.row_funcs) f.compute_at(F.row_owner, ra[0]);
    F.row_funcs[0].update().vectorize(F.row_funcs[0].args().front(), vec, kGuard);
  }
}

}  // namespace

void schedule_cpu(LoweredStage& ls, const Graph& g, const Stage& st, const Target& t) {
  StageFuncs& F = ls.funcs;
  const int vec = t.natural_vector_size(halide_type(g.node(st.root).type.dtype));
  for (Func f : F.small) {
    if (F.row_owner.defined() && f.name() == F.row_owner.name()) continue;
    f.compute_root();
  }
  for (Func f : F.root_copies) {
    f.compute_root();
    pointwise(f, vec);
  }
  if (F.is_contract) {
    schedule_contract(F, g, st, vec);
  } else if (F.attention_kind >= 0) {
    schedule_attention(F, vec);
  } else {
    Func out = F.out;
    pointwise(out, vec);
    for (int u = 0; u < out.num_update_definitions(); ++u) {
      // Reductions into the output (norm weight grads, scatters, the loss):
      // vectorize along the output's innermost axis when the update keeps it.
      auto args = out.args();
      if (!args.empty()) out.update(u).vectorize(args.front(), vec, kGuard);
    }
  }
}

}  // namespace halyard
