// The arguments of the CUDA attention kernels (attention_cuda.cu), shared by
// the kernels and their launcher (attention_cuda.cpp): one struct passed by
// value, so both sides must see the same layout, and nothing here may need
// more than the C++ standard library.
#pragma once

#include <cstdint>

namespace halyard::runtime::attention_cuda {

// The head_dims the kernels are built for: a head_dim runs in the least of
// them that holds it (kMaxHeadDim at most).
constexpr int kPaddedHeadDims[] = {8, 16, 32, 64, 128};
constexpr int kMaxHeadDim = 128;
// Those of the bf16 kernels on tensor cores (products over 16 elements).
constexpr int kBf16HeadDims[] = {16, 32, 64, 128};

// The log-sum-exp of a row that sees no key of a ring block (dsl/ops.h:
// kNoKeysLse): finite, so that merging blocks never computes inf - inf.
constexpr float kNoKeysLse = -1e30f;

// Element strides of a tensor's (head, seq, batch) dimensions; head_dim is
// dense (stride 1). The log-sum-exp [heads, seq, batch] has no head_dim.
struct Strides {
  int64_t h = 0, s = 0, b = 0;
};

// An operand's elements (q, k, v, O): f32, or bf16 as its 16 bits (a value
// the schedule stores in bf16, read in place rather than decoded into an
// f32 copy first; the kernels decode it exactly). dO, a gradient, is never
// stored: f32 alone.
struct Operand {
  const void* p = nullptr;
  bool bits16 = false;
};

// Every pointer is the address of element (0, head 0, row 0, the call's
// first batch row), also where that element lies outside its buffer (an
// output holding only some heads): the kernels index absolute heads.
struct Args {
  Operand q, k, v;
  const int32_t* pos = nullptr;  // [seq, batch]: key j is visible to query i when 0 <= i - j <= pos[i]
  Operand o;  // the backward's, with dO and lse
  const float *dO = nullptr, *lse = nullptr;
  float* out = nullptr;      // the forward's output (null: the log-sum-exp alone), or the backward's dK
  float* lse_out = nullptr;  // the forward's log-sum-exp (natural log), or null
  float *dv = nullptr, *dq = nullptr;
  // dQ's running sum over a ring's key blocks, which the dQ kernel adds its
  // part to (null: none). Each thread reads its own elements just before
  // writing them, so it may be dq itself.
  const float* dq_in = nullptr;
  Strides q_st, k_st, v_st, o_st, dO_st, lse_st, out_st, lse_out_st, dv_st, dq_st, dq_in_st;
  int64_t pos_s = 1, pos_b = 0;
  // A ring block's token indices [seq, batch] (attention_cpu.h: the _ring
  // entry points); null: each token's seq index. Key j is then visible to
  // query i when qidx[i] - pos[i] <= kidx[j] <= qidx[i].
  const int32_t *qidx = nullptr, *kidx = nullptr;
  int64_t qidx_s = 1, qidx_b = 0, kidx_s = 1, kidx_b = 0;
  int S = 0, H = 0, KV = 0, D = 0;  // D: head_dim, at most the kernel's padded one
  int h0 = 0;  // the head (forward, dQ) or kv head (dK and dV) of the grid's first y
  float scale = 1;
};

}  // namespace halyard::runtime::attention_cuda
