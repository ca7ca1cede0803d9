// Sequence tiling of the wide ops (see tiling.h).
#include "schedules/tiling.h"

#include <vector>

#include "dsl/error.h"
#include "dsl/op_table.h"
#include "dsl/ops.h"

namespace halyard {
namespace {

// Tile k of the output needs tile k of the inputs: the op table's
// token-local ops, except a contraction that sums over seq, and only on
// values that have a seq axis (the loss is a sum over tokens: tiles add up).
bool token_local(const Graph& g, const Node& n) {
  if (!op_info(n.op).token_local) return false;
  if (n.op == Op::CrossEntropy) return true;
  if (n.op == Op::Contract)
    for (int i : n.inputs)
      if (g.node(i).type.has("seq") && !n.type.has("seq")) return false;
  return n.type.has("seq");
}

struct Tiler {
  const Graph& src;
  Graph& g;
  std::vector<int64_t> starts, lengths;
  std::vector<bool> tiled;
  std::vector<Value> whole;
  std::vector<std::vector<Value>> tiles;  // tiled ops' tiles, or slices of whole values

  size_t count() const { return starts.size(); }

  Value get_whole(int id) {
    Value& w = whole[static_cast<size_t>(id)];
    if (w.valid()) return w;
    const Node& n = src.node(id);
    HALYARD_CHECK(tiled[static_cast<size_t>(id)], "%" << id << " was not built");
    std::vector<Value> parts;
    for (size_t k = 0; k < count(); ++k) parts.push_back(get_tile(id, k));
    g.set_name_prefix(n.name);
    if (n.op == Op::CrossEntropy) {  // sums over tokens / the global count: they add up
      w = parts[0];
      for (size_t k = 1; k < parts.size(); ++k) w = add(w, parts[k]);
    } else {
      w = concat_seq(parts);
    }
    g.set_name_prefix("");
    return w;
  }

  Value get_tile(int id, size_t k) {
    auto& ts = tiles[static_cast<size_t>(id)];
    if (ts.empty()) ts.resize(count());
    if (ts[k].valid()) return ts[k];
    const Node& n = src.node(id);
    if (!tiled[static_cast<size_t>(id)]) {
      Value w = get_whole(id);
      return ts[k] = n.type.has("seq") ? slice_seq(w, starts[k], lengths[k]) : w;
    }
    std::vector<Value> ins;
    for (int i : n.inputs) ins.push_back(src.node(i).type.has("seq") ? get_tile(i, k) : get_whole(i));
    return ts[k] = g.add(n.op, ins, n.attrs, n.name);
  }
};

}  // namespace

bool is_wide(const Node& n) {
  return n.type.has("seq") && (n.type.has("ffn") || n.type.has("vocab"));
}

RebuiltGraph tile_sequence(const Graph& src, int loss, int64_t tile) {
  RebuiltGraph out;
  out.graph = std::make_unique<Graph>();
  Graph& g = *out.graph;
  int64_t seq = 0;
  for (const Node& n : src.nodes())
    if (n.op == Op::Input && n.type.has("seq")) seq = n.type.size("seq");
  Tiler t{src, g, {}, {}, std::vector<bool>(static_cast<size_t>(src.size()), false),
          std::vector<Value>(static_cast<size_t>(src.size())), std::vector<std::vector<Value>>(static_cast<size_t>(src.size()))};
  if (tile > 0 && tile < seq)
    for (int64_t at = 0; at < seq; at += tile) {
      t.starts.push_back(at);
      t.lengths.push_back(std::min(tile, seq - at));
    }
  for (const Node& n : src.nodes()) {
    if (n.id > loss) break;
    bool wide_input = false;
    for (int i : n.inputs) wide_input = wide_input || is_wide(src.node(i));
    t.tiled[static_cast<size_t>(n.id)] =
        t.count() > 1 && token_local(src, n) && n.type.has("seq") == (n.op != Op::CrossEntropy) &&
        (is_wide(n) || wide_input);
  }
  // Whole values in order; tiled ones are built when a whole value needs
  // them, all of one tile's chain at a time.
  for (const Node& n : src.nodes()) {
    if (n.id > loss) break;
    if (t.tiled[static_cast<size_t>(n.id)]) continue;
    Value v;
    if (n.op == Op::Input || n.op == Op::Param || n.op == Op::Fill) {
      v = g.add_leaf(n.op, n.type, n.attrs, n.name);
    } else {
      std::vector<Value> ins;
      for (int i : n.inputs) ins.push_back(t.get_whole(i));
      v = g.add(n.op, ins, n.attrs, n.name);
    }
    t.whole[static_cast<size_t>(n.id)] = v;
  }
  out.loss = t.get_whole(loss);
  for (const Node& n : src.nodes())
    if (n.op == Op::Param && n.id <= loss) out.params.push_back(t.whole[static_cast<size_t>(n.id)]);
  return out;
}

}  // namespace halyard
