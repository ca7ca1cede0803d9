// The graph IR: one flat list of nodes, each an op applied to earlier nodes.
//
// A node is a small data record (op, inputs, type, attributes, name). Nodes are
// appended in topological order, so a node's inputs always have smaller ids,
// and the joint forward+backward graph that autodiff builds is the same list
// extended: backward nodes carry `backward = true`, and the forward values
// they read (`forward_reads`) are exactly what a schedule must either save or
// recompute. Ops are built through dsl/ops.h, which checks types.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dsl/types.h"

namespace halyard {

enum class Op {
  Input,             // a named, per-step input (tokens, labels, positions)
  Param,             // a named, trainable parameter
  Fill,              // a constant tensor (attrs.value everywhere)
  Embedding,         // (table[vocab, X], ids) -> ids.axes + [X]
  EmbeddingGrad,     // (dy, ids) -> [vocab, X]: scatter-add of dy rows
  Contract,          // (a, b) -> attrs.out_axes: sum over shared axes not kept
  Add,               // (a, b), same type
  Mul,               // (a, b), same type
  BiasAdd,           // (x, b): b's axes a subset of x's; b repeats over x's other axes
  BiasAddGrad,       // (dy) -> attrs.out_axes: dy summed over its other axes
  Silu,              // (x)
  SiluGrad,          // (x, dy)
  RmsNorm,           // (x, w[A]) over axis A
  RmsNormGradX,      // (x, w, dy)
  RmsNormGradW,      // (x, dy) -> [A]
  Rope,              // (x, positions): rotate-half RoPE over head_dim
  // The attention ops take the keys' positions as an extra last operand when
  // the keys are another rank's block (ring attention); otherwise the keys
  // are the queries' own tokens and share their positions.
  Attention,         // (q, k, v, positions[, key positions]): causal grouped-query attention
  AttentionLse,      // (q, k, positions[, key positions]) -> [batch, seq, heads]: log-sum-exp of each score row
  AttentionGradQ,    // (q, k, v, positions, out, dout, lse[, key positions])
  AttentionGradK,    // (q, k, v, positions, out, dout, lse[, key positions])
  AttentionGradV,    // (q, k, v, positions, out, dout, lse[, key positions])
  TokenCount,        // (labels) -> scalar: how many labels are not ignore_index
  CrossEntropy,      // (logits, labels, count) -> sum over real tokens of -log p(label) / count
  CrossEntropyGrad,  // (logits, labels, count, dloss)
  // Sequence tiles (inserted by schedules/tiling.h for sequence tiling).
  SliceSeq,          // (x) -> x with seq [attrs.offset, attrs.offset + attrs.size)
  PadSeq,            // (x) -> seq of length attrs.size, x at attrs.offset, zeros elsewhere
  ConcatSeq,         // (x0, x1, ...) -> the tiles back to back along seq
  // Collectives over a mesh axis (attrs.mesh_axis, degree attrs.degree). The
  // sharding pass (schedules/sharding.h) inserts them; they speak of mesh
  // axes, never of ranks, and the runtime performs them between kernels.
  SeqToHeads,        // (x[batch, seq@A, H, head_dim]) -> [batch, seq, H@A, head_dim]: Ulysses all-to-all
  HeadsToSeq,        // (x[batch, seq, H@A, head_dim]) -> [batch, seq@A, H, head_dim]; sums replicated heads
  GatherSeq,         // (x[batch, seq@A]) -> [batch, seq]: all-gather along seq
  AllReduce,         // (x) -> x summed over the mesh axis, the same on every rank
  RingShift,         // (x[batch, seq@A, ...]) -> same type: each rank receives the tensor of the rank before it
                     // along A (attrs.offset = 1; -1 the other way round)
  // Ring attention (schedules/sharding.h): each rank's queries against every
  // rank's key block, merged with the online-softmax rule.
  LseMerge,          // (l_0, ..., l_{n-1}) [batch, seq, heads] -> log sum_j exp(l_j)
  AttentionMerge,    // (q, positions, L, then per block k_j, v_j, key positions_j, o_j, l_j) -> sum_j exp(l_j - L) o_j
  // Storage precision (schedules/precision.h inserts them after autodiff):
  // a saved value kept in bf16 between the forward and the backward.
  StoreBf16,         // (x f32) -> bf16: x rounded to nearest even, stored in 16 bits
  LoadBf16,          // (x bf16) -> f32: exact
};

bool is_collective(Op op);
// Ops the runtime performs between kernels on whole buffers (collectives, concatenation).
bool is_runtime_op(Op op);

const char* op_name(Op op);

// Llama-3.1 style frequency scaling of RoPE ("rope_type": "llama3"); factor 0 = off.
struct RopeScaling {
  double factor = 0;
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  double original_max_position_embeddings = 8192;
  bool operator==(const RopeScaling&) const = default;
};

// Every op's attributes in one record; each op reads only its own fields.
struct Attrs {
  double value = 0;                   // Fill
  double eps = 0;                     // RmsNorm*
  double theta = 0;                   // Rope
  RopeScaling rope_scaling;           // Rope
  bool inverse = false;               // Rope: rotate by -angle (its transpose)
  int64_t ignore_index = -100;        // CrossEntropy*
  std::vector<std::string> out_axes;  // Contract, BiasAddGrad: output layout
  std::string axis;                   // RmsNormGradW: the normalized axis
  int64_t size = 0;                   // EmbeddingGrad: vocab size; SliceSeq: tile length; PadSeq: full length
  int64_t offset = 0;                 // SliceSeq, PadSeq: where the tile starts along seq
  std::string mesh_axis;              // collectives: the mesh axis they run over ("sp")
  int64_t degree = 0;                 // collectives: ranks along that mesh axis
  // Attention on a ring block (with key positions): degree = ranks of the
  // ring, offset = how many ranks back the block came from (0: its own),
  // layout = how the sequence is placed on them ("contiguous" or "zigzag").
  std::string layout;
  // Attention and its gradients: the products in bf16 (mixed precision,
  // schedules/precision.h's round_contractions): q, k, v and dO rounded to
  // bf16 (nearest, ties to even) before the products that read them, the
  // probabilities before P V and P^T dO, dS before dS K and dS^T Q; every
  // sum, the softmax's and D_i = dO_i . O_i included, in f32 (what
  // tensor-core attention kernels compute).
  bool bf16 = false;
  // Made by sequence tiling (schedules/tiling.h): one tile of a tiled op.
  // The schedule term "seq_tiles" matches the wide ones; a wide value that
  // stays whole (the MLP's when only the loss is tiled) is not a tile.
  bool seq_tile = false;
  bool operator==(const Attrs&) const = default;
};

struct Node {
  int id = -1;
  Op op = Op::Input;
  std::vector<int> inputs;
  TensorType type;
  std::string name;  // params and inputs: their unique name; others: optional label
  Attrs attrs;
  bool backward = false;
};

class Graph;

// A handle on a node's output. Cheap to copy; valid while its graph lives.
struct Value {
  Graph* graph = nullptr;
  int id = -1;

