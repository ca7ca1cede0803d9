// Op builders and their type rules (see ops.h).
//
// Every check here guards against a user's mistake, so each throws UserError in
// the house shape: the op and its operands with types, the rule broken with
// the numbers involved, and what would be legal.
#include "dsl/ops.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "dsl/error.h"
#include "dsl/op_table.h"

namespace halyard {
namespace {

struct Checker {
  const Graph& g;
  Op op;
  const std::vector<int>& in;

  std::string call() const {
    std::string s = std::string(op_name(op)) + "(";
    for (size_t i = 0; i < in.size(); ++i) s += (i ? ", " : "") + describe(g, in[i]);
    return s + ")";
  }
  [[noreturn]] void fail(const std::string& rule, const std::string& legal) const {
    std::string msg = "error: " + call() + "\n" + rule;
    if (!legal.empty()) msg += "\nlegal: " + legal;
    throw UserError(msg);
  }
  const TensorType& t(size_t i) const { return g.node(in[i]).type; }
  std::string label(size_t i) const { return describe(g, in[i]); }

  void arity(size_t n) const {
    if (in.size() != n)
      fail(std::string(op_name(op)) + " takes " + std::to_string(n) + " operands, got " +
               std::to_string(in.size()) + ".", "");
  }
  void is_float_operand(size_t i) const {
    if (!is_float(t(i).dtype) || t(i).dtype == DType::bf16)
      fail("operand " + label(i) + " has dtype " + std::string(dtype_name(t(i).dtype)) + "; " +
               op_name(op) + " computes in floating point.",
           "f32 or f64 (bf16 is a storage type: convert first).");
  }
  void is_int_operand(size_t i, const char* role) const {
    if (t(i).dtype != DType::i32)
      fail(std::string(role) + " " + label(i) + " has dtype " +
               std::string(dtype_name(t(i).dtype)) + "; " + role + " must be integers.",
           "i32.");
  }
  void same_dtype(size_t i, size_t j) const {
    if (t(i).dtype != t(j).dtype)
      fail("operands have different dtypes: " + std::string(dtype_name(t(i).dtype)) + " vs " +
               std::string(dtype_name(t(j).dtype)) + ".",
           "convert one operand so both have the same dtype.");
  }
  void same_type(size_t i, size_t j) const {
    same_dtype(i, j);
    if (t(i).axes != t(j).axes)
      fail("operands must have the same axes, sizes and order: " + t(i).str() + " vs " +
               t(j).str() + ".",
           std::string(op_name(op)) + " is elementwise on tensors of one type; contract or "
               "reshape the other operand first.");
  }
  // The named axes must be exactly `want`, in this order.
  void layout(size_t i, const std::vector<std::string>& want, const char* role) const {
    if (t(i).axis_names() != want)
      fail(std::string(role) + " " + label(i) + " has axes [" + join(t(i).axis_names()) + "].",
           std::string(role) + " must have axes [" + join(want) + "] in that order.");
  }
  void same_size(size_t i, size_t j, const std::string& axis_i, const std::string& axis_j) const {
    int64_t a = t(i).size(axis_i), b = t(j).size(axis_j);
    if (a != b)
      fail("axis \"" + axis_i + "\" of " + label(i) + " is " + std::to_string(a) + " but axis \"" +
               axis_j + "\" of " + label(j) + " is " + std::to_string(b) + ".",
           "both must have the same size.");
  }
};

std::string divisors(int64_t n) {
  std::vector<std::string> d;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(std::to_string(i));
  return join(d);
}

// "16", or "64@sp" for a sharded axis: as types print it.
std::string extent(const Axis& a) {
  return a.sharded() ? std::to_string(a.global) + "@" + a.shard : std::to_string(a.size);
}

TensorType contract_type(const Checker& c, const Attrs& attrs) {
  const TensorType& a = c.t(0);
  const TensorType& b = c.t(1);
  c.is_float_operand(0);
  c.is_float_operand(1);
  c.same_dtype(0, 1);
  const auto& out = attrs.out_axes;
  for (const Axis& x : a.axes)
    if (b.has(x.name) && b.axes[static_cast<size_t>(b.index_of(x.name))] != x)
      c.fail("contraction over axes that do not match: axis \"" + x.name + "\" is " + extent(x) + " in " +
                 c.label(0) + " but " + extent(b.axes[static_cast<size_t>(b.index_of(x.name))]) + " in " +
                 c.label(1) + ".",
             "axes with the same name must have the same size (and sharding) in both operands.");
  TensorType r{a.dtype, {}};
  for (size_t i = 0; i < out.size(); ++i) {
    if (std::find(out.begin(), out.begin() + static_cast<long>(i), out[i]) != out.begin() + static_cast<long>(i))
      c.fail("output axis \"" + out[i] + "\" is listed twice.", "each axis once.");
    if (a.has(out[i]))
      r.axes.push_back(a.axes[static_cast<size_t>(a.index_of(out[i]))]);
    else if (b.has(out[i]))
      r.axes.push_back(b.axes[static_cast<size_t>(b.index_of(out[i]))]);
    else
      c.fail("output axis \"" + out[i] + "\" is in neither operand.",
             "axes of the operands: [" + join(a.axis_names()) + "] and [" + join(b.axis_names()) + "].");
  }
  auto summed_but_missing = [&](const TensorType& x, const TensorType& y, size_t xi, size_t yi) {
    for (const Axis& ax : x.axes)
      if (!r.has(ax.name) && !y.has(ax.name))
        c.fail("contraction over axes that do not match: axis \"" + ax.name + "\" of " +
                   c.label(xi) + " is summed over, but " + c.label(yi) + " has no such axis.",
               "sum only over axes both operands have: [" +
                   join([&] {
                     std::vector<std::string> s;
                     for (const Axis& z : x.axes)
                       if (y.has(z.name)) s.push_back(z.name);
                     return s;
                   }()) +
                   "].");
  };
  summed_but_missing(a, b, 0, 1);
  summed_but_missing(b, a, 1, 0);
  return r;
}

// bias_add(x, b): b's axes are some of x's, each with x's size and split.
// bias_add_grad(dy): the kept axes (attrs.out_axes) are some of dy's.
TensorType bias_type(const Checker& c, const Attrs& attrs) {
  c.is_float_operand(0);
  const TensorType& x = c.t(0);
  TensorType bias{x.dtype, {}};
  if (c.op == Op::BiasAdd) {
    c.is_float_operand(1);
    c.same_dtype(0, 1);
    bias = c.t(1);
  } else {
    for (const std::string& name : attrs.out_axes) {
      if (!x.has(name))
        c.fail("bias axis \"" + name + "\" is not an axis of " + c.label(0) + ".",
               "bias axes among [" + join(x.axis_names()) + "].");
      if (bias.has(name)) c.fail("bias axis \"" + name + "\" is listed twice.", "each axis once.");
      bias.axes.push_back(x.axes[static_cast<size_t>(x.index_of(name))]);
    }
  }
  const std::string what = c.op == Op::BiasAdd ? "bias " + c.label(1) : "the bias";
  if (bias.rank() == 0 || bias.rank() >= x.rank())
    c.fail(what + " has " + std::to_string(bias.rank()) + " axes and " + c.label(0) + " has " +
               std::to_string(x.rank()) + ": a bias repeats over at least one axis of x and has at least one of its own.",
           "a bias over some of [" + join(x.axis_names()) + "], e.g. f32[" + x.axes.back().name + "=" +
               std::to_string(x.axes.back().size) + "]; for tensors of one type use add.");
  for (const Axis& a : bias.axes) {
    const int i = x.index_of(a.name);
    if (i < 0)
      c.fail("axis \"" + a.name + "\" of " + what + " is not an axis of " + c.label(0) + ".",
             "a bias over some of [" + join(x.axis_names()) + "].");
    const Axis& xa = x.axes[static_cast<size_t>(i)];
    if (xa != a)
      c.fail("axis \"" + a.name + "\" is " + extent(xa) + " in " + c.label(0) + " but " + extent(a) + " in " + what + ".",
             "the bias's axes with x's sizes (and splits).");
  }
  return c.op == Op::BiasAdd ? x : bias;
}

TensorType attention_type(const Checker& c) {
  for (size_t i = 0; i < 3; ++i) c.is_float_operand(i);
  c.same_dtype(0, 1);
  c.same_dtype(0, 2);
  c.layout(0, {"batch", "seq", "heads", "head_dim"}, "query");
  c.layout(1, {"batch", "seq", "kv_heads", "head_dim"}, "key");
  c.layout(2, {"batch", "seq", "kv_heads", "head_dim"}, "value");
  c.is_int_operand(3, "positions");
  c.layout(3, {"batch", "seq"}, "positions");
  for (size_t i = 1; i < 3; ++i)
    for (const char* ax : {"batch", "seq", "head_dim"}) c.same_size(0, i, ax, ax);
  c.same_size(1, 2, "kv_heads", "kv_heads");
  c.same_size(0, 3, "batch", "batch");
  c.same_size(0, 3, "seq", "seq");
  int64_t h = c.t(0).size("heads"), kv = c.t(1).size("kv_heads");
  if (h % kv != 0)
    c.fail("heads (" + std::to_string(h) + ") is not a multiple of kv_heads (" +
               std::to_string(kv) + "): grouped-query attention shares each kv head among an "
               "equal group of query heads.",
           "kv_heads dividing " + std::to_string(h) + ": " + divisors(h) + ".");
  return c.t(0);
}

// A ring block's token indices (its last two operands): integers over the
// keys' and the queries' [batch, seq].
void token_indices(const Checker& c) {
  const size_t key = c.in.size() - 2, query = c.in.size() - 1;
  c.is_int_operand(key, "key index");
  c.layout(key, {"batch", "seq"}, "key index");
  c.same_size(1, key, "batch", "batch");
  c.same_size(1, key, "seq", "seq");
  c.is_int_operand(query, "query index");
  c.layout(query, {"batch", "seq"}, "query index");
  c.same_size(0, query, "batch", "batch");
  c.same_size(0, query, "seq", "seq");
}

// The heads-like axis of an all-to-all operand: heads or kv_heads.
size_t heads_axis(const Checker& c) {
  const TensorType& x = c.t(0);
  const std::string h = x.rank() == 4 ? x.axes[2].name : "";
  if (x.rank() != 4 || x.axes[0].name != "batch" || x.axes[1].name != "seq" || x.axes[3].name != "head_dim" ||
      (h != "heads" && h != "kv_heads"))
    c.fail(std::string(op_name(c.op)) + " moves attention operands: " + c.label(0) + " is not one.",
           "[batch, seq, heads, head_dim] or [batch, seq, kv_heads, head_dim].");
  return 2;
}

TensorType collective_type(const Checker& c, const Attrs& attrs) {
  const std::string& mesh = attrs.mesh_axis;
  const int64_t p = attrs.degree;
  if (mesh.empty() || p < 1)
    c.fail(std::string(op_name(c.op)) + " needs a mesh axis and a degree >= 1 (got \"" + mesh + "\", " +
               std::to_string(p) + ").",
           "e.g. mesh axis \"sp\" of degree 4.");
  TensorType r = c.t(0);
  // Hybrid sequence parallelism splits the sp axis in two, sp = sp_r x sp_u
  // (ring groups of Ulysses groups): an all-to-all over sp_u takes a seq
  // split over sp to one split over sp_r, u times longer. Over any other
  // axis it takes the split seq to the whole one.
  const std::string before = mesh == kUlyssesAxis ? std::string(kSeqAxis) : mesh;
  const std::string after = mesh == kUlyssesAxis ? std::string(kRingAxis) : std::string();
  auto seq_split_over = [&](const std::string& want) {
    const Axis& s = r.axes[1];
    if (s.shard != want)
      c.fail("axis seq of " + c.label(0) + (want.empty() ? std::string(" must be whole") : " must be split over " + want) +
                 " for " + op_name(c.op) + " over " + mesh + ".",
             want.empty() ? "a tensor with an unsplit seq axis."
                          : "a tensor whose seq is split over " + want + ", e.g. f32[batch, seq=N@" + want + ", ...].");
  };
  auto gathered = [&](const Axis& s) {
    return after.empty() ? Axis{"seq", s.global, "", 0} : Axis{"seq", s.size * p, after, s.global};
  };
  switch (c.op) {
    case Op::SeqToHeads: {
      c.is_float_operand(0);
      Axis& h = r.axes[heads_axis(c)];
      seq_split_over(before);
      if (h.sharded()) c.fail(h.name + " of " + c.label(0) + " is already split.", "a tensor whose heads are whole.");
      const int64_t per = heads_per_rank(h.size, p);
      if (per == 0)
        c.fail(h.name + " (" + std::to_string(h.size) + ") cannot be spread over " + std::to_string(p) +
                   " ranks: neither divides the other.",
               "degrees dividing " + std::to_string(h.size) + " or multiples of it.");
      r.axes[1] = gathered(r.axes[1]);
      h = Axis{h.name, per, mesh, h.size};
      return r;
    }
    case Op::HeadsToSeq: {
      c.is_float_operand(0);
      Axis& h = r.axes[heads_axis(c)];
      seq_split_over(after);
      if (h.shard != mesh) c.fail(h.name + " of " + c.label(0) + " must be split over " + mesh + ".", "");
      Axis& s = r.axes[1];
      if (s.size % p != 0)
        c.fail("seq (" + std::to_string(s.size) + ") is not a multiple of the degree " + std::to_string(p) + ".",
               "pad the sequence to a multiple of the degree.");
      s = Axis{"seq", s.size / p, before, after.empty() ? s.size : s.global};
      h = Axis{h.name, h.global, "", 0};
      return r;
    }
    case Op::GatherSeq: {
      c.is_int_operand(0, "positions");
      c.layout(0, {"batch", "seq"}, "positions");
      seq_split_over(before);
      r.axes[1] = gathered(r.axes[1]);
      return r;
    }
    case Op::RingShift:
      if (r.rank() < 2 || r.axes[1].name != "seq")
        c.fail("ring_shift moves a rank's slice of the sequence: " + c.label(0) + " has no seq axis second.",
               "a tensor [batch, seq@" + mesh + ", ...].");
      if (!r.axes[1].sharded() || r.axes[1].shard != mesh) seq_split_over(mesh);
      if (attrs.offset != 1 && attrs.offset != -1)
        c.fail("ring_shift by " + std::to_string(attrs.offset) + " ranks.", "1 (from the rank before) or -1.");
      return r;
    default:
      return r;  // AllReduce
  }
}

// A seq axis of `n` tokens, split like `like` (a sharded axis keeps its split).
Axis seq_axis(const Axis& like, int64_t n) {
  return like.sharded() ? Axis{"seq", n, like.shard, like.global / like.size * n} : Axis{"seq", n};
}

TensorType tile_type(const Checker& c, const Attrs& attrs) {
  if (c.in.empty()) c.fail("concat_seq needs at least one tile.", "one or more tensors with a seq axis.");
  TensorType r = c.t(0);
  const int s = r.index_of("seq");
  if (s < 0) c.fail(c.label(0) + " has no seq axis to tile.", "a tensor with a seq axis.");
  const Axis seq = r.axes[static_cast<size_t>(s)];
  switch (c.op) {
    case Op::SliceSeq:
      c.arity(1);
      if (attrs.offset < 0 || attrs.size < 1 || attrs.offset + attrs.size > seq.size)
        c.fail("tile [" + std::to_string(attrs.offset) + ", " + std::to_string(attrs.offset + attrs.size) +
                   ") is not inside seq (" + std::to_string(seq.size) + ").",
               "0 <= offset < offset + size <= " + std::to_string(seq.size) + ".");
      r.axes[static_cast<size_t>(s)] = seq_axis(seq, attrs.size);
      return r;
    case Op::PadSeq:
      c.arity(1);
      if (attrs.offset < 0 || attrs.offset + seq.size > attrs.size)
        c.fail("a tile of " + std::to_string(seq.size) + " at " + std::to_string(attrs.offset) +
                   " does not fit a sequence of " + std::to_string(attrs.size) + ".",
               "0 <= offset and offset + tile <= size.");
      r.axes[static_cast<size_t>(s)] = seq_axis(seq, attrs.size);
      return r;
    default: {  // ConcatSeq
      int64_t n = 0;
      for (size_t i = 0; i < c.in.size(); ++i) {
        TensorType a = c.t(i), b = c.t(0);
        if (a.index_of("seq") != s) c.fail("tile " + c.label(i) + " has no seq axis where the first has.", "");
        a.axes[static_cast<size_t>(s)] = b.axes[static_cast<size_t>(s)] = Axis{"seq", 0};
        if (a != b) c.fail("tiles differ in more than seq: " + c.t(i).str() + " vs " + c.t(0).str() + ".",
                           "tiles of one tensor.");
        n += c.t(i).size("seq");
      }
      r.axes[static_cast<size_t>(s)] = seq_axis(seq, n);
      return r;
    }
  }
}

}  // namespace

int64_t heads_per_rank(int64_t heads, int64_t degree) {
  if (heads % degree == 0) return heads / degree;
  if (degree % heads == 0) return 1;
  return 0;
}

TensorType infer_type(const Graph& g, Op op, const std::vector<int>& in, const Attrs& attrs) {
  Checker c{g, op, in};
  for (int id : in)
    HALYARD_CHECK(id >= 0 && id < g.size(), "operand id " << id << " out of range");
  if (is_registered_op(op)) return op_info(op).type(g, in, attrs);
  switch (op) {
    case Op::Input:
    case Op::Param:
    case Op::Fill:
      c.fail(std::string(op_name(op)) + " is a leaf; build it with its own builder.", "");
    case Op::Embedding: {
      c.arity(2);
      c.is_float_operand(0);
      c.is_int_operand(1, "token ids");
      const TensorType& table = c.t(0);
      if (table.rank() != 2 || table.axes[0].name != "vocab")
        c.fail("embedding table " + c.label(0) + " must be [vocab, X].", "a 2-d table whose first axis is vocab.");
      TensorType r = c.t(1);
      r.dtype = table.dtype;
      if (r.has(table.axes[1].name))
        c.fail("token ids already have axis \"" + table.axes[1].name + "\".", "ids without the table's feature axis.");
      r.axes.push_back(table.axes[1]);
      return r;
    }
    case Op::EmbeddingGrad: {
      c.arity(2);
      c.is_float_operand(0);
      c.is_int_operand(1, "token ids");
      const TensorType& dy = c.t(0);
      HALYARD_CHECK(dy.rank() == c.t(1).rank() + 1 && attrs.size > 0, "bad embedding_grad");
      return TensorType{dy.dtype, {{"vocab", attrs.size}, dy.axes.back()}};
    }
    case Op::Contract:
      c.arity(2);
      return contract_type(c, attrs);
    case Op::Add:
    case Op::Mul:
      c.arity(2);
      c.is_float_operand(0);
      c.is_float_operand(1);
      c.same_type(0, 1);
      return c.t(0);
    case Op::BiasAdd:
    case Op::BiasAddGrad:
      c.arity(op == Op::BiasAdd ? 2 : 1);
      return bias_type(c, attrs);
    case Op::Silu:
      c.arity(1);
      c.is_float_operand(0);
      return c.t(0);
    case Op::SiluGrad:
      c.arity(2);
      c.is_float_operand(0);
      c.same_type(0, 1);
      return c.t(0);
    case Op::RmsNorm:
    case Op::RmsNormGradX: {
      c.arity(op == Op::RmsNorm ? 2 : 3);
      c.is_float_operand(0);
      c.is_float_operand(1);
      c.same_dtype(0, 1);
      const TensorType& w = c.t(1);
      if (w.rank() != 1)
        c.fail("norm weight " + c.label(1) + " must have exactly one axis.", "a weight over the normalized axis, e.g. f32[model=N].");
      if (!c.t(0).has(w.axes[0].name))
        c.fail("the norm weight's axis \"" + w.axes[0].name + "\" is not an axis of " + c.label(0) + ".",
               "normalize over one of [" + join(c.t(0).axis_names()) + "].");
      c.same_size(0, 1, w.axes[0].name, w.axes[0].name);
      if (!(attrs.eps >= 0) || !std::isfinite(attrs.eps))
        c.fail("eps is " + std::to_string(attrs.eps) + ".", "a finite eps >= 0 (Llama uses 1e-5 or 1e-6).");
      if (op == Op::RmsNormGradX) c.same_type(0, 2);
      return c.t(0);
    }
    case Op::RmsNormGradW:
      c.arity(2);
      c.same_type(0, 1);
      return TensorType{c.t(0).dtype, {c.t(0).axes[static_cast<size_t>(c.t(0).index_of(attrs.axis))]}};
    case Op::Rope: {
      c.arity(2);
      c.is_float_operand(0);
      c.is_int_operand(1, "positions");
      const TensorType& x = c.t(0);
      if (!x.has("head_dim") || x.size("head_dim") % 2 != 0)
        c.fail("rope rotates pairs along head_dim, but " + c.label(0) +
                   (x.has("head_dim") ? " has an odd head_dim." : " has no head_dim axis."),
               "a tensor with an even head_dim axis.");
      for (const Axis& a : c.t(1).axes)
        if (!x.has(a.name) || x.size(a.name) != a.size)
          c.fail("positions " + c.label(1) + " do not index " + c.label(0) + ": axis \"" + a.name + "\".",
                 "positions over a subset of the tensor's axes with the same sizes, e.g. [batch, seq].");
      if (c.t(1).has("head_dim"))
        c.fail("positions must not have a head_dim axis.", "positions over [batch, seq].");
      if (!(attrs.theta > 0))
        c.fail("rope theta is " + std::to_string(attrs.theta) + ".", "theta > 0 (Llama 3 uses 500000).");
      return x;
    }
    case Op::Attention:
      if (c.in.size() != 6) c.arity(4);
      if (c.in.size() == 6) token_indices(c);
      return attention_type(c);
    case Op::AttentionLse: {
      if (c.in.size() != 5) c.arity(3);
      if (c.in.size() == 5) token_indices(c);
      c.is_float_operand(0);
      c.is_float_operand(1);
      c.same_dtype(0, 1);
      c.layout(0, {"batch", "seq", "heads", "head_dim"}, "query");
      c.layout(1, {"batch", "seq", "kv_heads", "head_dim"}, "key");
      c.is_int_operand(2, "positions");
      c.layout(2, {"batch", "seq"}, "positions");
      const TensorType& q = c.t(0);
      return TensorType{q.dtype, {q.axes[0], q.axes[1], q.axes[2]}};
    }
    case Op::AttentionGradQ:
    case Op::AttentionGradK:
    case Op::AttentionGradV: {
      if (c.in.size() != 9) c.arity(7);
      if (c.in.size() == 9) token_indices(c);
      attention_type(c);
      c.same_type(0, 4);
      c.same_type(0, 5);
      HALYARD_CHECK(c.t(6).rank() == 3, "lse must be [batch, seq, heads]");
      return c.t(op == Op::AttentionGradQ ? 0 : op == Op::AttentionGradK ? 1 : 2);
    }
    case Op::TokenCount:
      c.arity(1);
      c.is_int_operand(0, "labels");
      return TensorType{DType::f32, {}};
    case Op::CrossEntropy:
    case Op::CrossEntropyGrad: {
      c.arity(op == Op::CrossEntropy ? 3 : 4);
      c.is_float_operand(0);
      c.is_int_operand(1, "labels");
      const TensorType& logits = c.t(0);
      if (logits.rank() == 0 || logits.axes.back().name != "vocab")
        c.fail("logits " + c.label(0) + " must end with the vocab axis.", "logits [..., vocab].");
      std::vector<Axis> want(logits.axes.begin(), logits.axes.end() - 1);
      if (c.t(1).axes != want)
        c.fail("labels " + c.label(1) + " must have the logits' axes without vocab.",
               "labels " + TensorType{DType::i32, want}.str() + ".");
      HALYARD_CHECK(c.t(2).rank() == 0 && is_float(c.t(2).dtype), "the token count must be a float scalar");
      if (op == Op::CrossEntropyGrad) {
        HALYARD_CHECK(c.t(3).rank() == 0, "dloss must be a scalar");
        return logits;
      }
      return TensorType{logits.dtype, {}};
    }
    case Op::SeqToHeads:
    case Op::HeadsToSeq:
    case Op::GatherSeq:
    case Op::AllReduce:
    case Op::RingShift:
      c.arity(1);
      return collective_type(c, attrs);
    case Op::LseMerge: {
      if (c.in.empty()) c.fail("lse_merge needs at least one block's statistics.", "one or more [batch, seq, heads].");
      for (size_t k = 0; k < c.in.size(); ++k) {
        c.is_float_operand(k);
        c.layout(k, {"batch", "seq", "heads"}, "statistics");
        c.same_type(0, k);
      }
      return c.t(0);
    }
    case Op::AttentionMerge: {
      if (c.in.size() < kMergeBlocks + kMergeBlockOperands || (c.in.size() - kMergeBlocks) % kMergeBlockOperands != 0)
        c.fail("attention_merge takes q, positions, query_index, L and five operands per key block, got " +
                   std::to_string(c.in.size()) + " operands.",
               "(q, positions, query_index, L, k_0, v_0, key_index_0, o_0, l_0, ...).");
      for (size_t blk = kMergeBlocks; blk < c.in.size(); blk += kMergeBlockOperands) {
        const std::vector<int> one{c.in[0], c.in[blk], c.in[blk + 1], c.in[1], c.in[blk + 2], c.in[2]};
        attention_type(Checker{c.g, Op::Attention, one});
        token_indices(Checker{c.g, Op::Attention, one});
        c.same_type(0, blk + 3);
        c.same_type(kMergeLse, blk + 4);
      }
      return c.t(0);
    }
    case Op::SliceSeq:
    case Op::PadSeq:
    case Op::ConcatSeq:
      return tile_type(c, attrs);
    case Op::StoreBf16:
    case Op::LoadBf16: {
      c.arity(1);
      const DType from = op == Op::StoreBf16 ? DType::f32 : DType::bf16;
      if (c.t(0).dtype != from)
        c.fail("operand " + c.label(0) + " has dtype " + std::string(dtype_name(c.t(0).dtype)) + ".",
               std::string(dtype_name(from)) + (op == Op::StoreBf16 ? " (f32 values are stored in bf16)" : " (loads read bf16)") + ".");
      TensorType t = c.t(0);
      t.dtype = op == Op::StoreBf16 ? DType::bf16 : DType::f32;
      return t;
    }
  }
  HALYARD_CHECK(false, "unknown op");
  return {};
}

Value input(Graph& g, const std::string& name, DType dtype, std::vector<Axis> axes) {
  return g.add_leaf(Op::Input, make_type(dtype, std::move(axes), "input \"" + name + "\""), {}, name);
}

Value param(Graph& g, const std::string& name, DType dtype, std::vector<Axis> axes) {
  TensorType t = make_type(dtype, std::move(axes), "parameter \"" + name + "\"");
  if (!is_float(dtype))
    throw UserError("error: parameter \"" + name + "\" " + t.str() +
                    "\nparameters are trained by gradient and must be floating point.\nlegal: f32 or f64.");
  return g.add_leaf(Op::Param, t, {}, name);
}

Value fill(Graph& g, const TensorType& type, double value) {
  Attrs a;
  a.value = value;
  return g.add_leaf(Op::Fill, type, a, "");
}

Value embedding(Value table, Value ids) { return table.graph->add(Op::Embedding, {table, ids}); }

Value contract_to(Value a, Value b, const std::vector<std::string>& out_axes) {
  Attrs at;
  at.out_axes = out_axes;
  return a.graph->add(Op::Contract, {a, b}, at);
}

Value contract(Value a, Value b, const std::vector<std::string>& over) {
  for (const std::string& o : over)
    if (!a.type().has(o) || !b.type().has(o))
      throw UserError("error: contract(" + describe(*a.graph, a.id) + ", " + describe(*b.graph, b.id) +
                      ") over [" + join(over) + "]\ncontraction over axes that do not match: \"" + o +
                      "\" is not an axis of " +
                      describe(*a.graph, (a.type().has(o) ? b : a).id) +
                      ".\nlegal: sum over axes both operands have.");
  std::vector<std::string> out;
  auto keep = [&](const TensorType& t) {
    for (const Axis& x : t.axes)
      if (std::find(over.begin(), over.end(), x.name) == over.end() &&
          std::find(out.begin(), out.end(), x.name) == out.end())
        out.push_back(x.name);
  };
  keep(a.type());
  keep(b.type());
  return contract_to(a, b, out);
}

Value add(Value a, Value b) { return a.graph->add(Op::Add, {a, b}); }
Value mul(Value a, Value b) { return a.graph->add(Op::Mul, {a, b}); }
Value bias_add(Value x, Value b) { return x.graph->add(Op::BiasAdd, {x, b}); }

Value bias_add_grad(Value dy, const std::vector<std::string>& bias_axes) {
  Attrs a;
  a.out_axes = bias_axes;
  return dy.graph->add(Op::BiasAddGrad, {dy}, a);
}
Value silu(Value x) { return x.graph->add(Op::Silu, {x}); }

Value rms_norm(Value x, Value w, double eps) {
  Attrs a;
  a.eps = eps;
  return x.graph->add(Op::RmsNorm, {x, w}, a);
}

Value rope(Value x, Value positions, double theta, RopeScaling scaling, bool inverse) {
  Attrs a;
  a.theta = theta;
  a.rope_scaling = scaling;
  a.inverse = inverse;
  return x.graph->add(Op::Rope, {x, positions}, a);
}

Value attention(Value q, Value k, Value v, Value positions) {
  return q.graph->add(Op::Attention, {q, k, v, positions});
}

Value attention_block(Value q, Value k, Value v, Value positions, TokenIndex index, const Attrs& block) {
  return q.graph->add(Op::Attention, {q, k, v, positions, index.key, index.query}, block);
}

Value attention_block_lse(Value q, Value k, Value positions, TokenIndex index, const Attrs& block) {
  return q.graph->add(Op::AttentionLse, {q, k, positions, index.key, index.query}, block);
}

Value lse_merge(const std::vector<Value>& lse) {
  HALYARD_CHECK(!lse.empty(), "lse_merge of nothing");
  return lse[0].graph->add(Op::LseMerge, lse);
}

Value attention_merge(Value q, Value positions, Value query_index, Value lse, const std::vector<RingBlock>& blocks) {
  std::vector<Value> in{q, positions, query_index, lse};
  for (const RingBlock& b : blocks) in.insert(in.end(), {b.k, b.v, b.key_index, b.out, b.lse});
  return q.graph->add(Op::AttentionMerge, in);
}

Value ring_shift(Value x, const std::string& mesh_axis, int64_t degree, int64_t direction) {
  Attrs a;
  a.mesh_axis = mesh_axis;
  a.degree = degree;
  a.offset = direction;
  return x.graph->add(Op::RingShift, {x}, a);
}

Value cross_entropy(Value logits, Value labels, int64_t ignore_index) {
  Attrs a;
  a.ignore_index = ignore_index;
  return logits.graph->add(Op::CrossEntropy, {logits, labels, token_count(labels, ignore_index)}, a);
}

Value embedding_grad(Value dy, Value ids, int64_t vocab) {
  Attrs a;
  a.size = vocab;
  return dy.graph->add(Op::EmbeddingGrad, {dy, ids}, a);
}

Value silu_grad(Value x, Value dy) { return x.graph->add(Op::SiluGrad, {x, dy}); }

Value store_bf16(Value x) { return x.graph->add(Op::StoreBf16, {x}, {}, x.node().name); }
Value load_bf16(Value x) { return x.graph->add(Op::LoadBf16, {x}, {}, x.node().name); }

Value rms_norm_grad_x(Value x, Value w, Value dy, double eps) {
  Attrs a;
  a.eps = eps;
  return x.graph->add(Op::RmsNormGradX, {x, w, dy}, a);
}

Value rms_norm_grad_w(Value x, Value dy, const std::string& axis, double eps) {
  Attrs a;
  a.eps = eps;
  a.axis = axis;
  return x.graph->add(Op::RmsNormGradW, {x, dy}, a);
}

Value attention_lse(Value q, Value k, Value positions) {
  return q.graph->add(Op::AttentionLse, {q, k, positions});
}

Value attention_grad(Op which, Value q, Value k, Value v, Value positions, Value out, Value dout, Value lse) {
  return q.graph->add(which, {q, k, v, positions, out, dout, lse});
}

Value attention_block_grad(Op which, Value q, Value k, Value v, Value positions, Value out, Value dout, Value lse,
                           TokenIndex index, const Attrs& block) {
  return q.graph->add(which, {q, k, v, positions, out, dout, lse, index.key, index.query}, block);
}

Value token_count(Value labels, int64_t ignore_index) {
  Attrs a;
  a.ignore_index = ignore_index;
  return labels.graph->add(Op::TokenCount, {labels}, a);
}

namespace {
Value collective(Op op, Value x, const std::string& mesh_axis, int64_t degree) {
  Attrs a;
  a.mesh_axis = mesh_axis;
  a.degree = degree;
  return x.graph->add(op, {x}, a);
}
}  // namespace

Value slice_seq(Value x, int64_t offset, int64_t size) {
  Attrs a;
  a.offset = offset;
  a.size = size;
  return x.graph->add(Op::SliceSeq, {x}, a);
}

Value pad_seq(Value x, int64_t offset, int64_t size) {
  Attrs a;
  a.offset = offset;
  a.size = size;
  return x.graph->add(Op::PadSeq, {x}, a);
}

Value concat_seq(const std::vector<Value>& tiles) {
  HALYARD_CHECK(!tiles.empty(), "concat_seq of nothing");
  return tiles[0].graph->add(Op::ConcatSeq, tiles);
}

Value seq_to_heads(Value x, const std::string& m, int64_t p) { return collective(Op::SeqToHeads, x, m, p); }
Value heads_to_seq(Value x, const std::string& m, int64_t p) { return collective(Op::HeadsToSeq, x, m, p); }
Value gather_seq(Value x, const std::string& m, int64_t p) { return collective(Op::GatherSeq, x, m, p); }
Value all_reduce(Value x, const std::string& m, int64_t p) { return collective(Op::AllReduce, x, m, p); }

Value cross_entropy_grad(Value logits, Value labels, Value count, Value dloss, int64_t ignore_index) {
  Attrs a;
  a.ignore_index = ignore_index;
  return logits.graph->add(Op::CrossEntropyGrad, {logits, labels, count, dloss}, a);
}

}  // namespace halyard
