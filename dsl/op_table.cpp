// The op table (see op_table.h): one row per op.
#include "dsl/op_table.h"

#include <algorithm>
#include <deque>
#include <mutex>

#include "dsl/error.h"
#include "dsl/ops.h"

namespace halyard {
namespace {

constexpr int kBuiltinOps = static_cast<int>(Op::LoadBf16) + 1;

double numel(const TensorType& t) { return static_cast<double>(t.numel()); }
const TensorType& in_type(const Graph& g, const Node& n, size_t k) { return g.node(n.inputs[k]).type; }

// k flops per output element.
std::function<double(const Graph&, const Node&)> per_element(double k) {
  return [k](const Graph&, const Node& n) { return k * numel(n.type); };
}
// k flops per element of operand `i`.
std::function<double(const Graph&, const Node&)> per_input_element(double k, size_t i) {
  return [k, i](const Graph& g, const Node& n) { return k * numel(in_type(g, n, i)); };
}

// 2 flops per multiply-add: every output element sums the axes of a that
// the output drops (the contracted ones).
double contract_flops(const Graph& g, const Node& n) {
  double reduced = 1;
  for (const Axis& a : in_type(g, n, 0).axes)
    if (!n.type.has(a.name)) reduced *= static_cast<double>(a.size);
  return 2 * numel(n.type) * reduced;
}

// The work per (query, key) pair of each attention op, in multiply-adds per
// head_dim element (2 flops each) plus flops per pair (exp, softmax), and how
// many of its products a kernel computes for every pair of a tile whether
// the key is visible or not (scores, and dP in the gradients): the rest
// skip invisible keys.
struct AttentionWork {
  double mads, extra, whole_tile_mads;
};
AttentionWork attention_work(Op op) {
  switch (op) {
    case Op::Attention: return {2, 5, 1};       // scores and P.V; the softmax
    case Op::AttentionLse: return {1, 3, 1};    // scores; max and sum of exp
    // The backward recomputes the probabilities from q, k and lse: dQ needs
    // scores, dP = dO.V^T and dS.K; dK the same three; dV (written by dK's
    // kernel, which shares the probabilities) only P^T.dO.
    case Op::AttentionGradQ:
    case Op::AttentionGradK: return {3, 4, 2};
    case Op::AttentionGradV: return {1, 0, 0};
    default: return {0, 0, 0};
  }
}

// Causal attention visits each query's keys up to itself: S(S+1)/2 pairs of
// each row and query head (packed documents see fewer; the plan does not
// know the data, so it counts one document per row). A ring block costs
// what its busiest rank computes.
double causal_flops(const Graph& g, const Node& n) {
  const TensorType& q = in_type(g, n, 0);
  const double s = static_cast<double>(q.size("seq")), d = static_cast<double>(q.size("head_dim"));
  const double pairs = static_cast<double>(q.size("batch")) * static_cast<double>(q.size("heads")) * s * (s + 1) / 2;
  const AttentionWork w = attention_work(n.op);
  return pairs * (2 * w.mads * d + w.extra);
}

double attention_flops(const Graph& g, const Node& n) {
  if (!is_ring_block(n) || n.attrs.offset == 0) return causal_flops(g, n);
  double most = 0;
  for (int64_t r = 0; r < std::max<int64_t>(n.attrs.degree, 1); ++r) most = std::max(most, ring_block_flops(g, n, r));
  return most;
}

// The positions of rank r's tokens, as chunks [begin, end) of the global
// sequence: one chunk of s (contiguous), or chunks r and 2P-1-r of s/2 (zigzag).
std::vector<std::pair<int64_t, int64_t>> rank_chunks(int64_t s, int64_t ranks, int64_t r, bool zigzag) {
  if (!zigzag) return {{r * s, (r + 1) * s}};
  const int64_t c = s / 2;
  return {{r * c, (r + 1) * c}, {(2 * ranks - 1 - r) * c, (2 * ranks - r) * c}};
}

OpInfo row(const char* name, OpClass cls) {
  OpInfo r;
  r.name = name;
  r.cls = cls;
  return r;
}

std::deque<OpInfo> make_builtin_rows() {
  std::deque<OpInfo> t(static_cast<size_t>(kBuiltinOps));
  auto set = [&](Op op, OpInfo r) { t[static_cast<size_t>(op)] = std::move(r); };
  auto with = [](OpInfo r, auto&& edit) {
    edit(r);
    return r;
  };
  using C = OpClass;
  set(Op::Input, row("input", C::Leaf));
  set(Op::Param, row("param", C::Leaf));
  set(Op::Fill, row("fill", C::Leaf));
  set(Op::Embedding, with(row("embedding", C::Heavy), [](OpInfo& r) { r.token_local = r.checkpoint_keeps = true; }));
  set(Op::EmbeddingGrad, with(row("embedding_grad", C::Heavy), [](OpInfo& r) { r.flops = per_input_element(1, 0); }));
  set(Op::Contract, with(row("contract", C::Heavy), [](OpInfo& r) {
        r.token_local = true;  // unless it sums over seq: see is_token_local()
        r.flops = contract_flops;
      }));
  set(Op::Add, with(row("add", C::Cheap), [](OpInfo& r) {
        r.token_local = r.checkpoint_keeps = true;  // adds are the residual stream
        r.elementwise = true;
        r.flops = per_element(1);
      }));
  set(Op::Mul, with(row("mul", C::Cheap), [](OpInfo& r) { r.token_local = r.elementwise = true, r.flops = per_element(1); }));
  // A bias is a parameter without the token axes: its add is pointwise per
  // token; its gradient sums over the tokens, so (like a weight gradient)
  // it is not token-local: each sequence tile and each sp rank holds a
  // partial sum, added by autodiff's accumulation and the step's gradient
  // all-reduce.
  set(Op::BiasAdd, with(row("bias_add", C::Cheap), [](OpInfo& r) { r.token_local = r.elementwise = true, r.flops = per_element(1); }));
  set(Op::BiasAddGrad, with(row("bias_add_grad", C::Heavy), [](OpInfo& r) { r.flops = per_input_element(1, 0); }));
  set(Op::Silu, with(row("silu", C::Cheap), [](OpInfo& r) { r.token_local = r.elementwise = true, r.flops = per_element(4); }));
  set(Op::SiluGrad, with(row("silu_grad", C::Cheap), [](OpInfo& r) { r.token_local = r.elementwise = true, r.flops = per_element(8); }));
  set(Op::RmsNorm, with(row("rms_norm", C::Cheap), [](OpInfo& r) { r.token_local = true, r.flops = per_element(4); }));
  set(Op::RmsNormGradX, with(row("rms_norm_grad_x", C::Heavy), [](OpInfo& r) { r.token_local = true, r.flops = per_element(7); }));
  set(Op::RmsNormGradW, with(row("rms_norm_grad_w", C::Heavy), [](OpInfo& r) { r.flops = per_input_element(4, 0); }));
  set(Op::Rope, with(row("rope", C::Cheap), [](OpInfo& r) { r.token_local = true, r.flops = per_element(3); }));
  set(Op::Attention, with(row("attention", C::Heavy), [](OpInfo& r) {
        r.checkpoint_keeps = true;
        r.flops = attention_flops;
      }));
  // Their work per pair: attention_work() above.
  set(Op::AttentionLse, with(row("attention_lse", C::Heavy), [](OpInfo& r) {
        r.store_f32 = true;
        r.flops = attention_flops;
      }));
  set(Op::AttentionGradQ, with(row("attention_grad_q", C::Heavy), [](OpInfo& r) { r.flops = attention_flops; }));
  set(Op::AttentionGradK, with(row("attention_grad_k", C::Heavy), [](OpInfo& r) { r.flops = attention_flops; }));
  set(Op::AttentionGradV, with(row("attention_grad_v", C::Heavy), [](OpInfo& r) { r.flops = attention_flops; }));
  set(Op::TokenCount, with(row("token_count", C::Heavy), [](OpInfo& r) {
        r.checkpoint_keeps = r.store_f32 = true;
        r.flops = per_input_element(1, 0);
      }));
  set(Op::CrossEntropy, with(row("cross_entropy", C::Heavy), [](OpInfo& r) {
        r.token_local = true;
        r.flops = per_input_element(4, 0);
      }));
  set(Op::CrossEntropyGrad, with(row("cross_entropy_grad", C::Heavy), [](OpInfo& r) {
        r.token_local = true;
        r.flops = per_element(5);
      }));
  set(Op::SliceSeq, row("slice_seq", C::View));
  set(Op::PadSeq, row("pad_seq", C::Cheap));
  set(Op::ConcatSeq, with(row("concat_seq", C::Runtime), [](OpInfo& r) { r.checkpoint_keeps = true; }));
  for (auto [op, name] : {std::pair{Op::SeqToHeads, "seq_to_heads"}, std::pair{Op::HeadsToSeq, "heads_to_seq"},
                          std::pair{Op::GatherSeq, "gather_seq"}, std::pair{Op::AllReduce, "all_reduce"},
                          std::pair{Op::RingShift, "ring_shift"}})
    set(op, with(row(name, C::Runtime), [](OpInfo& r) { r.collective = r.checkpoint_keeps = true; }));
  // Ring attention's merge: per row, a max and a sum of exps over the
  // blocks; then each block's output scaled and added. Their own stages
  // (heavy), so that the attention backward reads L from memory, and kept
  // by checkpointing like the attention output they are. Elementwise: each
  // reads the blocks' values at its own position (the merge's statistics
  // per row, and q, k and v not at all: they are its backward's), so the
  // merged output takes over a block's bytes where it dies.
  set(Op::LseMerge, with(row("lse_merge", C::Heavy), [](OpInfo& r) {
        r.checkpoint_keeps = r.store_f32 = r.elementwise = true;
        r.flops = [](const Graph&, const Node& n) { return 4 * numel(n.type) * static_cast<double>(n.inputs.size()); };
      }));
  set(Op::AttentionMerge, with(row("attention_merge", C::Heavy), [](OpInfo& r) {
        r.checkpoint_keeps = r.elementwise = true;
        r.unread_operand = [](size_t k, size_t) {  // q, positions; each block's k, v and key positions
          return k < kMergeLse || (k >= kMergeBlocks && (k - kMergeBlocks) % kMergeBlockOperands < 3);
        };
        r.flops = [](const Graph&, const Node& n) {
          return 3 * numel(n.type) * static_cast<double>((n.inputs.size() - kMergeBlocks) / kMergeBlockOperands);
        };
      }));
  // A stored copy is always a stage of its own (heavy): the buffer is its
  // point, and inlined into its reader it would make the reader recompute
  // from the f32 value it replaces. Its load is inlined into each reader.
  set(Op::StoreBf16, with(row("store_bf16", C::Heavy), [](OpInfo& r) { r.token_local = true; }));
  set(Op::LoadBf16, with(row("load_bf16", C::Cheap), [](OpInfo& r) { r.token_local = r.elementwise = true; }));
  return t;
}

// Rows never move once added (a deque), so references handed out stay valid.
struct Table {
  std::mutex mu;
  std::deque<OpInfo> rows = make_builtin_rows();
};

Table& table() {
  static Table t;
  return t;
}

}  // namespace

const char* op_class_name(OpClass c) {
  switch (c) {
    case OpClass::Leaf: return "leaf";
    case OpClass::Cheap: return "cheap";
    case OpClass::View: return "view";
    case OpClass::Heavy: return "heavy";
    case OpClass::Runtime: return "runtime";
  }
  return "?";
}

const OpInfo& op_info(Op op) {
  Table& t = table();
  const auto i = static_cast<size_t>(op);
  std::lock_guard<std::mutex> lock(t.mu);
  HALYARD_CHECK(i < t.rows.size(), "op " << i << " is not in the op table");
  return t.rows[i];
}

bool is_registered_op(Op op) { return static_cast<int>(op) >= kBuiltinOps; }

Op register_op(OpInfo info) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  for (const OpInfo& r : t.rows)
    if (r.name == info.name)
      throw UserError("error: register_op(\"" + info.name + "\")\nan op of that name exists already.\n"
                      "legal: a name no other op has.");
  if (!info.type)
    throw UserError("error: register_op(\"" + info.name + "\") has no type rule.\n"
                    "legal: set OpInfo::type to compute the result type from the operands.");
  if (info.cls != OpClass::Cheap && info.cls != OpClass::Heavy)
    throw UserError(std::string("error: register_op(\"") + info.name + "\") of class " + op_class_name(info.cls) +
                    ".\nlegal: cheap or heavy (leaves, views and runtime ops are the runtime's own).");
  if (info.collective)
    throw UserError("error: register_op(\"" + info.name + "\") is marked collective.\n"
                    "legal: collectives are built in (the runtime performs them).");
  t.rows.push_back(std::move(info));
  return static_cast<Op>(t.rows.size() - 1);
}

