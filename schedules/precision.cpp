// Saved values in bf16 (see precision.h).
#include "schedules/precision.h"

#include <algorithm>
#include <functional>

#include "dsl/error.h"
#include "dsl/op_table.h"
#include "dsl/ops.h"

namespace halyard {
namespace {

// A value that can have a bf16 copy: an activation (computed, not a view of
// another buffer, with the sequence among its axes: what grows with the
// context), in f32, saved rather than recomputed, and not one the op table
// keeps in f32. A value computed inline is re-derived by each reader, unless
// the reader reads a tile of it: a tile is a view of a stored buffer.
bool storable(const Node& n, const Schedule& s, bool read_as_tiles) {
  const OpInfo& r = op_info(n.op);
  return r.cls != OpClass::Leaf && r.cls != OpClass::View && !r.store_f32 && n.type.dtype == DType::f32 &&
         n.type.has("seq") && s.keep(n) != Keep::Recompute && (read_as_tiles || s.compute(n) != Compute::Inline);
}

}  // namespace

StoredGraph store_saved(const Graph& src, const Schedule& s) {
  StoredGraph out;
  if (!s.stores_bf16()) return out;
  const int n = src.size();
  const std::vector<int> residual = residuals(src);
  // Values the backward reads in tiles: a forward tile of them, or a tile
  // the backward cuts itself (a recomputed tile's clone).
  std::vector<bool> tiled(static_cast<size_t>(n), false);
  for (int r : residual)
    if (src.node(r).op == Op::SliceSeq) tiled[static_cast<size_t>(src.node(r).inputs[0])] = true;
  for (const Node& x : src.nodes())
    if (x.op == Op::SliceSeq && x.backward) tiled[static_cast<size_t>(x.inputs[0])] = true;
  // A value computed inline is re-derived by each backward reader from the
  // buffers under it: those are what the backward really reads.
  auto inline_value = [&](const Node& v) {
    return !v.backward && op_info(v.op).cls == OpClass::Cheap && s.compute(v) == Compute::Inline &&
           !tiled[static_cast<size_t>(v.id)];
  };
  std::vector<int> read;
  std::vector<bool> seen(static_cast<size_t>(n), false);
  std::function<void(int)> under = [&](int id) {
    if (seen[static_cast<size_t>(id)]) return;
    seen[static_cast<size_t>(id)] = true;
    const Node& v = src.node(id);
    if (!inline_value(v)) return read.push_back(id);
    for (int i : v.inputs) under(i);
  };
  for (int r : residual) under(r);
  // The values that get a copy: those the rules store, and the buffer under
  // a tile (the backward then reads a tile of the copy). The rules of the
  // stored value decide (a tile's label may be another module's).
  std::vector<bool> copy(static_cast<size_t>(n), false);
  for (int r : read) {
    const Node& v = src.node(r);
    const Node& stored = v.op == Op::SliceSeq ? src.node(v.inputs[0]) : v;
    if (s.stores_bf16(stored) && storable(stored, s, tiled[static_cast<size_t>(stored.id)]))
      copy[static_cast<size_t>(stored.id)] = true;
  }
  if (std::find(copy.begin(), copy.end(), true) == copy.end()) return out;

  out.graph = std::make_unique<Graph>();
  Graph& g = *out.graph;
  out.id_of.assign(static_cast<size_t>(n), -1);
  // A source value's bf16 form in the new graph: a stored copy, or a
  // backward tile of one (which has no f32 form: its readers load it).
  std::vector<int> bf16_of(static_cast<size_t>(n), -1);
  auto bf16 = [&](int id) { return bf16_of[static_cast<size_t>(id)]; };
  // What the backward reads for forward value `id`: its copy, a tile of the
  // copy, an inline value re-derived from copies (one clone, inlined into
  // each reader like the value itself), or the value. One load per copy (or
  // tile of one), read by every reader: a load is always computed inside its
  // readers' kernels (schedules/partition.cpp), and readers that a kernel
  // fuses (dK, dV and dQ; attention and its row statistics) are matched by
  // their operands.
  std::vector<int> backward_form(static_cast<size_t>(n), -1);
  std::function<int(int)> for_backward = [&](int id) -> int {
    int& f = backward_form[static_cast<size_t>(id)];
    if (f >= 0) return f;
    const Node& x = src.node(id);
    if (bf16(id) >= 0) return f = load_bf16(g.value(bf16(id))).id;
    if (x.op == Op::SliceSeq && bf16(x.inputs[0]) >= 0)
      return f = load_bf16(slice_seq(g.value(bf16(x.inputs[0])), x.attrs.offset, x.attrs.size)).id;
    if (inline_value(x)) {
      std::vector<Value> in;
      bool changed = false;
      for (int i : x.inputs) {
        in.push_back(g.value(src.node(i).backward ? out.id_of[static_cast<size_t>(i)] : for_backward(i)));
        changed = changed || in.back().id != out.id_of[static_cast<size_t>(i)];
      }
      if (changed) return f = g.add(x.op, in, x.attrs, x.name).id;
    }
    return f = out.id_of[static_cast<size_t>(id)];
  };
  for (const Node& node : src.nodes()) {
    g.set_building_backward(node.backward);
    if (node.backward && node.op == Op::SliceSeq && bf16(node.inputs[0]) >= 0) {
      bf16_of[static_cast<size_t>(node.id)] = slice_seq(g.value(bf16(node.inputs[0])), node.attrs.offset, node.attrs.size).id;
      continue;
    }
    // The forward's attention reads the copies too: the backward recomputes
    // its probabilities from the saved operands and the row statistics the
    // forward kernel wrote, which must come from the same operands.
    const bool reads_copies = node.backward || node.op == Op::Attention || node.op == Op::AttentionLse;
    std::vector<Value> in;
    for (int i : node.inputs) {
      int id = out.id_of[static_cast<size_t>(i)];
      if (reads_copies && !src.node(i).backward) id = for_backward(i);
      else if (id < 0) id = load_bf16(g.value(bf16(i))).id;  // a backward tile of a copy
      in.push_back(g.value(id));
    }
    Value made = op_info(node.op).cls == OpClass::Leaf ? g.add_leaf(node.op, node.type, node.attrs, node.name)
                                                       : g.add(node.op, in, node.attrs, node.name);
    out.id_of[static_cast<size_t>(node.id)] = made.id;
    if (copy[static_cast<size_t>(node.id)]) {
      HALYARD_CHECK(!node.backward, "a stored value is a forward value");
      bf16_of[static_cast<size_t>(node.id)] = store_bf16(made).id;
    }
  }
  g.set_building_backward(false);
  verify(g);
  return out;
}

StoredGraph round_contractions(const Graph& src, const Schedule& s) {
  StoredGraph out;
  if (s.contract_precision != "bf16") return out;
  const int n = src.size();
  auto attention = [](Op op) {
    return op == Op::Attention || op == Op::AttentionLse || op == Op::AttentionGradQ || op == Op::AttentionGradK ||
           op == Op::AttentionGradV;
  };
  auto rounds = [&](const Node& x) {
    if (attention(x.op)) return true;
    if (x.op != Op::Contract) return false;
    for (int i : x.inputs)
      if (src.node(i).type.dtype == DType::f32 && src.node(i).op != Op::LoadBf16) return true;
    return false;
  };
  if (std::none_of(src.nodes().begin(), src.nodes().end(), rounds)) return out;

  out.graph = std::make_unique<Graph>();
  Graph& g = *out.graph;
  out.id_of.assign(static_cast<size_t>(n), -1);
  std::vector<int> copy_of(static_cast<size_t>(n), -1);  // a source value's bf16 copy in `g`
  std::vector<int> read_as(static_cast<size_t>(n), -1);  // what a contraction reads for it
  // A parameter is rounded once in the forward and once more in the
  // backward: its copy is cheap to make, and one copy kept from the forward
  // to the backward would hold 2 bytes of every parameter through the step
  // (what activation checkpointing in PyTorch avoids by casting again).
  std::vector<int> backward_copy_of(static_cast<size_t>(n), -1), backward_read_as(static_cast<size_t>(n), -1);
  // (A copy made for a backward contraction is a backward node: the value
  // is rounded where the backward first needs it.)
  auto operand = [&](int id, bool backward) {
    const Node& x = src.node(id);
    const bool again = backward && x.op == Op::Param;
    int& r = (again ? backward_read_as : read_as)[static_cast<size_t>(id)];
    if (r >= 0) return r;
    if (x.type.dtype != DType::f32 || x.op == Op::LoadBf16) return r = out.id_of[static_cast<size_t>(id)];
    int& c = (again ? backward_copy_of : copy_of)[static_cast<size_t>(id)];
    if (c < 0) c = store_bf16(g.value(out.id_of[static_cast<size_t>(id)])).id;
    return r = load_bf16(g.value(c)).id;
  };
  for (const Node& node : src.nodes()) {
    g.set_building_backward(node.backward);
    int& made = out.id_of[static_cast<size_t>(node.id)];
    if (node.op == Op::StoreBf16) {  // one copy per value
      int& c = copy_of[static_cast<size_t>(node.inputs[0])];
      if (c < 0) c = store_bf16(g.value(out.id_of[static_cast<size_t>(node.inputs[0])])).id;
      made = c;
      continue;
    }
    std::vector<Value> in;
    for (int i : node.inputs)
      in.push_back(g.value(node.op == Op::Contract ? operand(i, node.backward) : out.id_of[static_cast<size_t>(i)]));
    Attrs attrs = node.attrs;
    attrs.bf16 = attrs.bf16 || attention(node.op);  // attention's products in bf16 too (Attrs::bf16)
    made = op_info(node.op).cls == OpClass::Leaf ? g.add_leaf(node.op, node.type, attrs, node.name).id
                                                 : g.add(node.op, in, attrs, node.name).id;
  }
  g.set_building_backward(false);
  verify(g);
  return out;
}

}  // namespace halyard