  const Node& node() const;
  const TensorType& type() const;
  bool valid() const { return graph != nullptr && id >= 0; }
};

class Graph {
 public:
  Graph() = default;
  Graph(const Graph&) = delete;  // Values point at their graph
  Graph& operator=(const Graph&) = delete;

  // Appends a node after checking its inputs' types (throws UserError).
  Value add(Op op, const std::vector<Value>& inputs, Attrs attrs = {}, std::string name = "");
  // Appends a node whose type the caller gives (Input, Param, Fill).
  Value add_leaf(Op op, TensorType type, Attrs attrs, std::string name);

  const Node& node(int id) const { return nodes_.at(static_cast<size_t>(id)); }
  const std::vector<Node>& nodes() const { return nodes_; }
  int size() const { return static_cast<int>(nodes_.size()); }
  Value value(int id) { return Value{this, id}; }

  // The Param (or Input) node with this name; throws UserError listing names.
  Value find(const std::string& name);
  std::vector<Value> params();
  std::vector<Value> inputs();

  // Nodes added while true are marked backward (autodiff sets it).
  void set_building_backward(bool on) { building_backward_ = on; }
  // Labels attached to nodes built until the scope is reset (e.g. the layer).
  void set_name_prefix(std::string prefix) { prefix_ = std::move(prefix); }

 private:
  std::vector<Node> nodes_;
  bool building_backward_ = false;
  std::string prefix_;
};

// Forward values a backward node reads: the residuals a schedule saves or recomputes.
std::vector<int> forward_reads(const Graph& g, int node_id);
// All forward values read by any backward node, in id order.
std::vector<int> residuals(const Graph& g);

// Re-derives every node's type from its inputs and checks the graph's
// invariants (topological order, unique names, leaves well formed). Throws
// UserError on the first violation, naming the node.
void verify(const Graph& g);

// One line per node: `%7 = contract(%3, %5) -> f32[...]  # label`.
std::string print(const Graph& g);
std::string describe(const Graph& g, int id);  // `%3 "name" f32[...]`

}  // namespace halyard
