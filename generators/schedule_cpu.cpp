// Hand-written CPU loop schedules for the kernels of a stage.
//
// Contractions get a register-blocked GEMM schedule: the output axis that is
// contiguous in one operand (B, read from a copy in panels for a projection:
// ContractLayout) is vectorized, rows from the other operand are blocked in
// row panels and register tiles, row panels run in parallel; a sum over
// tokens (a weight gradient) runs in L1-sized blocks. Attention runs per
// (batch, head, tile of queries or keys) in parallel, its scores living only
// inside the tile. Per-token reductions sum a vector of tokens side by side.
// Everything else is vectorized along its innermost axis and parallel over
// all the outer ones.
#include "dsl/error.h"
#include "generators/lowering.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>

namespace halyard {

using namespace Halide;

namespace {

constexpr TailStrategy kGuard = TailStrategy::GuardWithIf;

// Vectorized along the innermost pure var; in parallel over all the outer
// ones at once, fused, in blocks of about 16K elements (`row`: the innermost
// extent, where known). (Parallel over the outermost alone, a batch of one
// ran every elementwise kernel on one thread.)
void pointwise(Func f, int vec, bool parallel = true, int64_t row = 0) {
  auto args = f.args();
  if (args.empty()) return;
  f.vectorize(args.front(), vec, kGuard);
  if (args.size() < 2 || !parallel) return;
  Var p = args.back();
  for (size_t k = args.size() - 2; k >= 1; --k) {
    Var q(args[k].name() + "_" + p.name());
    f.fuse(args[k], p, q);
    p = q;
  }
  const int rows = row > 0 ? static_cast<int>(std::clamp<int64_t>((1 << 14) / row, 1, 1 << 10)) : 16;
  Var po(p.name() + "_o"), pi(p.name() + "_i");
  f.split(p, po, pi, rows, kGuard).parallel(po);
}

// The longest block of a sum (a power of two, 32 to 512 steps) whose
// operand strips, `floats_per_step` floats each step, fill at most the L1.
int block_of_sum(int64_t l1d_bytes, int floats_per_step) {
  int kc = 32;
  while (kc < 512 && 2 * kc * floats_per_step * 4 <= l1d_bytes) kc *= 2;
  return kc;
}

// A per-token reduction (a norm's sum of squares, the loss's max and sum over
// the vocabulary, an attention row's dot): summed one token at a time, each
// step waits for the last (256 dependent FMAs per token for a norm: 1.7 ms
// of every norm kernel at seq 4096). So a vector of tokens sums side by side
// in registers (each token's sum in the same order as before), blocks of
// tokens in parallel.
void schedule_small(Func f, int vec) {
  f.compute_root();
  auto args = f.args();
  if (args.empty()) return;
  if (f.num_update_definitions() == 0) return pointwise(f, vec);
  Func w = f.in();
  w.compute_root();
  const Var t = args.front();
  Var tb("tb"), to("to"), ti("ti");
  w.split(t, tb, to, 8 * vec, kGuard).split(to, to, ti, vec, kGuard).vectorize(ti);
  w.parallel(tb);
  if (args.size() > 1) w.parallel(args.back());
  f.compute_at(w, to).vectorize(t, vec, kGuard);
  for (int u = 0; u < f.num_update_definitions(); ++u) {
    std::vector<VarOrRVar> order = {t};
    for (const auto& r : f.update(u).get_schedule().rvars()) order.push_back(RVar(r.var));
    f.update(u).reorder(order).vectorize(t, vec, kGuard);
  }
}

// The widest vector, up to vec lanes, that divides a column tile of n: a
// vector that does not divide it rounds the tile up and reads past the
// edge of an input (head_dim 24 on AVX-512 read q up to element 31).
int lanes_dividing(int n, int vec) {
  int lanes = vec;
  while (lanes > 1 && n % lanes != 0) lanes /= 2;
  return lanes;
}

void schedule_contract(LoweredStage& ls, const Graph& g, const Stage& st, int vec, const CacheSizes& caches) {
  StageFuncs& F = ls.funcs;
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
  // A tile narrower than two vectors (24 columns on AVX-512) is vectorized
  // by what divides it, or a read past B's edge.
  const int lanes = VN < vec ? VN : lanes_dividing(VN, vec);
  // A weight gradient (below) tiles its rows exactly, with no tail: rows a
  // multiple of the register tile. 6 rows (the AVX2 tile) divide few of the
  // model's widths (160, 256), so such a sum takes the largest tile from 2
  // up that divides them (on Zen 3, AVX2: 160 rows read past their edge
  // with 6).
  const std::string a_inner = at.axes.empty() ? "" : at.axes.back().name;
  const bool strided_sum = row_k >= 0 && F.contract_rdom.dimensions() == 1 && n.type.has(a_inner) && extent(0) % VN == 0;
  int RT = row_k < 0 ? 1 : std::min(vec >= 16 ? 8 : 6, extent(row_k));
  if (strided_sum)
    while (RT > 2 && extent(row_k) % RT != 0) --RT;
  // Over B's panels LLVM loads every row's broadcast of A before the FMAs:
  // RT x 2 accumulators, 2 vectors of B and RT broadcasts must fit the 16
  // registers of AVX2 (6 rows spill two accumulators through memory on every
  // step of the sum; 4 rows measured 0-6% faster, Zen 3).
  if (!F.contract_panel_vars.empty() && row_k >= 0) RT = std::min(vec >= 16 ? 8 : 4, extent(row_k));
  Var co("co"), ci("ci"), ro("ro"), ri("ri"), rb("rb"), par("par");
  std::vector<VarOrRVar> order;
  if (row_k >= 0) {
    const Var row = vars[static_cast<size_t>(row_k)];
    const int panels = std::max(1, std::min(64 / RT, extent(row_k) / RT));
    // Where B is in panels, the columns are a multiple of VN (ContractLayout)
    // and the column tiles split exactly (RoundUp never rounds): so the
    // simplifier sees each tile start on a panel and B's column / panel and
    // column % panel become a panel and a vector within it (a shifted last
    // tile made every load of B a gather, 2.7x slower).
    const TailStrategy col_tail = F.contract_panel_vars.empty() ? TailStrategy::ShiftInwards : TailStrategy::RoundUp;
    C.split(col, co, ci, VN, col_tail)
        .split(row, ro, ri, RT, TailStrategy::ShiftInwards)
        .reorder(ci, ri, co, ro)
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
    C.vectorize(ci, lanes).unroll(ri);
    // A weight gradient sums over tokens, an outer axis of both operands:
    // every step of the sum reads a new cache line of each, at strides of a
    // power-of-two row (1 or 3 KiB here) that map onto a few cache sets. So
    // the sum runs in blocks of KC tokens whose operand strips stay in L1
    // (B's VN columns and A's RT rows), each block's register tile added into
    // the panel's accumulators in memory. Matmul_bench, Zen 4, 2 threads:
    // 110-130 GFLOP/s unblocked, 170-210 blocked (Eigen 3.4: 140-167); KC
    // from 64 to 512 within noise, packing the strips into contiguous copies
    // 5-20% slower.
    const bool blocked = strided_sum && extent(row_k) % RT == 0;
    const int KC = blocked ? block_of_sum(caches.l1d, VN + RT) : 0;
    const auto sum_extent = blocked ? Internal::as_const_int(F.contract_rdom[0].extent()) : std::nullopt;
    if (sum_extent && *sum_extent >= 2 * KC) {
      acc.compute_at(C, p);
      acc.vectorize(col, lanes);
      Var aco("aco"), aci("aci"), aro("aro"), ari("ari"), u("u");
      RVar rk = F.contract_rdom[0], rko("rko"), rki("rki");
      Func blk = acc.update().split(rk, rko, rki, KC, TailStrategy::GuardWithIf).rfactor(rko, u);
      // RoundUp keeps the tiles' extents constant, so the block's tile is a
      // fixed-size array LLVM keeps in registers; the panel's columns are a
      // multiple of VN and its rows of RT, so nothing is read past an edge.
      acc.update()
          .split(col, aco, aci, VN, TailStrategy::RoundUp)
          .split(row, aro, ari, RT, TailStrategy::RoundUp)
          .reorder(aci, ari, aro, aco, rko)
          .vectorize(aci, lanes)
          .unroll(aci)
          .unroll(ari);
      blk.compute_at(acc, aro).vectorize(col, lanes).unroll(row);
      blk.update().reorder(col, row, rki).vectorize(col, lanes).unroll(col).unroll(row);
    } else if (!F.contract_panel_vars.empty()) {
      // The tile's accumulators: a vector per panel and row.
      const Var vi = F.contract_panel_vars[0], vo = F.contract_panel_vars[1];
      acc.compute_at(C, ro);
      acc.vectorize(vi, vec).unroll(vo).unroll(row);
      std::vector<VarOrRVar> red = {vi, vo, row};
      for (int d = 0; d < F.contract_rdom.dimensions(); ++d) red.push_back(F.contract_rdom[d]);
      acc.update().reorder(red).vectorize(vi, vec).unroll(vo).unroll(row);
    } else {
      acc.compute_at(C, ro);
      acc.vectorize(col, lanes).unroll(row);
      std::vector<VarOrRVar> red = {col, row};
      for (int d = 0; d < F.contract_rdom.dimensions(); ++d) red.push_back(F.contract_rdom[d]);
      acc.update().reorder(red).vectorize(col, lanes).unroll(col).unroll(row);
    }
  } else {
    C.split(col, co, ci, VN, TailStrategy::ShiftInwards).vectorize(ci, lanes);
    if (rank > 1) C.parallel(vars.back());
    acc.compute_at(C, co).vectorize(col, lanes);
    acc.update().vectorize(col, lanes);
    for (Func s : F.staged) s.compute_root();
  }
}

// Register-blocks a product of two matrices computed per tile: `col`
// vectorized (VN wide), RT rows, the accumulator kept across its reduction.
void product(AttentionProduct pr, int col_extent, int row_extent, int vec) {
  const int VN = std::min(2 * vec, col_extent), RT = std::min(8, row_extent), lanes = lanes_dividing(VN, vec);
  Var co("co"), ci("ci"), ro("ro"), rr("rr");
  pr.wrapper.tile(pr.col, pr.row, co, ro, ci, rr, VN, RT, TailStrategy::ShiftInwards)
      .vectorize(ci, lanes)
      .unroll(rr);
  pr.acc.compute_at(pr.wrapper, co).vectorize(pr.col, lanes).unroll(pr.row);
  auto red = pr.acc.update().get_schedule().rvars();
  std::vector<VarOrRVar> order = {pr.col, pr.row};
  for (const auto& r : red) order.push_back(RVar(r.var));
  pr.acc.update().reorder(order).vectorize(pr.col, lanes).unroll(pr.col).unroll(pr.row);
}

void schedule_attention(StageFuncs& F, int vec, const KernelTiles& tiles) {
  AttentionFuncs& A = F.attn;
  Func out = F.out;
  auto args = out.args();
  const bool key_tiles = A.tile_var.name() == "j";
  // Tiles keep their per-tile scratch ([all keys x queries], or [keys x all
  // queries x group heads]) within L2. Measured on Zen 5 (attention_bench,
  // 2 threads): 16 keys beat 8, 24, 32 and 64 at seq 1024, 4096 and 8192 (dK
  // 66 vs 78 ms at 4096 with 32); queries: half a MiB of scores per tile, 16
  // to 32 rows (dQ 233 vs 253 ms at 8192 with 32).
  const int query_tile = tiles.attention_queries ? tiles.attention_queries : std::clamp((1 << 19) / (4 * A.S) / 8 * 8, 16, 32);
  const int key_tile = tiles.attention_keys ? tiles.attention_keys : 16;
  const int tile = std::min(key_tiles ? key_tile : query_tile, A.S);
  Var to("to"), tt("tt"), p1("p1"), par("par");
  Var tile_loop = par;  // where each tile's scores and statistics are computed
  if (A.kind == static_cast<int>(Op::AttentionLse)) {  // out(h, i, b)
    Var h = args[0], i = args[1], b = args[2];
    out.split(i, to, tt, tile, TailStrategy::ShiftInwards)
        .reorder(tt, h, to, b)
        .fuse(h, to, p1)
        .fuse(p1, b, par)
        .parallel(par);
  } else {  // out(d, h|g, i|j, b)
    Var d = args[0], h = args[1], t = args[2], b = args[3];
    out.split(t, to, tt, tile, TailStrategy::ShiftInwards);
    if (!F.extra_outs.empty()) {
      // A second output shares the tile loop through compute_with, which
      // needs plain (not fused) loops: parallel over the tiles of each head.
      out.reorder(d, tt, to, h, b).parallel(to);
      tile_loop = to;
    } else {
      out.reorder(d, tt, h, to, b).fuse(h, to, p1).fuse(p1, b, par).parallel(par);
    }
    // The output tile [d x rows] is summed in registers over all keys (or queries).
    const int VN = std::min(2 * vec, A.D), RT = std::min(8, tile), lanes = lanes_dividing(VN, vec);
    Var dout("dout"), di("di"), tto("tto"), tti("tti");
    out.split(tt, tto, tti, RT, TailStrategy::ShiftInwards)
        .split(d, dout, di, VN, TailStrategy::ShiftInwards)
        .reorder(di, tti, dout, tto, tile_loop)
        .vectorize(di, lanes)
        .unroll(tti);
    Func acc = A.out_acc;
    auto aa = acc.args();
    acc.compute_at(out, dout).vectorize(aa[0], lanes).unroll(aa[2]);
    std::vector<VarOrRVar> order = {aa[0], aa[2]};
    auto rvars = acc.update().get_schedule().rvars();
    for (auto it = rvars.rbegin(); it != rvars.rend(); ++it) order.push_back(RVar(it->var));
    // keep the query loop inside the head loop for dK/dV (ri.y inside ri.x)
    if (rvars.size() == 2) order = {aa[0], aa[2], RVar(rvars[1].var), RVar(rvars[0].var)};
    acc.update().reorder(order).vectorize(aa[0], lanes).unroll(aa[0]).unroll(aa[2]);
    if (!F.extra_outs.empty()) {  // the log-sum-exp (h, i, b), in the same loop over query tiles
      Func lse = F.extra_outs[0];
      auto la = lse.args();
      lse.split(la[1], to, tt, tile, TailStrategy::ShiftInwards)
          .reorder(tt, to, la[0], la[2])
          .parallel(to)
          .compute_with(out, to);
    }
  }
  // Per tile: scores (and dP), probabilities (and dS), row statistics.
  for (AttentionProduct pr : A.products) {
    pr.wrapper.compute_at(out, tile_loop);
    product(pr, key_tiles ? tile : A.S, key_tiles ? A.S : tile, vec);
  }
  for (Func f : A.pointwise) f.compute_at(out, tile_loop).vectorize(f.args().front(), vec, kGuard);
  // Row max and sum over a query's keys: each 16-key block's partial lands
  // in its lane of a vector per row (the rfactor), summed across lanes once
  // per row. Reducing each block across its lanes into the row's scalar made
  // a chain of shuffles and a store per block: the fused forward (seq 4096,
  // Zen 4, 2 threads) took 111-125 ms that way, 100-106 ms this way.
  // The lanes are summed as one vector of the block's width whatever the
  // target's (two halves on AVX2), so that an AVX2 and an AVX-512 machine
  // sum a row in the same order and give the same bits.
  for (Func f : A.row_reductions) {
    f.compute_at(out, tile_loop);
    auto rvars = f.update().get_schedule().rvars();
    const auto block = Internal::as_const_int(rvars[0].extent);
    int across = vec;
    if (block && *block >= 8) {
      across = static_cast<int>(*block);
      const int lanes = static_cast<int>(std::min<int64_t>(vec, *block));
      auto fa = f.args();
      Var lane("lane");
      Func part = f.update().rfactor(RVar(rvars[0].var), lane);
      std::vector<Var> storage = {lane};
      storage.insert(storage.end(), fa.begin(), fa.end());
      part.reorder_storage(storage).compute_at(out, tile_loop).vectorize(lane, lanes);
      // keys inside each row, so the blocks after the query are skipped
      part.update().reorder(lane, RVar(rvars[1].var), fa[0]).vectorize(lane, lanes);
    }
    f.update().atomic().vectorize(RVar(rvars[0].var), across);
  }
}

// A bias gradient db[heads, head_dim] sums dy over every token. Halide puts
// a reduction's loops outside the pure ones; here the outermost bias axis
// goes outside them instead, in parallel (each thread owns whole rows of
// db, so no two threads add into one element), the tokens in the middle,
// the innermost bias axis vectorized (contiguous in dy).
void schedule_bias_grad(StageFuncs& F, int vec) {
  Func out = F.out;
  const auto args = out.args();  // innermost first
  pointwise(out, vec);
  Halide::Stage sum = out.update();
  std::vector<VarOrRVar> order = {args.front()};
  for (const auto& r : sum.get_schedule().rvars()) order.push_back(RVar(r.var));
  for (size_t k = 1; k < args.size(); ++k) order.push_back(args[k]);
  sum.reorder(order).vectorize(args.front(), vec, kGuard);
  if (args.size() > 1) sum.parallel(args.back());
}

// One cache's size from sysfs ("48K", "2048K", "32M"), or 0.
int64_t sysfs_cache_bytes(int level, const std::string& type) {
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream lv(dir + "level"), ty(dir + "type"), sz(dir + "size");
    int l = 0;
    std::string t, size;
    if (!(lv >> l) || !(ty >> t) || !(sz >> size)) return 0;
    if (l != level || t != type) continue;
    char* end = nullptr;
    const int64_t v = std::strtoll(size.c_str(), &end, 10);
    return v * (*end == 'K' ? 1024 : *end == 'M' ? 1024 * 1024 : 1);
  }
  return 0;
}

}  // namespace

