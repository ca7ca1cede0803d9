// The graph IR: construction, verification and printing (see graph.h).
#include "dsl/graph.h"

#include <set>
#include <sstream>

#include "dsl/error.h"
#include "dsl/op_table.h"
#include "dsl/ops.h"

namespace halyard {

const char* op_name(Op op) { return op_info(op).name.c_str(); }

bool is_collective(Op op) { return op_info(op).collective; }

bool is_runtime_op(Op op) { return op_info(op).cls == OpClass::Runtime; }

const Node& Value::node() const {
  HALYARD_CHECK(valid(), "use of an empty Value");
  return graph->node(id);
}

const TensorType& Value::type() const { return node().type; }

Value Graph::add(Op op, const std::vector<Value>& inputs, Attrs attrs, std::string name) {
  Node n;
  n.op = op;
  for (const Value& v : inputs) {
    if (v.graph != this)
      throw UserError(std::string("error: ") + op_name(op) +
                      " mixes values of two different graphs.\nlegal: build a model in one Graph.");
    n.inputs.push_back(v.id);
  }
  n.type = infer_type(*this, op, n.inputs, attrs);
  n.attrs = std::move(attrs);
  n.name = name.empty() ? prefix_ : std::move(name);
  n.backward = building_backward_;
  n.id = size();
  nodes_.push_back(std::move(n));
  return Value{this, nodes_.back().id};
}

Value Graph::add_leaf(Op op, TensorType type, Attrs attrs, std::string name) {
  HALYARD_CHECK(op == Op::Input || op == Op::Param || op == Op::Fill, "not a leaf op");
  if (op != Op::Fill) {
    if (name.empty())
      throw UserError(std::string("error: ") + op_name(op) + " " + type.str() +
                      "\ninputs and parameters need a name.\nlegal: a non-empty, unique name.");
    for (const Node& other : nodes_)
      if ((other.op == Op::Input || other.op == Op::Param) && other.name == name)
        throw UserError(std::string("error: ") + op_name(op) + " \"" + name + "\" " + type.str() +
                        "\nthe name is already used by " + describe(*this, other.id) +
                        ".\nlegal: each input and parameter has a unique name.");
  }
  Node n;
  n.op = op;
  n.type = std::move(type);
  n.attrs = std::move(attrs);
  n.name = std::move(name);
  n.backward = building_backward_;
  n.id = size();
  nodes_.push_back(std::move(n));
  return Value{this, nodes_.back().id};
}

Value Graph::find(const std::string& name) {
  std::vector<std::string> names;
  for (const Node& n : nodes_)
    if (n.op == Op::Input || n.op == Op::Param) {
      if (n.name == name) return Value{this, n.id};
      names.push_back(n.name);
    }
  if (names.size() > 12) {
    names.resize(12);
    names.push_back("...");
  }
  throw UserError("error: no input or parameter named \"" + name + "\".\nlegal names: " + join(names));
}

std::vector<Value> Graph::params() {
  std::vector<Value> out;
  for (const Node& n : nodes_)
    if (n.op == Op::Param) out.push_back(Value{this, n.id});
  return out;
}

std::vector<Value> Graph::inputs() {
  std::vector<Value> out;
  for (const Node& n : nodes_)
    if (n.op == Op::Input) out.push_back(Value{this, n.id});
  return out;
}

std::vector<int> forward_reads(const Graph& g, int node_id) {
  std::vector<int> out;
  const Node& n = g.node(node_id);
  if (!n.backward) return out;
  for (int i : n.inputs)
    if (!g.node(i).backward) out.push_back(i);
  return out;
}

std::vector<int> residuals(const Graph& g) {
  std::set<int> s;
  for (const Node& n : g.nodes())
    for (int i : forward_reads(g, n.id)) s.insert(i);
  return {s.begin(), s.end()};
}

std::string describe(const Graph& g, int id) {
  const Node& n = g.node(id);
  std::string s = "%" + std::to_string(id);
  if (!n.name.empty()) s += " \"" + n.name + "\"";
  return s + " " + n.type.str();
}

void verify(const Graph& g) {
  std::set<std::string> names;
  for (int id = 0; id < g.size(); ++id) {
    const Node& n = g.node(id);
    auto bad = [&](const std::string& why) {
      throw UserError("error: graph does not verify at " + describe(g, id) + " (" + op_name(n.op) +
                      ")\n" + why);
    };
    if (n.id != id) bad("node id " + std::to_string(n.id) + " at position " + std::to_string(id));
    for (int i : n.inputs)
      if (i < 0 || i >= id) bad("operand %" + std::to_string(i) + " is not an earlier node");
    if (n.op == Op::Input || n.op == Op::Param || n.op == Op::Fill) {
      if (!n.inputs.empty()) bad("a leaf has operands");
      make_type(n.type.dtype, n.type.axes, std::string(op_name(n.op)) + " \"" + n.name + "\"");
      if (n.op != Op::Fill && !names.insert(n.name).second) bad("duplicate name \"" + n.name + "\"");
      continue;
    }
    TensorType t = infer_type(g, n.op, n.inputs, n.attrs);
    if (t != n.type) bad("stored type " + n.type.str() + " but its operands give " + t.str());
    if (!n.backward)
      for (int i : n.inputs)
        if (g.node(i).backward) bad("a forward node reads backward node %" + std::to_string(i));
  }
}

std::string print(const Graph& g) {
  std::ostringstream os;
  bool in_backward = false;
  for (const Node& n : g.nodes()) {
    if (n.backward && !in_backward) {
      os << "# ---- backward ----\n";
      in_backward = true;
    }
    os << "%" << n.id << " = " << op_name(n.op);
    if (n.op == Op::Input || n.op == Op::Param) {
      os << " \"" << n.name << "\"";
    } else {
      os << "(";
      for (size_t i = 0; i < n.inputs.size(); ++i) os << (i ? ", %" : "%") << n.inputs[i];
      os << ")";
    }
    switch (n.op) {
      case Op::Fill: os << " value=" << n.attrs.value; break;
      case Op::RmsNorm: os << " eps=" << n.attrs.eps; break;
      case Op::Rope:
        os << " theta=" << n.attrs.theta << (n.attrs.inverse ? " inverse" : "");
        if (n.attrs.rope_scaling.factor > 0) os << " llama3_factor=" << n.attrs.rope_scaling.factor;
        break;
      case Op::SeqToHeads:
      case Op::HeadsToSeq:
      case Op::GatherSeq:
      case Op::AllReduce: os << " over " << n.attrs.mesh_axis << "=" << n.attrs.degree; break;
      case Op::SliceSeq: os << " [" << n.attrs.offset << ", " << n.attrs.offset + n.attrs.size << ")"; break;
      case Op::PadSeq: os << " at " << n.attrs.offset << " of " << n.attrs.size; break;
      default: break;
    }
    os << " : " << n.type.str();
    if (n.op != Op::Input && n.op != Op::Param && !n.name.empty()) os << "  # " << n.name;
    os << "\n";
  }
  return os.str();
}

}  // namespace halyard
