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
  Func C = F.out, acc = F.contract_acc;
  const auto& vars = F.out_vars;  // innermost first
  const int rank = static_cast<int>(vars.size());
  if (rank == 0 || !acc.defined()) return;
  const TensorType& at = g.node(n.inputs[static_cast<size_t>(1 - F.contract_b_operand)]).type;
  auto axis = [&](int k) { return n.type.axes[static_cast<size_t>(rank - 1 - k)].name; };
  auto extent = [&](int k) { return static_cast<int>(n.type.size(axis(k))); };

  // Columns: the innermost output axis (contiguous in operand B). Rows: the
  // innermost axis that comes from operand A. A register tile of VN x RT
  // accumulators is summed over the whole reduction, then stored once.
  const Var col = vars[0];
  int row_k = -1;
  for (int k = 1; k < rank; ++k)
    if (at.has(axis(k))) {
      row_k = k;
      break;
    }
  const int VN = std::min(2 * vec, extent(0));
  const int RT = row_k < 0 ? 1 : std::min(vec >= 16 ? 8 : 6, extent(row_k));
  Var co("co"), ci("ci"), ro("ro"), ri("ri"), rb("rb"), par("par");
  std::vector<VarOrRVar> order;
  if (row_k >= 0) {
    const Var row = vars[static_cast<size_t>(row_k)];
    const int panels = std::max(1, std::min(64 / RT, extent(row_k) / RT));
    C.tile(col, row, co, ro, ci, ri, VN, RT, TailStrategy::ShiftInwards)
        .split(ro, rb, ro, panels, TailStrategy::ShiftInwards);
    order = {ci, ri, ro, co};
    std::vector<Var> outer = {rb};
    for (int k = 1; k < rank; ++k)
      if (k != row_k) order.push_back(vars[static_cast<size_t>(k)]), outer.push_back(vars[static_cast<size_t>(k)]);
    order.insert(order.begin() + 4, rb);
    C.reorder(order);
    // Fuse the row panels with every outer loop into one parallel loop.
    Var p = rb;
    for (size_t k = 1; k < outer.size(); ++k) {
      Var f(p.name() + "_f" + std::to_string(k));
      C.fuse(p, outer[k], f);
      p = f;
    }
    C.parallel(p);
    for (Func s : F.staged) s.compute_at(C, p).vectorize(s.args().front(), vec, kGuard);
    C.vectorize(ci, std::min(vec, VN)).unroll(ri);
    acc.compute_at(C, ro);
    acc.vectorize(col, std::min(vec, VN)).unroll(row);
    std::vector<VarOrRVar> red = {col, row};
    for (int d = 0; d < F.contract_rdom.dimensions(); ++d) red.push_back(F.contract_rdom[d]);
    acc.update().reorder(red).vectorize(col, std::min(vec, VN)).unroll(col).unroll(row);
  } else {
    C.split(col, co, ci, VN, TailStrategy::ShiftInwards).vectorize(ci, std::min(vec, VN));
    if (rank > 1) C.parallel(vars.back());
    acc.compute_at(C, co).vectorize(col, std::min(vec, VN));
    acc.update().vectorize(col, std::min(vec, VN));
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