Op op_by_name(const std::string& name) {
  Table& t = table();
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    for (size_t i = 0; i < t.rows.size(); ++i) {
      if (t.rows[i].name == name) return static_cast<Op>(i);
      names.push_back(t.rows[i].name);
    }
  }
  throw UserError("error: no op is named \"" + name + "\".\nlegal: " + join(names) + ".");
}

std::vector<std::string> op_names(OpClass cls) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  std::vector<std::string> out;
  for (const OpInfo& r : t.rows)
    if (r.cls == cls) out.push_back(r.name);
  return out;
}

bool is_ring_block(const Node& n) {
  switch (n.op) {
    case Op::Attention: return n.inputs.size() == 6;
    case Op::AttentionLse: return n.inputs.size() == 5;
    case Op::AttentionGradQ:
    case Op::AttentionGradK:
    case Op::AttentionGradV: return n.inputs.size() == 9;
    default: return false;
  }
}

double ring_block_pairs(int64_t s, const Attrs& block, int64_t rank) {
  const int64_t P = block.degree, from = ((rank - block.offset) % P + P) % P;
  const bool zigzag = block.layout == "zigzag";
  // Chunks are aligned: two are the same chunk (causal within it) or
  // disjoint (every pair visible, or none).
  double pairs = 0;
  for (auto [q0, q1] : rank_chunks(s, P, rank, zigzag))
    for (auto [k0, k1] : rank_chunks(s, P, from, zigzag)) {
      const double n = static_cast<double>(q1 - q0);
      if (q0 == k0) pairs += n * (n + 1) / 2;
      else if (k1 <= q0) pairs += n * static_cast<double>(k1 - k0);
    }
  return pairs;
}

