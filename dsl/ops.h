// The op set: builders that append checked nodes to a graph.
//
// These are the words a model is written in. Each builder checks its operands
// (dtypes, axis names and sizes) and throws UserError naming the operands, the
// rule and what is legal; a graph built only through them always verifies.
// Semantics follow Hugging Face's LlamaForCausalLM.
#pragma once

#include <string>
#include <vector>

#include "dsl/graph.h"

namespace halyard {

Value input(Graph& g, const std::string& name, DType dtype, std::vector<Axis> axes);
Value param(Graph& g, const std::string& name, DType dtype, std::vector<Axis> axes);
Value fill(Graph& g, const TensorType& type, double value);

// table[vocab, X] gathered at integer ids: ids.axes + [X].
Value embedding(Value table, Value ids);
// Sums over the `over` axes, which both operands must have; the result keeps
// a's other axes, then b's (a linear layer: contract(x, weight, {"model"})).
Value contract(Value a, Value b, const std::vector<std::string>& over);
// Same, with the result's axes and their order given; every axis dropped must
// appear in both operands.
Value contract_to(Value a, Value b, const std::vector<std::string>& out_axes);
Value add(Value a, Value b);
Value mul(Value a, Value b);
// x + b where b's axes are some of x's (same sizes, any order): b repeats
// over x's other axes, as a projection's bias does over the tokens
// (bias_add(q f32[batch, seq, heads, head_dim], q_bias f32[heads, head_dim])).
Value bias_add(Value x, Value b);
inline Value operator+(Value a, Value b) { return add(a, b); }
inline Value operator*(Value a, Value b) { return mul(a, b); }
Value silu(Value x);
// x * rsqrt(mean(x^2 over w's axis) + eps) * w.
Value rms_norm(Value x, Value w, double eps);
// Rotate-half RoPE over head_dim at the given (global) positions.
Value rope(Value x, Value positions, double theta, RopeScaling scaling = {}, bool inverse = false);
// Causal grouped-query attention: q[batch, seq, heads, head_dim],
// k, v[batch, seq, kv_heads, head_dim], positions i32[batch, seq]; key j is
// visible to query i when i - positions[i] <= j <= i; scale 1/sqrt(head_dim).
// With positions counting from the row's start (positions[i] >= i) that is
// plain causal attention; with positions that restart at 0 where each
// document of a packed row begins, it is causal within each document only
// (Hugging Face's packed position_ids, FlashAttention-2's varlen path).
Value attention(Value q, Value k, Value v, Value positions);
// Mean over tokens whose label != ignore_index of -log softmax(logits)[label];
// labels arrive already shifted. No real tokens gives 0. Built as a sum over
// tokens divided by token_count(labels), so that a schedule can make the
// count global (over sequence shards or tiles) without touching the model.
Value cross_entropy(Value logits, Value labels, int64_t ignore_index = -100);
Value token_count(Value labels, int64_t ignore_index = -100);

// Backward primitives (built by the VJP rules in dsl/vjp.cpp).
Value embedding_grad(Value dy, Value ids, int64_t vocab);
Value silu_grad(Value x, Value dy);
Value rms_norm_grad_x(Value x, Value w, Value dy, double eps);
Value rms_norm_grad_w(Value x, Value dy, const std::string& axis, double eps);
// dy summed over every axis but `bias_axes` (the result's axes, in that order).
Value bias_add_grad(Value dy, const std::vector<std::string>& bias_axes);
// The softmax statistics the backward reuses: lse[b, i, h] = log sum_j exp(score).
Value attention_lse(Value q, Value k, Value positions);
Value attention_grad(Op which, Value q, Value k, Value v, Value positions, Value out, Value dout, Value lse);
Value cross_entropy_grad(Value logits, Value labels, Value count, Value dloss, int64_t ignore_index);

// Sequence tiles: seq [offset, offset + size) of x; x placed at `offset` in a
// zero tensor of seq length `size`; tiles back to back along seq.
Value slice_seq(Value x, int64_t offset, int64_t size);
Value pad_seq(Value x, int64_t offset, int64_t size);
Value concat_seq(const std::vector<Value>& tiles);

// Storage precision: x (f32) rounded to bf16 (nearest, ties to even, as
// torch.bfloat16) and stored in 16 bits; a bf16 value read back as f32.
// Nothing computes in bf16: loads come before any other op.
Value store_bf16(Value x);
Value load_bf16(Value x);

// The mesh axes a sequence is split over: sp (every rank of a sequence),
// and, for hybrid sequence parallelism, its two factors sp = sp_r x sp_u:
// Ulysses groups of consecutive ranks (sp_u) and the ring across them (sp_r).
inline constexpr const char* kSeqAxis = "sp";
inline constexpr const char* kUlyssesAxis = "sp_u";
inline constexpr const char* kRingAxis = "sp_r";

// Collectives over mesh axis `mesh_axis` of `degree` ranks (see graph.h).
// Heads H split over P ranks: H/P each when P divides H; when H divides P
// (kv_heads fewer than ranks) each rank gets one head, replicated over P/H ranks.
Value seq_to_heads(Value x, const std::string& mesh_axis, int64_t degree);
Value heads_to_seq(Value x, const std::string& mesh_axis, int64_t degree);
Value gather_seq(Value x, const std::string& mesh_axis, int64_t degree);
Value all_reduce(Value x, const std::string& mesh_axis, int64_t degree);
// Each rank receives the tensor of the rank `direction` places before it
// along the mesh axis (1: rank r gets rank r-1's, the last rank's goes to
// rank 0); its transpose is the shift the other way.
Value ring_shift(Value x, const std::string& mesh_axis, int64_t degree, int64_t direction = 1);

// Ring attention's pieces (schedules/sharding.cpp builds them). A rank's
// queries and a key block (its own, or another rank's) are not one run of
// the row, so each token carries its index in the whole row (i32[batch,
// seq]): key j is visible to query i when
//   query_index[i] - positions[i] <= key_index[j] <= query_index[i],
// attention()'s rule in the row's own numbering. `block` carries the ring's
// degree, how many ranks back the block came from (offset, 0 for the own
// block) and the sequence layout, for the op table's FLOPs.
struct TokenIndex {
  Value query, key;
};
// The log-sum-exp of a row that sees no key of a block (its output is 0):
// finite, so that merging blocks never computes inf - inf.
inline constexpr double kNoKeysLse = -1e30;
Value attention_block(Value q, Value k, Value v, Value positions, TokenIndex index, const Attrs& block);
Value attention_block_lse(Value q, Value k, Value positions, TokenIndex index, const Attrs& block);
Value attention_block_grad(Op which, Value q, Value k, Value v, Value positions, Value out, Value dout, Value lse,
                           TokenIndex index, const Attrs& block);
// L = log sum_j exp(l_j) of the blocks' row statistics.
Value lse_merge(const std::vector<Value>& lse);
// One key block of a merge: its operands and its partial result (o, l).
struct RingBlock {
  Value k, v, key_index, out, lse;
};
// out = sum_j exp(l_j - L) o_j. Its VJP goes straight to q and each block's
// k and v (flash-style, with the merged out and L), not through o_j, l_j.
// Its operands: q, positions, query_index, L (kMergeLse), then from
// kMergeBlocks on, each block's k, v, key_index, o, l.
inline constexpr size_t kMergeLse = 3, kMergeBlocks = 4, kMergeBlockOperands = 5;
Value attention_merge(Value q, Value positions, Value query_index, Value lse, const std::vector<RingBlock>& blocks);
// Heads per rank for H heads over P ranks, or 0 when neither divides the other.
int64_t heads_per_rank(int64_t heads, int64_t degree);

// The type rule of every op: the result type of `op` on these inputs, or a
// UserError. Graph::add and verify() both use it.
TensorType infer_type(const Graph& g, Op op, const std::vector<int>& inputs, const Attrs& attrs);

}  // namespace halyard
