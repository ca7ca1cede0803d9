// Sharding a model's graph over the sequence (see sharding.h).
#include "schedules/sharding.h"

#include <array>
#include <map>

#include "dsl/error.h"
#include "dsl/ops.h"

namespace halyard {
namespace {

bool ulysses_can_split(int64_t heads, int64_t kv_heads, int64_t sp) {
  return heads % sp == 0 && heads_per_rank(kv_heads, sp) > 0;
}

std::string degrees_string(const std::vector<int64_t>& d) {
  std::vector<std::string> s;
  for (int64_t x : d) s.push_back(std::to_string(x));
  return join(s);
}

// q, k and v (ins[0..2]) from seq@sp to heads@sp, made v first. That is
// the order GCC evaluated them in as arguments, kept so that the graphs and
// libraries stay what they were; an argument list's order is unspecified,
// and clang's (left to right) numbered the nodes, and so ordered the
// step's all-to-alls and staging slots, otherwise.
std::array<Value, 3> to_heads(const std::vector<Value>& ins, const std::string& mesh, int64_t degree) {
  std::array<Value, 3> qkv;
  for (int i = 2; i >= 0; --i) qkv[static_cast<size_t>(i)] = seq_to_heads(ins[static_cast<size_t>(i)], mesh, degree);
  return qkv;
}

// Ring attention on one rank: its queries against its own keys, then
// against each other rank's key block as the blocks pass around the ring
// (block j came from the rank j places before), merged by the online-softmax
// rule as each arrives: the blocks so far are one block of the next merge
// (with the rank's own k and v, which take the keys' gradient), so that two
// block outputs are alive at a time, not one per rank. Keys carry their
// tokens' indices in the row with them, for the mask.
Value ring_attention(Value q, Value k, Value v, Value pos, Value index, const std::string& mesh, int64_t sp,
                     const std::string& layout) {
  RingBlock merged;
  Value kb = k, vb = v, ib = index;
  for (int64_t j = 0; j < sp; ++j) {
    RingBlock b{kb, vb, ib, {}, {}};
    // The next block's pass comes first, so that it runs under this block's kernels.
    if (j + 1 < sp) kb = ring_shift(kb, mesh, sp), vb = ring_shift(vb, mesh, sp), ib = ring_shift(ib, mesh, sp);
    Attrs block;
    block.degree = sp;
    block.offset = j;
    block.layout = layout;
    b.lse = attention_block_lse(q, b.k, pos, TokenIndex{index, b.key_index}, block);
    b.out = attention_block(q, b.k, b.v, pos, TokenIndex{index, b.key_index}, block);
    if (j == 0) {
      merged = b;
      if (sp > 1) continue;
      const Value lse = lse_merge({b.lse});
      return attention_merge(q, pos, index, lse, {b});
    }
    const Value lse = lse_merge({merged.lse, b.lse});
    merged = {k, v, index, attention_merge(q, pos, index, lse, {merged, b}), lse};
  }
  return merged.out;
}

}  // namespace

std::vector<int64_t> legal_sp_degrees(const Graph& g, int64_t max) {
  std::vector<int64_t> out;
  for (int64_t p = 1; p <= max; ++p) {
    bool ok = true;
    for (const Node& n : g.nodes())
      if (n.op == Op::Attention)
        ok = ok && ulysses_can_split(g.node(n.inputs[0]).type.size("heads"), g.node(n.inputs[1]).type.size("kv_heads"), p);
    if (ok) out.push_back(p);
  }
  return out;
}

RebuiltGraph shard_sequence(const Graph& src, int loss, const Schedule& s, int64_t sp) {
  if (sp < 1) throw UserError("error: sp degree " + std::to_string(sp) + "\nlegal: sp >= 1.");
  const bool split = !s.split_sequence.empty() && sp > 1;
  if (sp > 1 && s.split_sequence.empty())
    throw UserError("error: schedule \"" + s.name + "\" keeps the whole sequence on each rank, but the model is built "
                    "for sp=" + std::to_string(sp) + " ranks.\nlegal: a schedule with split_sequence(sp) and "
                    "redistribute_heads(ulysses) (preset \"ulysses\"), or sp=1.");
  const std::string mesh = s.split_sequence;
  RebuiltGraph out;
  out.graph = std::make_unique<Graph>();
  Graph& g = *out.graph;
  std::vector<Value> map(static_cast<size_t>(src.size()));
  std::map<std::pair<int, std::string>, Value> gathered;  // positions gathered over a mesh axis, once each
  // Each token's index in the row, for ring attention's mask: an input the
  // runtime fills from the rank and the layout (runtime/model.h).
  Value token_index;
  auto row_index = [&](const Value& positions) {
    if (!token_index.valid())
      token_index = g.add_leaf(Op::Input, TensorType{DType::i32, positions.type().axes}, {}, kTokenIndexInput);
    return token_index;
  };
  // A value of the whole sequence group's tokens, gathered over `axis` once.
  auto gather = [&](const Value& x, const std::string& axis, int64_t degree) {
    Value& v = gathered[{x.id, axis}];
    if (!v.valid()) v = gather_seq(x, axis, degree);
    return v;
  };
  auto in = [&](const Node& n, size_t k) { return map[static_cast<size_t>(n.inputs[k])]; };

  for (const Node& n : src.nodes()) {
    if (n.id > loss) break;
    Value v;
    if (n.op == Op::Input || n.op == Op::Param || n.op == Op::Fill) {
      TensorType t = n.type;
      if (split && n.op == Op::Input)
        for (Axis& a : t.axes)
          if (a.name == "seq") a = Axis{"seq", a.size, mesh, a.size * sp};
      v = g.add_leaf(n.op, t, n.attrs, n.name);
    } else {
      std::vector<Value> ins;
      for (size_t k = 0; k < n.inputs.size(); ++k) ins.push_back(in(n, k));
      const std::string strategy = split && n.op == Op::Attention ? s.strategy(n) : "";
      if (split && n.op == Op::Attention && strategy != "ulysses" && strategy != "ring" && strategy != "hybrid")
        throw UserError("error: schedule \"" + s.name + "\" splits the sequence over sp=" + std::to_string(sp) +
                        ", but no attention rule gives " + describe(src, n.id) +
                        " a head redistribution.\nlegal: an attention rule matching it, e.g. {\"match\": \"" +
                        (n.name.empty() ? std::string("*") : n.name) + "\", \"strategy\": \"ulysses\"} (or \"ring\").");
      if (strategy == "ring") {
        Value index = row_index(ins[3]);
        g.set_name_prefix(n.name);
        v = ring_attention(ins[0], ins[1], ins[2], ins[3], index, mesh, sp, s.sequence_layout);
        g.set_name_prefix("");
      } else if (strategy == "hybrid") {
        // Ulysses within groups of u consecutive ranks, then ring attention
        // across the sp / u groups on the heads each rank got.
        const int64_t u = s.attention_rule(n)->ulysses_degree;
        const int64_t heads = n.type.size("heads"), kv = src.node(n.inputs[1]).type.size("kv_heads");
        if (u <= 1 || u >= sp || sp % u != 0 || !ulysses_can_split(heads, kv, u)) {
          std::vector<int64_t> legal;
          for (int64_t d = 2; d < sp; ++d)
            if (sp % d == 0 && ulysses_can_split(heads, kv, d)) legal.push_back(d);
          throw UserError("error: schedule \"" + s.name + "\" splits " + describe(src, n.id) + " over sp=" +
                          std::to_string(sp) + " ranks as hybrid with ulysses_degree " + std::to_string(u) +
                          ",\nbut the Ulysses degree must divide sp, lie strictly between 1 and sp, divide heads=" +
                          std::to_string(heads) + ", and divide kv_heads=" + std::to_string(kv) +
                          " or be a multiple of it.\nlegal ulysses_degree at sp=" + std::to_string(sp) + ": " +
                          (legal.empty() ? std::string("none (use \"ring\" or \"ulysses\")") : degrees_string(legal)) + ".");
        }
        Value pos = gather(ins[3], kUlyssesAxis, u), index = gather(row_index(ins[3]), kUlyssesAxis, u);
        g.set_name_prefix(n.name);
        const auto [q, k, vh] = to_heads(ins, kUlyssesAxis, u);
        Value a = ring_attention(q, k, vh, pos, index, kRingAxis, sp / u, s.sequence_layout);
        v = heads_to_seq(a, kUlyssesAxis, u);
        g.set_name_prefix("");
      } else if (strategy == "ulysses") {
        const int64_t heads = n.type.size("heads"), kv = src.node(n.inputs[1]).type.size("kv_heads");
        if (!ulysses_can_split(heads, kv, sp))
          throw UserError("error: schedule \"" + s.name + "\" splits " + describe(src, n.id) + " over sp=" +
                          std::to_string(sp) + " ranks with Ulysses,\nbut it has heads=" + std::to_string(heads) +
                          ", kv_heads=" + std::to_string(kv) + ": each rank takes heads/sp query heads, so sp must "
                          "divide heads, and kv_heads must divide sp or be a multiple of it (fewer kv heads than "
                          "ranks are replicated).\nlegal sp degrees for this model: " +
                          degrees_string(legal_sp_degrees(src, heads)) + "; or \"ring\" attention, which takes any degree.");
        if (s.sequence_layout == "zigzag")
          throw UserError("error: schedule \"" + s.name + "\" places the sequence zigzag, but " + describe(src, n.id) +
                          " is split with Ulysses, whose kernels need the gathered positions in order.\nlegal: "
                          "\"sequence_layout\": \"contiguous\" with Ulysses, or the strategy \"ring\" for every attention.");
        // The whole sequence, in order: its seq index is the token's index in the row.
        Value pos = gather(ins[3], mesh, sp);
        g.set_name_prefix(n.name);
        const auto [q, k, vh] = to_heads(ins, mesh, sp);
        Value a = attention(q, k, vh, pos);
        v = heads_to_seq(a, mesh, sp);
        g.set_name_prefix("");
      } else {
        v = g.add(n.op, ins, n.attrs, n.name);
        // Sums over this rank's tokens become sums over every token of the
        // mesh: its whole sequence (sp) and every data-parallel replica's
        // rows (dp, decided at launch; on one rank this is a copy).
        if (n.op == Op::TokenCount || n.op == Op::CrossEntropy) {
          g.set_name_prefix(n.name);
          v = all_reduce(v, kWholeMesh, sp);
          g.set_name_prefix("");
        }
      }
    }
    map[static_cast<size_t>(n.id)] = v;
  }
  out.loss = map[static_cast<size_t>(loss)];
  for (const Node& n : src.nodes())
    if (n.op == Op::Param && n.id <= loss) out.params.push_back(map[static_cast<size_t>(n.id)]);
  return out;
}

}  // namespace halyard
