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

// Two tiled regions with their own tile grids: the MLP's chains (ffn-wide)
// and the LM head + loss (vocab-wide). A whole value read by a region is
// sliced on that region's grid.
constexpr int kMlp = 0, kLoss = 1;

struct Tiler {
  const Graph& src;
  Graph& g;
  std::vector<int64_t> starts[2], lengths[2];
  std::vector<bool> tiled;
  std::vector<int> region;  // of each tiled op
  std::vector<Value> whole;
  std::vector<std::vector<Value>> tiles;  // tiled ops' tiles; slices of whole values per (id, region)

  size_t count(int r) const { return starts[r].size(); }

  Value get_whole(int id) {
    Value& w = whole[static_cast<size_t>(id)];
    if (w.valid()) return w;
    const Node& n = src.node(id);
    HALYARD_CHECK(tiled[static_cast<size_t>(id)], "%" << id << " was not built");
    const int r = region[static_cast<size_t>(id)];
    std::vector<Value> parts;
    for (size_t k = 0; k < count(r); ++k) parts.push_back(get_tile(id, k, r));
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

  Value get_tile(int id, size_t k, int r) {
    const bool is_tiled = tiled[static_cast<size_t>(id)];
    auto& ts = tiles[static_cast<size_t>(2 * id + (is_tiled ? 0 : r))];
    if (ts.empty()) ts.resize(count(r));
    if (ts[k].valid()) return ts[k];
    const Node& n = src.node(id);
    if (!is_tiled) {
      Value w = get_whole(id);
      return ts[k] = n.type.has("seq") ? slice_seq(w, starts[r][k], lengths[r][k]) : w;
    }
    std::vector<Value> ins;
    for (int i : n.inputs) ins.push_back(src.node(i).type.has("seq") ? get_tile(i, k, r) : get_whole(i));
    Attrs a = n.attrs;
    a.seq_tile = true;
    return ts[k] = g.add(n.op, ins, a, n.name);
  }
};

}  // namespace

bool is_wide(const Node& n) {
  return n.type.has("seq") && (n.type.has("ffn") || n.type.has("vocab"));
}

bool is_wide_tile(const Node& n) { return is_wide(n) && n.attrs.seq_tile; }

RebuiltGraph tile_sequence(const Graph& src, int loss, int64_t tile) { return tile_sequence(src, loss, tile, tile); }

RebuiltGraph tile_sequence(const Graph& src, int loss, int64_t mlp_tile, int64_t loss_tile) {
  RebuiltGraph out;
  out.graph = std::make_unique<Graph>();
  Graph& g = *out.graph;
  int64_t seq = 0;
  for (const Node& n : src.nodes())
    if (n.op == Op::Input && n.type.has("seq")) seq = n.type.size("seq");
  const size_t n_nodes = static_cast<size_t>(src.size());
  Tiler t{src, g, {}, {}, std::vector<bool>(n_nodes, false), std::vector<int>(n_nodes, kMlp),
          std::vector<Value>(n_nodes), std::vector<std::vector<Value>>(2 * n_nodes)};
  const int64_t sizes[2] = {mlp_tile, loss_tile};
  for (int r : {kMlp, kLoss})
    if (sizes[r] > 0 && sizes[r] < seq)
      for (int64_t at = 0; at < seq; at += sizes[r]) {
        t.starts[r].push_back(at);
        t.lengths[r].push_back(std::min(sizes[r], seq - at));
      }
  for (const Node& n : src.nodes()) {
    if (n.id > loss) break;
    bool wide_input = false;
    int r = n.type.has("vocab") || n.op == Op::CrossEntropy ? kLoss : kMlp;
    for (int i : n.inputs) {
      wide_input = wide_input || is_wide(src.node(i));
      if (t.tiled[static_cast<size_t>(i)] && t.region[static_cast<size_t>(i)] == kLoss) r = kLoss;
    }
    t.region[static_cast<size_t>(n.id)] = r;
    t.tiled[static_cast<size_t>(n.id)] =
        t.count(r) > 1 && token_local(src, n) && n.type.has("seq") == (n.op != Op::CrossEntropy) &&
        (is_wide(n) || wide_input);
  }
  // A token-local value that only tiles of one region read (the MLP's
  // input norm, the final norm before the LM head) is computed per tile
  // too: it never exists whole, and in the backward each tile's gradient
  // of the value it reads (the residual stream) is added to that value's
  // gradient as soon as the tile is done, instead of every tile's part of
  // the norm's gradient living until the last tile (schedules/program.h:
  // a sum written over rows). Its inputs are read per tile; one whose
  // input is itself tiled stays whole (its tiles may be on the other
  // region's grid).
  std::vector<int> read_by(n_nodes, -1);  // the region of every tile reading a value; -2: mixed or whole
  for (const Node& n : src.nodes()) {
    if (n.id > loss) break;
    const int by = t.tiled[static_cast<size_t>(n.id)] ? t.region[static_cast<size_t>(n.id)] : -2;
    for (int i : n.inputs) {
      int& r = read_by[static_cast<size_t>(i)];
      r = r == -1 || r == by ? by : -2;
    }
  }
  for (const Node& n : src.nodes()) {
    if (n.id > loss) break;
    const int r = read_by[static_cast<size_t>(n.id)];
    if (r < 0 || t.tiled[static_cast<size_t>(n.id)] || !token_local(src, n) || n.op == Op::CrossEntropy) continue;
    bool tiled_input = false;
    for (int i : n.inputs) tiled_input = tiled_input || t.tiled[static_cast<size_t>(i)];
    if (tiled_input) continue;
    t.tiled[static_cast<size_t>(n.id)] = true;
    t.region[static_cast<size_t>(n.id)] = r;
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
