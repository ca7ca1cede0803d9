// Facts about ops: one row per op, read by every pass.
//
// What the passes used to ask through their own switch statements lives
// here: an op's name, its cost class (inlined into its consumers, always its
// own stage, or performed by the runtime between kernels), whether it is
// computed token by token (sequence tiling may split it), whether it is a
// collective, whether full checkpointing keeps its output, and its FLOPs as
// a function of its shapes. Forward ops and the backward primitives their
// VJPs build are rows alike, so the cost of a backward is the sum of its rows.
//
// Built-in ops are enumerated in graph.h and implemented by the passes
// themselves. An op defined outside that set is one register_op() call: its
// row carries its type rule, its VJP and its reference semantics (pointwise
// ops), and a lowering is registered with the generators
// (generators/lowering.h: register_pointwise_lowering). Nothing else changes.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "dsl/graph.h"

namespace halyard {

enum class OpClass {
  Leaf,     // inputs, parameters, constants: no computation
  Cheap,    // elementwise or per-row work: inlined into its consumers when it can be
  View,     // a window on another buffer (a sequence tile): never copied
  Heavy,    // reductions, contractions, attention, losses: always a stage of its own
  Runtime,  // collectives and concatenation: the runtime moves buffers between kernels
};

const char* op_class_name(OpClass c);

// How a VJP rule reads a forward value (the value itself, or its clone).
using ForwardValue = std::function<Value(int id)>;

struct OpInfo {
  std::string name;
  OpClass cls = OpClass::Cheap;
  // Output token t depends only on input token t (for every input with a seq
  // axis), so the op can be computed per tile of the sequence.
  bool token_local = false;
  // Moves data between ranks over attrs.mesh_axis (attrs.degree ranks).
  bool collective = false;
  // Full activation checkpointing keeps this output rather than recomputing
  // it: the residual stream, attention (its recompute costs O(S^2)), counts,
  // and collectives (redoing one costs a network round).
  bool checkpoint_keeps = false;
  // A schedule that stores saved values in bf16 (schedules/precision.h)
  // still saves this one in f32: softmax statistics (an error of 2^-9 in a
  // row's log-sum-exp scales every probability of the row) and counts.
  bool store_f32 = false;
  // Each output element reads each input of the output's type at its own
  // position, and nothing else of it: a stage of such ops may write its
  // output over such an input that dies there (schedules/program.h).
  bool elementwise = false;
  // Operand k (of n) that the op's kernel never reads (ring attention's
  // merge carries q, k and v for its backward): what a stage computes
  // inline only for it is never evaluated. Empty: every operand is read.
  std::function<bool(size_t k, size_t n)> unread_operand;
  // Floating-point operations to compute the node once, from its shapes
  // (counted as multiply-add = 2; exp, division and sqrt count 1). Empty: 0.
  std::function<double(const Graph&, const Node&)> flops;

  // Ops registered at run time (register_op) supply what the passes cannot
  // know about them. Built-in rows leave these empty.
  std::function<TensorType(const Graph&, const std::vector<int>& inputs, const Attrs&)> type;
  // The cotangents of the inputs selected by `needed`, written with DSL ops.
  std::function<std::vector<Value>(Graph&, const Node&, Value dout, const std::vector<bool>& needed,
                                   const ForwardValue& fwd)>
      vjp;
  // Reference semantics of an elementwise op (the interpreter): output element
  // from the inputs' elements at the same index.
  std::function<double(const std::vector<double>& inputs)> pointwise;
};

// The row of an op (built-in or registered).
const OpInfo& op_info(Op op);
// Adds a row and returns its op. Throws UserError when the name is taken or
// the row lacks what a registered op needs (type, and vjp unless it has no
// float inputs to differentiate; pointwise for the reference interpreter).
Op register_op(OpInfo info);
bool is_registered_op(Op op);  // added by register_op, not built in
// The op with this name; throws UserError listing the names.
Op op_by_name(const std::string& name);
std::vector<std::string> op_names(OpClass cls);

// Ring attention (schedules/sharding.h): whether a node is an attention op
// on a ring's key block (its operands end with the keys' and the queries'
// token indices: the rank's own block, or another rank's); the
// (query, key) pairs of one row and head that are visible on rank `rank` of
// `block.degree`, from the block's attrs (how many ranks back it came from,
// the layout); and the FLOPs the node's kernel does on that rank: the
// products a tile computes whole (scores, dP) over every pair of the block,
// the rest over the visible pairs. op_flops counts a block on its busiest rank.
bool is_ring_block(const Node& n);
double ring_block_pairs(int64_t local_seq, const Attrs& block, int64_t rank);
double ring_block_flops(const Graph& g, const Node& n, int64_t rank);
// The FLOPs of a ring block's node on `rank` for kernels that skip the key
// blocks no query of a query block sees (the library's): every product over
// the visible pairs only. `beside`: n is another node's extra output
// (extra_output_flops: the log-sum-exp nothing, dQ beside dK one product).
double ring_block_visible_flops(const Graph& g, const Node& n, int64_t rank, bool beside);

// FLOPs of a node (0 for leaves, views and collectives).
double op_flops(const Graph& g, const Node& n);
// FLOPs a node adds as a second output of another node's kernel
// (Stage::extra_outputs): dV beside dK adds P^T.dO (its row counts only
// that); the log-sum-exp beside its attention adds nothing, the attention's
// softmax computes it.
double extra_output_flops(const Graph& g, const Node& n);
// Bytes of a node's output, and of all its operands and its output together:
// what an op moves when every operand and the result live in memory.
int64_t value_bytes(const TensorType& t);
int64_t op_bytes(const Graph& g, const Node& n);

}  // namespace halyard
