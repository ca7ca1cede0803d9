// The CPU library kernels of causal grouped-query attention, which a
// schedule may choose instead of Halide-generated attention kernels
// (Schedule::attention_kernel = "library"; generators/lower.cpp calls them
// as Halide extern stages). FlashAttention-2's algorithm, O(S) memory: the
// forward writes the output and each row's log-sum-exp; one backward pass
// writes dQ, dK and dV (attention_cpu_impl.h).
//
// Halide calls each entry point once per stage, with the stage's own output
// buffers (nothing is copied after the call); the tasks run in parallel on
// Halide's thread pool: the forward one per (batch, query head), the
// backward one per (batch, kv head). In a bounds query they ask for their
// inputs whole. Buffers are Halide's, innermost first:
//   q, o, dO  [head_dim, heads, seq, batch]   k, v  [head_dim, kv_heads, seq, batch]
//   pos       [seq, batch] (int32)            lse   [heads, seq, batch]
//   forward:  out is the output o; _lse also writes the log-sum-exp into lse
//   lse:      out is the log-sum-exp alone (a backward that recomputes it:
//             the forward's bits, without P V)
//   backward: out is dK, and the call writes dV and dQ [head_dim, heads,
//             seq, batch] beside it, the stage's other two outputs
// bf16 (0 or 1; the attention node's Attrs::bf16, dsl/graph.h):
// the products read bf16 roundings (nearest, ties to even) of q, k, v and
// dO, of the probabilities before P V and P^T dO, and of dS before dS K and
// dS^T Q, and sum in f32: what the CUDA kernels compute on tensor cores
// (attention_cuda.cu), so that both libraries run one algorithm. The
// softmax's sums, D_i = dO_i . O_i (with the rounded dO) and dS = P (dP -
// D_i) itself are f32.
// The _ring entry points take a ring attention key block (dsl/ops.h:
// attention_block): two more [seq, batch] int32 buffers after pos, each
// key's and each query's index in the whole row, and key j is visible to
// query i when qidx[i] - pos[i] <= kidx[j] <= qidx[i]. A row that sees no
// key of the block gets output 0 and log-sum-exp -1e30 (finite, so that
// merging blocks never computes inf - inf). Their backward takes the merged
// output and log-sum-exp, and writes the block's dK, dV and its share of dQ.
// q, k, v, O (and dO) are each f32, or bf16 held as its 16 bits (uint16: a
// value the schedule stores in bf16, schedules/precision.h, read in place
// rather than decoded into an f32 copy first); the kernels decode them
// exactly, so either gives the same bits. (Their CUDA twins take dO, a
// gradient that is never stored, in f32 alone.)
// An output that another call writes is Halide's extern stage
// halyard_written_beside, which does nothing.
#pragma once

#include <cstdint>

#include "runtime/bf16.h"

struct halide_buffer_t;

extern "C" {
int halyard_attention_forward(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                              int heads, int kv_heads, int head_dim, int query_block, int key_block, int bf16,
                              halide_buffer_t* out);
int halyard_attention_forward_lse(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                                  halide_buffer_t* lse, int heads, int kv_heads, int head_dim, int query_block,
                                  int key_block, int bf16, halide_buffer_t* out);
int halyard_attention_lse(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* pos, int heads, int kv_heads,
                          int head_dim, int query_block, int key_block, int bf16, halide_buffer_t* out);
int halyard_attention_backward(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                               halide_buffer_t* o, halide_buffer_t* dO, halide_buffer_t* lse, halide_buffer_t* dv,
                               halide_buffer_t* dq, int heads, int kv_heads, int query_block, int key_block, int bf16,
                               halide_buffer_t* out);
int halyard_attention_forward_ring(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                                   halide_buffer_t* kidx, halide_buffer_t* qidx, int heads, int kv_heads, int head_dim,
                                   int query_block, int key_block, int bf16, halide_buffer_t* out);
int halyard_attention_forward_lse_ring(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                       halide_buffer_t* pos, halide_buffer_t* kidx, halide_buffer_t* qidx,
                                       halide_buffer_t* lse, int heads, int kv_heads, int head_dim, int query_block,
                                       int key_block, int bf16, halide_buffer_t* out);
int halyard_attention_lse_ring(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* pos, halide_buffer_t* kidx,
                               halide_buffer_t* qidx, int heads, int kv_heads, int head_dim, int query_block,
                               int key_block, int bf16, halide_buffer_t* out);
int halyard_attention_backward_ring(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                                    halide_buffer_t* o, halide_buffer_t* dO, halide_buffer_t* lse,
                                    halide_buffer_t* kidx, halide_buffer_t* qidx, halide_buffer_t* dv,
                                    halide_buffer_t* dq, int heads, int kv_heads, int query_block, int key_block,
                                    int bf16, halide_buffer_t* out);
// A ring block's backward whose dQ part is added to the running sum of
// the blocks before (dq_sum, f32): dq = dq_sum + the part, row by row, each
// row of dq_sum read just before that row of dq is written, so dq may be
// dq_sum's own bytes (schedules/partition.h: Stage::dq_sum_in).
int halyard_attention_backward_ring_add(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                        halide_buffer_t* pos, halide_buffer_t* o, halide_buffer_t* dO,
                                        halide_buffer_t* lse, halide_buffer_t* kidx, halide_buffer_t* qidx,
                                        halide_buffer_t* dq_sum, halide_buffer_t* dv, halide_buffer_t* dq, int heads,
                                        int kv_heads, int query_block, int key_block, int bf16, halide_buffer_t* out);
int halyard_written_beside(halide_buffer_t* out);
}