double ring_block_flops(const Graph& g, const Node& n, int64_t rank) {
  // The own block's kernel is the one-rank kernel (causal by seq index, in
  // row order in either layout).
  if (n.attrs.offset == 0) return causal_flops(g, n);
  const TensorType& q = in_type(g, n, 0);
  const double s = static_cast<double>(q.size("seq")), d = static_cast<double>(q.size("head_dim"));
  const double rows = static_cast<double>(q.size("batch")) * static_cast<double>(q.size("heads"));
  const AttentionWork w = attention_work(n.op);
  const double visible = ring_block_pairs(q.size("seq"), n.attrs, rank);
  return rows * (s * s * 2 * w.whole_tile_mads * d + visible * (2 * (w.mads - w.whole_tile_mads) * d + w.extra));
}

double ring_block_visible_flops(const Graph& g, const Node& n, int64_t rank, bool beside) {
  const TensorType& q = in_type(g, n, 0);
  const double d = static_cast<double>(q.size("head_dim"));
  const double rows = static_cast<double>(q.size("batch")) * static_cast<double>(q.size("heads"));
  const AttentionWork w = attention_work(n.op);
  const double per_pair = !beside                        ? 2 * w.mads * d + w.extra
                          : n.op == Op::AttentionLse   ? 0
                          : n.op == Op::AttentionGradQ ? 2 * d
                                                       : 2 * w.mads * d + w.extra;
  return rows * ring_block_pairs(q.size("seq"), n.attrs, rank) * per_pair;
}

double op_flops(const Graph& g, const Node& n) {
  const OpInfo& r = op_info(n.op);
  return r.flops ? r.flops(g, n) : 0.0;
}

double extra_output_flops(const Graph& g, const Node& n) {
  if (n.op == Op::AttentionLse) return 0;  // the forward's row statistics
  if (n.op == Op::AttentionGradQ) {        // beside dK (the library's single pass): one product more, dS.K
    const TensorType& q = in_type(g, n, 0);
    const double s = static_cast<double>(q.size("seq"));
    return static_cast<double>(q.size("batch") * q.size("heads")) * s * (s + 1) / 2 * 2 * static_cast<double>(q.size("head_dim"));
  }
  return op_flops(g, n);
}

int64_t value_bytes(const TensorType& t) {
  const int64_t e = t.dtype == DType::f64 ? 8 : t.dtype == DType::bf16 ? 2 : 4;
  return t.numel() * e;
}

int64_t op_bytes(const Graph& g, const Node& n) {
  int64_t b = value_bytes(n.type);
  for (int i : n.inputs) b += value_bytes(g.node(i).type);
  return b;
}

}  // namespace halyard