CacheSizes build_host_caches() {
  CacheSizes c;
  if (int64_t l1 = sysfs_cache_bytes(1, "Data"); l1 > 0) c.l1d = l1;
  if (int64_t l2 = sysfs_cache_bytes(2, "Unified"); l2 > 0) c.l2 = l2;
  return c;
}

void schedule_cpu(LoweredStage& ls, const Graph& g, const Stage& st, const Target& t, const KernelTiles& tiles) {
  StageFuncs& F = ls.funcs;
  const int vec = t.natural_vector_size(halide_type(g.node(st.root).type.dtype));
  for (Func f : F.small) schedule_small(f, vec);
  // RoPE's tables take a double-precision cos and sin per (token, frequency):
  // in parallel over tokens (they were 1.8 ms of each 4096-token RoPE kernel).
  for (Func f : F.tables) {
    f.compute_root();
    auto a = f.args();
    if (a.size() > 1) {
      Var o("o"), i("i");
      f.split(a[1], o, i, 64, TailStrategy::GuardWithIf).parallel(o);
    }
  }
  for (Func f : F.root_copies) {
    f.compute_root();
    pointwise(f, vec);
  }
  if (F.library) {
    // A library kernel (runtime/attention_cpu.h, gemm_cpu.h; or the runtime's
    // GEMM, on the host its reference) writes the outputs; its tasks run on
    // Halide's thread pool.
  } else if (F.is_contract) {
    schedule_contract(ls, g, st, vec, build_host_caches());
  } else if (g.node(st.root).op == Op::BiasAddGrad) {
    schedule_bias_grad(F, vec);
  } else if (F.attn.kind >= 0) {
    schedule_attention(F, vec, tiles);
  } else {
    Func out = F.out;
    const TensorType& ot = g.node(st.root).type;
    pointwise(out, vec, true, ot.rank() ? ot.axes.back().size : 0);
    for (int u = 0; u < out.num_update_definitions(); ++u) {
      // Reductions into the output (norm weight grads, scatters, the loss):
      // vectorize along the output's innermost axis when the update keeps it.
      auto args = out.args();
      if (!args.empty()) out.update(u).vectorize(args.front(), vec, kGuard);
    }
  }
}

}  // namespace halyard