namespace halyard::runtime::attention_cpu {

// The log-sum-exp of a row that sees no key of a ring block (dsl/ops.h:
// kNoKeysLse, which the runtime cannot include).
constexpr float kNoKeysLse = -1e30f;

// An operand's elements: f32, or bf16 as its 16 bits (the entry points'
// uint16 buffers).
struct Elems {
  const void* p = nullptr;
  bool bits16 = false;
  float operator[](int64_t i) const {
    return bits16 ? bf16_value(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  Elems operator+(int64_t i) const {
    return {bits16 ? static_cast<const void*>(static_cast<const uint16_t*>(p) + i)
                   : static_cast<const void*>(static_cast<const float*>(p) + i),
            bits16};
  }
};

// Whether an operand buffer is f32, or bf16 as its 16 bits (uint16): what
// these entry points and their CUDA twins take.
bool holds_f32(const halide_buffer_t* x);
bool holds_bf16(const halide_buffer_t* x);

// What every task reads of one kv head of one row: rows of k and v are
// head_dim elements each, `*_ld` elements apart.
struct KeyRows {
  int64_t S = 0;
  int D = 0, query_block = 0, key_block = 0;  // blocks: 0 for the defaults
  bool bf16 = false;  // the products in bf16 (the entry points' bf16)
  float scale = 1;
  Elems k, v;
  int64_t k_ld = 0, v_ld = 0;
  const int32_t* pos = nullptr;
  // A ring block's token indices (null: each token's seq index).
  const int32_t *qidx = nullptr, *kidx = nullptr;
  int64_t query_index(int64_t i) const { return qidx ? qidx[i] : i; }
};

// One query head of one row (the forward's task).
struct Head : KeyRows {
  Elems q;
  int64_t q_ld = 0;
};

// The query heads that share one kv head (the backward's task).
struct Group : KeyRows {
  int heads = 1;
  static constexpr int kMaxHeads = 64;
  Elems q[kMaxHeads], o[kMaxHeads], dO[kMaxHeads];
  const float* lse[kMaxHeads] = {};
  int64_t q_ld = 0, o_ld = 0, dO_ld = 0, lse_ld = 0;
};

// A ring block's token indices (the _ring entry points' kidx and qidx,
// [seq, batch]); both null elsewhere.
struct RingIndices {
  halide_buffer_t *kidx = nullptr, *qidx = nullptr;
};

// A bounds query of the entry points, these and their CUDA twins
// (attention_cuda.h): q, k, v and pos (and the backward's o, dO and lse,
// where given; v where given; a ring block's indices, where given; the dQ
// sum a ring block's backward adds to, where given) are asked for whole
// rows of the output's batch rows. The output is [head_dim, heads, seq,
// batch], or the log-sum-exp alone [heads, seq, batch].
int ask_whole_rows(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos, int heads,
                   int kv_heads, int head_dim, const halide_buffer_t* out, halide_buffer_t* o = nullptr,
                   halide_buffer_t* dO = nullptr, halide_buffer_t* lse = nullptr, RingIndices idx = {},
                   halide_buffer_t* dq_sum = nullptr);

// The ISA the entry points run with on this CPU ("avx512", "avx2", "base"; the
// widest it runs, or the one HALYARD_CPU_ISA names if it runs that one).
const char* isa();

// The queries per block the kernels take on this CPU where the schedule
// leaves it to them (kernel_tiles.attention_queries 0): 256 where the L2
// holds 1 MiB or more, else 128. The plan counts 256, the most.
int default_query_block();

}  // namespace halyard::runtime::attention_cpu
