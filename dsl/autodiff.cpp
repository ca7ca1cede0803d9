// Reverse-mode autodiff (see autodiff.h).
#include "dsl/autodiff.h"

#include "dsl/error.h"
#include "dsl/ops.h"

namespace halyard {

Value Gradients::operator[](Value v) const {
  auto it = of.find(v.id);
  HALYARD_CHECK(it != of.end(), "no gradient was requested for %" << v.id);
  return it->second;
}

Gradients grad(Value loss, const std::vector<Value>& wrt, const GradOptions& options) {
  Graph& g = *loss.graph;
  if (loss.type().rank() != 0 || !is_float(loss.type().dtype))
    throw UserError("error: grad(" + describe(g, loss.id) +
                    ")\nthe loss must be a floating-point scalar.\nlegal: a value of type f32[] or f64[], "
                    "e.g. the result of cross_entropy.");
  const int n = loss.id + 1;
  // Values on a path from some wrt to the loss: the only ones that need a cotangent.
  std::vector<bool> depends(static_cast<size_t>(n), false);
  for (const Value& w : wrt) {
    if (w.graph != &g || !is_float(w.type().dtype))
      throw UserError("error: grad with respect to " + describe(*w.graph, w.id) +
                      "\nonly floating-point values of the loss's graph have gradients.");
    if (w.id < n) depends[static_cast<size_t>(w.id)] = true;
  }
  for (int id = 0; id < n; ++id)
    for (int i : g.node(id).inputs)
      if (depends[static_cast<size_t>(i)]) depends[static_cast<size_t>(id)] = true;

  g.set_building_backward(true);
  g.set_name_prefix("");
  // Forward values as the backward reads them: clones for rematerialized ones.
  std::map<int, Value> clones;
  // Each forward value's decision, asked once: a schedule's answer matches
  // every rule against the value's labels, and the backward reads most
  // values several times (the search builds thousands of backwards).
  std::vector<signed char> remat_of(g.nodes().size(), -1);
  ForwardValue fwd = [&](int id) -> Value {
    const Node& x = g.node(id);
    signed char& decided = remat_of[static_cast<size_t>(id)];
    if (decided < 0)
      decided = options.rematerialize && !x.backward && x.op != Op::Input && x.op != Op::Param &&
                options.rematerialize(x);
    if (!decided) return g.value(id);
    if (auto it = clones.find(id); it != clones.end()) return it->second;
    const Node copy = x;
    Value c;
    if (copy.op == Op::Fill) {
      c = fill(g, copy.type, copy.attrs.value);
    } else {
      // A ring's merge recomputes its blocks' outputs first, in block order
      // (a block that is the merge of the blocks before it, with its own
      // blocks first): so each merge follows its block, as in the forward
      // (schedules/sharding.cpp). In operand order the merged statistics
      // come first, and every block's statistics, computed with its output
      // in one kernel, would be recomputed before any merge.
      if (copy.op == Op::AttentionMerge)
        for (size_t at = kMergeBlocks; at + 3 < copy.inputs.size(); at += kMergeBlockOperands) fwd(copy.inputs[at + 3]);
      std::vector<Value> ins;
      for (int i : copy.inputs) ins.push_back(fwd(i));
      c = g.add(copy.op, ins, copy.attrs, copy.name);
    }
    return clones[id] = c;
  };
  std::vector<Value> adj(static_cast<size_t>(n));
  adj[static_cast<size_t>(loss.id)] = fill(g, loss.type(), 1.0);
  for (int id = loss.id; id >= 0; --id) {
    Value dout = adj[static_cast<size_t>(id)];
    const Node& node = g.node(id);  // copy-free: nodes only grow at the back
    if (!dout.valid() || node.inputs.empty()) continue;
    std::vector<bool> needed;
    bool any = false;
    for (int i : node.inputs) {
      needed.push_back(depends[static_cast<size_t>(i)]);
      any = any || needed.back();
    }
    if (!any) continue;
    const Node snapshot = node;  // g grows below; keep the record stable
    g.set_name_prefix(snapshot.name);  // backward values carry their forward value's label (its layer)
    std::vector<Value> din = vjp(g, snapshot, dout, needed, fwd);
    for (size_t k = 0; k < snapshot.inputs.size(); ++k) {
      if (!needed[k]) continue;
      // Ring attention's merge routes its cotangent around its partial
      // results (dsl/vjp.cpp): those operands get none.
      if (snapshot.op == Op::AttentionMerge && !din[k].valid()) continue;
      HALYARD_CHECK(din[k].valid(), op_name(snapshot.op) << " gave no cotangent for operand " << k);
      Value& acc = adj[static_cast<size_t>(snapshot.inputs[k])];
      acc = acc.valid() ? add(acc, din[k]) : din[k];
    }
  }
  Gradients out;
  for (const Value& w : wrt) {
    Value a = w.id < n ? adj[static_cast<size_t>(w.id)] : Value{};
    out.of[w.id] = a.valid() ? a : fill(g, w.type(), 0.0);
  }
  g.set_building_backward(false);
  g.set_name_prefix("");
  return out;
}

}  // namespace halyard
