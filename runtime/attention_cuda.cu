// Causal grouped-query attention on a CUDA device, FlashAttention-2's
// algorithm in f32 on CUDA cores: O(S) memory, nothing of [S, S] anywhere.
// Built by nvcc into a fatbin that the runtime loads through the driver
// (attention_cuda.cpp), so that no program needs the CUDA runtime library.
//
// Kernels are built for padded head_dims DP (8, 16, 32, 64, 128); a head_dim
// D between two runs in the larger, its missing elements zeros that add
// nothing. Each query row (a key row in dK/dV) belongs to T threads (T =
// DP / 32 when DP > 32, else 1), each holding DP / T of its elements in
// registers, in chunks of 4 interleaved across the T threads: a warp's reads
// of one shared-memory row are then T adjacent 16-byte chunks, all broadcast,
// without bank conflicts. A block stages tiles of the other side's rows
// (keys for the forward and dQ, queries for dK/dV) in shared memory, which
// every thread of the block then reads.
//
// Three kernels per head_dim: the forward (output and log-sum-exp); dQ; and
// dK with dV, which walks every query head of its kv head (no atomics: each
// output element has one writer, so every run gives the same bits).
//
// A ring attention key block (Args::kidx, qidx) is not in its queries'
// order: a block walks every tile of the other side, and skips one whose
// tokens' indices all fall outside its own rows' window of visible indices.
// A row that sees no key of the block gets output 0 and log-sum-exp
// kNoKeysLse, as on the CPU.
#include <climits>

#include "runtime/attention_cuda_args.h"

using halyard::runtime::attention_cuda::Args;
using halyard::runtime::attention_cuda::kNoKeysLse;
using halyard::runtime::attention_cuda::Operand;

namespace {

constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

template <int D>
struct Shape {
  static constexpr int T = D > 32 ? D / 32 : 1;  // threads per row
  static constexpr int C = D / (4 * T);          // chunks of 4 per thread
  static constexpr int R = 64;                   // rows per block
  static constexpr int B = D >= 128 ? 32 : 64;   // staged rows per tile (32 KiB at most for two tiles)
  static_assert(D % (4 * T) == 0 && 32 % T == 0, "padded head_dims are 8, 16, 32, 64 or 128");
};

// The bf16 in the low and the high half of a pair, as f32 (exactly).
__device__ __forceinline__ float bf16_lo(uint32_t p) { return __uint_as_float(p << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t p) { return __uint_as_float(p & 0xffff0000u); }

// x's element i, and x from element i on: f32, or bf16 decoded (exactly).
__device__ __forceinline__ float value(Operand x, int64_t i) {
  return x.bits16 ? bf16_lo(static_cast<const uint16_t*>(x.p)[i]) : static_cast<const float*>(x.p)[i];
}
// f(at), at(i) being x's element i: one test of x's type for a loop of
// reads (value() tests it at each).
template <class F>
__device__ __forceinline__ void with_elements(Operand x, F f) {
  if (x.bits16) {
    const uint16_t* p = static_cast<const uint16_t*>(x.p);
    f([p](int64_t i) { return bf16_lo(p[i]); });
  } else {
    const float* p = static_cast<const float*>(x.p);
    f([p](int64_t i) { return p[i]; });
  }
}
__device__ __forceinline__ Operand offset(Operand x, int64_t i) {
  return {x.bits16 ? static_cast<const void*>(static_cast<const uint16_t*>(x.p) + i)
                   : static_cast<const void*>(static_cast<const float*>(x.p) + i),
          x.bits16};
}

template <int T>
__device__ __forceinline__ float lanes_sum(float x) {
#pragma unroll
  for (int o = T / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Element e of chunk c of lane t's slice.
template <int D>
__device__ __forceinline__ int elem(int t, int c) {
  return 4 * (t + Shape<D>::T * c);
}

// Lane t's slice of a row of n elements (zeros past n).
template <int D>
__device__ __forceinline__ void load_slice(Operand row, int n, int t, float* x) {
#pragma unroll
  for (int c = 0; c < Shape<D>::C; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[4 * c + e] = elem<D>(t, c) + e < n ? value(row, elem<D>(t, c) + e) : 0.f;
}

// With sum (dQ's running sum over a ring's key blocks, possibly row
// itself), each element is sum's plus the product.
template <int D>
__device__ __forceinline__ void store_slice(float* row, int n, int t, const float* x, float scale,
                                            const float* sum = nullptr) {
#pragma unroll
  for (int c = 0; c < Shape<D>::C; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = elem<D>(t, c) + e;
      if (i < n) row[i] = sum ? sum[i] + x[4 * c + e] * scale : x[4 * c + e] * scale;
    }
}

template <int D>
__device__ __forceinline__ float dot_shared(const float* row, const float* x, int t) {
  float s = 0;
#pragma unroll
  for (int c = 0; c < Shape<D>::C; ++c) {
    const float4 r = *reinterpret_cast<const float4*>(row + elem<D>(t, c));
    s = fmaf(x[4 * c], r.x, s);
    s = fmaf(x[4 * c + 1], r.y, s);
    s = fmaf(x[4 * c + 2], r.z, s);
    s = fmaf(x[4 * c + 3], r.w, s);
  }
  return s;
}

template <int D>
__device__ __forceinline__ void add_shared(const float* row, float a, float* acc, int t) {
#pragma unroll
  for (int c = 0; c < Shape<D>::C; ++c) {
    const float4 r = *reinterpret_cast<const float4*>(row + elem<D>(t, c));
    acc[4 * c] = fmaf(a, r.x, acc[4 * c]);
    acc[4 * c + 1] = fmaf(a, r.y, acc[4 * c + 1]);
    acc[4 * c + 2] = fmaf(a, r.z, acc[4 * c + 2]);
    acc[4 * c + 3] = fmaf(a, r.w, acc[4 * c + 3]);
  }
}

// Whether every row of a [seq, hd] slab (row stride ld) is whole 16-byte
// vectors (float4s of f32, runs of 8 bf16s) that a kernel padded to D can
// stage as such: hd = D, and the start and the stride 16-byte aligned.
__device__ __forceinline__ bool vector_rows(Operand src, int64_t ld, int hd, int D) {
  return hd == D && ld % (src.bits16 ? 8 : 4) == 0 && reinterpret_cast<uintptr_t>(src.p) % 16 == 0;
}

// Rows [r0, r0 + n) of a [seq, hd] slab (row stride ld) into tile[B][D];
// zeros past n rows and past hd elements. As float4s where the rows are
// f32, whole and 16-byte aligned (vector_rows) and the kernel asks
// (kFloat4s); else an element at a time, testing the operand's type at each.
// (One loop for both types: with a loop for each, as with_elements gives,
// ptxas gave the f32 forward at head_dim 32 128 registers, 8 blocks an SM,
// where this loop gives 98 and 9, with the same tile loop; sm_90. Asked for
// 10 blocks, 96 registers, that loop grew by 7%.)
template <int D, bool kFloat4s = true>
__device__ __forceinline__ void stage(float* tile, Operand src, int64_t ld, int r0, int n, int hd) {
  if (kFloat4s && !src.bits16 && vector_rows(src, ld, hd, D)) {
    const float* f = static_cast<const float*>(src.p);
    for (int x = threadIdx.x; x < Shape<D>::B * D / 4; x += blockDim.x) {
      const int r = x / (D / 4), d = 4 * (x % (D / 4));
      reinterpret_cast<float4*>(tile)[x] =
          r < n ? *reinterpret_cast<const float4*>(f + static_cast<int64_t>(r0 + r) * ld + d) : float4{0, 0, 0, 0};
    }
    return;
  }
  for (int x = threadIdx.x; x < Shape<D>::B * D; x += blockDim.x) {
    const int r = x / D, d = x % D;
    tile[x] = r < n && d < hd ? value(src, static_cast<int64_t>(r0 + r) * ld + d) : 0.f;
  }
}

// The least document start (i - pos[i]) over the block's valid rows: the
// first key any of them sees. INT_MAX when no row is valid.
__device__ __forceinline__ int block_min(int* slot, bool valid, int value) {
  if (threadIdx.x == 0) *slot = INT_MAX;
  __syncthreads();
  if (valid) atomicMin(slot, value);
  __syncthreads();
  return *slot;
}

// The greatest value over the block's valid rows; INT_MIN + 1 when none.
// (slot: another than block_min's, which a thread may still be reading. An
// invalid row's value, INT_MIN say, is not negated: that overflows.)
__device__ __forceinline__ int block_max(int* slot, bool valid, int value) {
  return -block_min(slot, valid, valid ? -value : 0);
}

// Token i's index in the whole row: a ring block's query or key index
// (Args::qidx, kidx; s and bs its strides), else i itself.
__device__ __forceinline__ int token_index(const int32_t* idx, int64_t s, int64_t bs, int i, int b) {
  return idx ? idx[i * s + b * bs] : i;
}

// Whether a query at index qi (position pos_i) sees a key at index kj:
// qi - pos_i <= kj <= qi (dsl/ops.h).
__device__ __forceinline__ bool visible(int qi, int kj, int pos_i) { return kj <= qi && qi - kj <= pos_i; }

// A tile of queries as the dK/dV kernels see it: whether any of its
// queries can see a key of the block, and the window of key indices that
// every one of them sees, [start_max, qi_min] (empty when start_max >
// qi_min).
struct QueryTile {
  bool sees;
  int start_max, qi_min;
};

// For the dK/dV kernels, with the whole block: the positions and indices of
// query tile [i0, i0 + n) of batch row b into poss and qis [0, B) (-1 past
// n), and whether any of those queries can see a key of index in [kmin,
// kmax], the block's keys': one whose document starts (qi - pos) by kmax,
// at index kmin or later. slots: four.
template <int B>
__device__ __forceinline__ QueryTile query_tile_sees(const Args& a, int b, int i0, int n, int kmin, int kmax, int* poss,
                                                     int* qis, int* slots) {
  __syncthreads();
  if (threadIdx.x == 0) slots[0] = slots[1] = slots[2] = slots[3] = INT_MAX;
  __syncthreads();
  for (int x = threadIdx.x; x < B; x += blockDim.x) {
    const int i = i0 + x;
    const int p = x < n ? a.pos[i * a.pos_s + b * a.pos_b] : -1;
    const int qi = x < n ? token_index(a.qidx, a.qidx_s, a.qidx_b, i, b) : -1;
    poss[x] = p, qis[x] = qi;
    if (x < n) {
      atomicMin(&slots[0], qi - p);
      atomicMin(&slots[1], -qi);
      atomicMin(&slots[2], p - qi);
      atomicMin(&slots[3], qi);
    }
  }
  __syncthreads();
  return {slots[0] <= kmax && -slots[1] >= kmin, -slots[2], slots[3]};
}

// The end of a query tile's D_i sums (tile_dsum, tile_dsum_bf16): row x's
// P partial sums, on adjacent lanes, added, and with the row's log-sum-exp
// (log2 units) into dis and lse2s by its first lane; zeros past n.
template <int P>
__device__ __forceinline__ void finish_dsum(const Args& a, int h, int b, int i0, int n, int x, bool first, float di,
                                            float* dis, float* lse2s) {
#pragma unroll
  for (int m = P / 2; m > 0; m /= 2) di += __shfl_xor_sync(0xffffffffu, di, m);
  if (first) {
    dis[x] = di;
    lse2s[x] = x < n ? a.lse[h * a.lse_st.h + (i0 + x) * a.lse_st.s + b * a.lse_st.b] * kLog2e : 0.f;
  }
  __syncthreads();
}

// For the f32 dK/dV kernel, with the whole block: D_i = dO_i . O_i of
// query tile [i0, i0 + n) of head h, batch row b (dO_i from the staged
// tile ds, [B][D]) into dis, and the queries' log-sum-exps (log2 units)
// into lse2s; zeros past n. The block's R T threads split the B rows, P a
// row, each summing D / P of its elements (log2(P) shuffles a row; a warp
// a row cost five, and a tile about a fifth of the kernel's time).
template <int D>
__device__ __forceinline__ void tile_dsum(const Args& a, int h, int b, int i0, int n, const float* ds, float* dis,
                                          float* lse2s) {
  using S_ = Shape<D>;
  constexpr int P = S_::R * S_::T / S_::B, E = D / P;
  static_assert(P * S_::B == S_::R * S_::T && E % 4 == 0, "whole float4s of a row for each of its threads");
  const int x = threadIdx.x / P, first = static_cast<int>(threadIdx.x % P) * E;
  float di = 0;
  if (x < n) {
    const Operand o = offset(a.o, h * a.o_st.h + (i0 + x) * a.o_st.s + b * a.o_st.b + first);
    const float* row = ds + x * D + first;
#pragma unroll
    for (int e4 = 0; e4 < E; e4 += 4) {
      const float4 g = *reinterpret_cast<const float4*>(row + e4);
      const float gs[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (first + e4 + e < a.D) di = fmaf(gs[e], value(o, e4 + e), di);
    }
  }
  finish_dsum<P>(a, h, b, i0, n, x, first == 0, di, dis, lse2s);
}

// A query row's thread in a grid of (row blocks, heads from h0, batch rows):
// its lane t of the row's T, row i of head h of batch row b, the kv head,
// the row's position (-1 past the rows) and its index in the whole row.
struct QueryRow {
  int t, i, h, b, kvh, pos, qi;
  bool valid;
};

template <int D>
__device__ __forceinline__ QueryRow query_row(const Args& a) {
  QueryRow r;
  r.t = threadIdx.x % Shape<D>::T;
  r.i = blockIdx.x * Shape<D>::R + threadIdx.x / Shape<D>::T;
  r.h = a.h0 + blockIdx.y, r.b = blockIdx.z, r.kvh = r.h / (a.H / a.KV);
  r.valid = r.i < a.S;
  r.pos = r.valid ? a.pos[r.i * a.pos_s + r.b * a.pos_b] : -1;
  r.qi = r.valid ? token_index(a.qidx, a.qidx_s, a.qidx_b, r.i, r.b) : 0;
  return r;
}

// The keys a block of query rows sees, walked in tiles: from the least
// document start of its rows (block_min) to its last row; a ring block's,
// all of them, each tile checked against the window of indices its rows
// see (key_indices).
struct KeyRange {
  int lo, hi;
  Operand k, v;  // the kv head's rows of the batch row
};

// From each valid row's least and greatest visible index (qi - pos and qi;
// INT_MAX and INT_MIN for none), over the block. slots: three, of which
// a ring block's window stays in the first two (slots[0] and -slots[1],
// in shared memory rather than in registers every thread keeps).
__device__ __forceinline__ KeyRange key_range(const Args& a, int* slots, int lo, int hi, int rows_per_block, Operand k,
                                              Operand v) {
  lo = block_min(&slots[0], lo != INT_MAX, lo);
  if (!a.kidx) return {lo, min(a.S, static_cast<int>(blockIdx.x + 1) * rows_per_block), k, v};
  block_max(&slots[1], hi != INT_MIN, hi);
  return {0, a.S, k, v};
}

template <int D>
__device__ __forceinline__ KeyRange key_range(const Args& a, int* slots, const QueryRow& r) {
  const bool row = r.valid && r.t == 0;
  return key_range(a, slots, row ? max(0, r.qi - r.pos) : INT_MAX, row ? r.qi : INT_MIN, Shape<D>::R,
                   offset(a.k, r.kvh * a.k_st.h + r.b * a.k_st.b), offset(a.v, r.kvh * a.v_st.h + r.b * a.v_st.b));
}

// A tile of keys [j0, j0 + n): n (0: none of them in the rows' window, not
// staged) and the least and greatest of their indices.
struct KeyTile {
  int n, kmin, kmax;
};

// For the whole block: the indices of keys [j0, j0 + n) of the range (n =
// B, or fewer at its end) into kis; n is 0 where none of them is in the
// rows' window (key_range's slots; nothing else staged then). slots: five.
template <int B>
__device__ __forceinline__ KeyTile key_indices(const Args& a, const KeyRange& kr, int j0, int* kis, int* slots) {
  const int n = min(B, kr.hi - j0);
  __syncthreads();
  if (!a.kidx) {
    for (int x = threadIdx.x; x < n; x += blockDim.x) kis[x] = j0 + x;
    return {n, j0, j0 + n - 1};
  }
  if (threadIdx.x == 0) slots[2] = 1, slots[3] = slots[4] = INT_MAX;
  __syncthreads();
  const int seen_lo = slots[0], seen_hi = -slots[1], b = blockIdx.z;
  for (int x = threadIdx.x; x < n; x += blockDim.x) {
    const int kj = a.kidx[(j0 + x) * a.kidx_s + b * a.kidx_b];
    kis[x] = kj;
    if (kj >= seen_lo && kj <= seen_hi) atomicMin(&slots[2], 0);
    atomicMin(&slots[3], kj);
    atomicMin(&slots[4], -kj);
  }
  __syncthreads();
  return {slots[2] ? 0 : n, slots[3], -slots[4]};
}

// Keys [j0, j0 + n) and their values into ks and vs (null: no values), and
// their indices into kis, for the whole block; returns n (0: a tile the
// rows do not see, not staged). kFloat4s: as stage's.
template <int D, bool kFloat4s>
__device__ __forceinline__ int stage_keys(const Args& a, const KeyRange& kr, int j0, float* ks, float* vs, int* kis,
                                          int* slots) {
  const int n = key_indices<Shape<D>::B>(a, kr, j0, kis, slots).n;
  if (n == 0) return 0;
  stage<D, kFloat4s>(ks, kr.k, a.k_st.s, j0, n, a.D);
  if (vs) stage<D, kFloat4s>(vs, kr.v, a.v_st.s, j0, n, a.D);
  __syncthreads();
  return n;
}

// grid (row blocks, heads from h0, batch rows); block R * T threads. With
// out null (the log-sum-exp alone), P V is skipped and v not staged.
template <int D>
__device__ void forward(const Args& a) {
  using S_ = Shape<D>;
  constexpr int T = S_::T, B = S_::B, KC = 8;
  __shared__ __align__(16) float ks[B * D];
  __shared__ __align__(16) float vs[B * D];
  __shared__ int kis[B], slots[5];
  const QueryRow row = query_row<D>(a);
  const auto [t, i, h, b, kvh, pi, qi, valid] = row;
  const float c = a.scale * kLog2e;  // scores in log2 units: exp2 instead of exp
  float q[4 * S_::C], acc[4 * S_::C];
  if (valid) load_slice<D>(offset(a.q, h * a.q_st.h + i * a.q_st.s + b * a.q_st.b), a.D, t, q);
#pragma unroll
  for (int x = 0; x < 4 * S_::C; ++x) {
    if (!valid) q[x] = 0;
    acc[x] = 0;
  }
  const KeyRange kr = key_range<D>(a, slots, row);
  float m = -INFINITY, l = 0;
  for (int j0 = kr.lo; j0 < kr.hi; j0 += B) {
    // (an element at a time: the float4 path costs this kernel, whose q and
    // output stay in registers meanwhile, 28 registers and a spill at
    // head_dims 64 and 128; ptxas, sm_90)
    const int n = stage_keys<D, false>(a, kr, j0, ks, a.out ? vs : nullptr, kis, slots);
    for (int u0 = 0; u0 < n; u0 += KC) {
      float s[KC];
      float mx = m;
#pragma unroll
      for (int u = 0; u < KC; ++u) {
        const float dot = lanes_sum<T>(dot_shared<D>(ks + (u0 + u) * D, q, t));
        const bool vis = valid && u0 + u < n && visible(qi, kis[u0 + u], pi);
        s[u] = vis ? dot * c : -INFINITY;
        mx = fmaxf(mx, s[u]);
      }
      // exp2(-inf - finite) = 0 drops an empty past; with nothing seen yet
      // (mx = -inf) nothing changes.
      const float alpha = mx == -INFINITY ? 1.f : exp2f(m - mx);
      l *= alpha;
#pragma unroll
      for (int x = 0; x < 4 * S_::C; ++x) acc[x] *= alpha;
#pragma unroll
      for (int u = 0; u < KC; ++u) {
        const float p = s[u] == -INFINITY ? 0.f : exp2f(s[u] - mx);
        l += p;
        if (a.out) add_shared<D>(vs + (u0 + u) * D, p, acc, t);
      }
      m = mx;
    }
  }
  if (!valid) return;
  const float inv = l > 0 ? 1.f / l : 0.f;
  if (a.out) store_slice<D>(a.out + h * a.out_st.h + i * a.out_st.s + b * a.out_st.b, a.D, t, acc, inv);
  if (a.lse_out && t == 0)
    a.lse_out[h * a.lse_out_st.h + i * a.lse_out_st.s + b * a.lse_out_st.b] = l > 0 ? (m + log2f(l)) * kLn2 : kNoKeysLse;
}

// dQ: grid and block as the forward's. dS = P (dP - rowsum(dO * O)), dQ = scale dS K.
template <int D>
__device__ void grad_q(const Args& a) {
  using S_ = Shape<D>;
  constexpr int T = S_::T, B = S_::B;
  __shared__ __align__(16) float ks[B * D];
  __shared__ __align__(16) float vs[B * D];
  __shared__ int kis[B], slots[5];
  const QueryRow row = query_row<D>(a);
  const auto [t, i, h, b, kvh, pi, qi, valid] = row;
  const float c = a.scale * kLog2e;
  float q[4 * S_::C], dO[4 * S_::C], dq[4 * S_::C];
  float di = 0, lse2 = 0;
  if (valid) {
    load_slice<D>(offset(a.q, h * a.q_st.h + i * a.q_st.s + b * a.q_st.b), a.D, t, q);
    load_slice<D>(Operand{a.dO + h * a.dO_st.h + i * a.dO_st.s + b * a.dO_st.b}, a.D, t, dO);
    float o[4 * S_::C];
    load_slice<D>(offset(a.o, h * a.o_st.h + i * a.o_st.s + b * a.o_st.b), a.D, t, o);
#pragma unroll
    for (int x = 0; x < 4 * S_::C; ++x) di = fmaf(dO[x], o[x], di);
    lse2 = a.lse[h * a.lse_st.h + i * a.lse_st.s + b * a.lse_st.b] * kLog2e;
  } else {
#pragma unroll
    for (int x = 0; x < 4 * S_::C; ++x) q[x] = dO[x] = 0;
  }
  di = lanes_sum<T>(di);
#pragma unroll
  for (int x = 0; x < 4 * S_::C; ++x) dq[x] = 0;
  const KeyRange kr = key_range<D>(a, slots, row);
  for (int j0 = kr.lo; j0 < kr.hi; j0 += B) {
    const int n = stage_keys<D, true>(a, kr, j0, ks, vs, kis, slots);
    for (int u = 0; u < n; ++u) {
      const float s = lanes_sum<T>(dot_shared<D>(ks + u * D, q, t));
      const float dp = lanes_sum<T>(dot_shared<D>(vs + u * D, dO, t));
      const bool vis = valid && visible(qi, kis[u], pi);
      const float p = vis ? exp2f(s * c - lse2) : 0.f;
      add_shared<D>(ks + u * D, p * (dp - di), dq, t);
    }
  }
  if (!valid) return;
  store_slice<D>(a.dq + h * a.dq_st.h + i * a.dq_st.s + b * a.dq_st.b, a.D, t, dq, a.scale,
                 a.dq_in ? a.dq_in + h * a.dq_in_st.h + i * a.dq_in_st.s + b * a.dq_in_st.b : nullptr);
}

// dK (into out) and dV: grid (key row blocks, kv heads from h0, batch rows);
// block R * T threads, one key row each, walking every query head of the kv
// head and every query tile that can see the block's keys (from the
// block's first row; a ring block's, from the first).
template <int D>
__device__ void grad_kv(const Args& a) {
  using S_ = Shape<D>;
  constexpr int T = S_::T, R = S_::R, B = S_::B;
  __shared__ __align__(16) float qs[B * D];
  __shared__ __align__(16) float ds_[B * D];  // dO rows
  __shared__ float lse2s[B], dis[B];
  __shared__ int poss[B], qis[B], slots[4], k_slots[2];
  const int t = threadIdx.x % T, j = blockIdx.x * R + threadIdx.x / T;
  const int g = a.h0 + blockIdx.y, b = blockIdx.z, grp = a.H / a.KV;
  const bool valid = j < a.S;
  const int kj = valid ? token_index(a.kidx, a.kidx_s, a.kidx_b, j, b) : 0;
  const int kmin = block_min(&k_slots[0], valid && t == 0, kj), kmax = block_max(&k_slots[1], valid && t == 0, kj);
  const float c = a.scale * kLog2e;
  float k[4 * S_::C], v[4 * S_::C], dk[4 * S_::C], dv[4 * S_::C];
  if (valid) {
    load_slice<D>(offset(a.k, g * a.k_st.h + j * a.k_st.s + b * a.k_st.b), a.D, t, k);
    load_slice<D>(offset(a.v, g * a.v_st.h + j * a.v_st.s + b * a.v_st.b), a.D, t, v);
  }
#pragma unroll
  for (int x = 0; x < 4 * S_::C; ++x) {
    if (!valid) k[x] = v[x] = 0;
    dk[x] = dv[x] = 0;
  }
  for (int w = 0; w < grp; ++w) {
    const int h = g * grp + w;
    for (int i0 = a.qidx ? 0 : static_cast<int>(blockIdx.x) * R; i0 < a.S; i0 += B) {
      const int n = min(B, a.S - i0);
      if (!query_tile_sees<B>(a, b, i0, n, kmin, kmax, poss, qis, slots).sees) continue;
      stage<D>(qs, offset(a.q, h * a.q_st.h + b * a.q_st.b), a.q_st.s, i0, n, a.D);
      stage<D>(ds_, Operand{a.dO + h * a.dO_st.h + b * a.dO_st.b}, a.dO_st.s, i0, n, a.D);
      __syncthreads();
      tile_dsum<D>(a, h, b, i0, n, ds_, dis, lse2s);
      for (int u = 0; u < n; ++u) {
        const float s = lanes_sum<T>(dot_shared<D>(qs + u * D, k, t));
        const float dp = lanes_sum<T>(dot_shared<D>(ds_ + u * D, v, t));
        const bool vis = valid && visible(qis[u], kj, poss[u]);
        const float p = vis ? exp2f(s * c - lse2s[u]) : 0.f;
        add_shared<D>(ds_ + u * D, p, dv, t);
        add_shared<D>(qs + u * D, p * (dp - dis[u]), dk, t);
      }
    }
  }
  if (!valid) return;
  store_slice<D>(a.out + g * a.out_st.h + j * a.out_st.s + b * a.out_st.b, a.D, t, dk, a.scale);
  store_slice<D>(a.dv + g * a.dv_st.h + j * a.dv_st.s + b * a.dv_st.b, a.D, t, dv, 1.f);
}

// ---------------------------------------------------------------------------
// The same three kernels in bf16 on tensor cores (the entry points' bf16,
// the attention node's Attrs::bf16): q, k, v and dO rounded to bf16 as they are
// loaded, the probabilities and dS rounded before their products, f32
// sums; the CPU library's bf16 (attention_cpu.h) rounds the same values.
// FlashAttention-2's layout: a block is 4 warps, each owning 16 rows of its
// side (queries; keys in dK/dV) as mma.sync m16n8k16 A fragments in
// registers; tiles of the other side's rows are staged in shared memory as
// bf16, row-major for products over head_dim and transposed for products
// over rows. A score tile's accumulators (the C fragment) are laid out as
// the A fragment of the next product wants them, so P and dS never leave
// registers. Padded head_dims DP 16, 32, 64 and 128 (one of 8 runs in 16).

#ifndef HALYARD_CUDA_EMULATION
// d (16 x 8, f32) += a (16 x 16, bf16, row-major) b (16 x 8, bf16,
// column-major), over one warp; the fragments are PTX's for m16n8k16.
__device__ __forceinline__ void mma_bf16(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// lo and hi rounded to bf16 (nearest, ties to even; finite) as a pair, lo
// in the low half: one cvt on the device (sm_80 and later; a converted a
// goes to the upper half of d); its integer twin in the emulator.
#ifndef HALYARD_CUDA_EMULATION
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t pair;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(hi), "f"(lo));
  return pair;
}
#else
inline uint32_t bf16_bits(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
inline uint32_t pack_bf16(float lo, float hi) { return bf16_bits(lo) | bf16_bits(hi) << 16; }
#endif

// 2^x for the probabilities (x <= 0): the special function unit's ex2 alone.
// It flushes results below 2^-126 to 0, where exp2f adds a range test and
// two multiplies per call to keep them (a 1e-38 share of a row's sum).
#ifndef HALYARD_CUDA_EMULATION
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#else
inline float exp2_ftz(float x) { return exp2f(x); }
#endif

template <int DP>
struct Tc {
  static constexpr int R = 64;                   // rows per block: 4 warps of 16
  static constexpr int B = DP >= 128 ? 32 : 64;  // staged rows of the other side per tile
  static constexpr int KS = DP / 16;             // k-steps over head_dim
  static constexpr int NT = B / 8;               // score tiles of 8 per staged tile
  static constexpr int DT = DP / 8;              // output tiles of 8 along head_dim
  // Row strides of the staged tiles (bf16 elements), row-major and
  // transposed: a half-warp's 64-bit B-fragment loads (load_b) span 4 rows
  // x 8 words, which fall on 32 distinct banks when a row is 8 or 24 words
  // mod 32 (16 or 48 elements mod 64).
  static constexpr int stride(int n) {
    while (n % 64 != 16 && n % 64 != 48) n += 16;
    return n;
  }
  static constexpr int LR = stride(DP), LC = stride(B);
  static_assert(DP % 16 == 0 && DP <= 128, "tensor-core head_dims are 16, 32, 64 or 128");
};

// Where element k of a staged row sits: each run of 16 along a product's k
// dimension keeps its pairs in the order 0 4 1 5 2 6 3 7, so that the two
// pairs a lane's B fragment holds (2t and 2t + 8 of the run) are adjacent,
// one 64-bit load.
__device__ __forceinline__ int kslot(int k) {
  const int p = (k & 15) >> 1;
  return (k & ~15) | (p & 3) << 2 | (p >> 2) << 1 | (k & 1);
}
// The element that kslot puts at `slot`.
__device__ __forceinline__ int kdim(int slot) {
  const int sp = (slot & 15) >> 1;
  return (slot & ~15) | ((sp >> 1) | (sp & 1) << 2) << 1 | (slot & 1);
}

// The lane's coordinates in its warp's fragments: group g (row) and t (pair).
struct Lane {
  int g, t;
};
__device__ __forceinline__ Lane lane() { return {static_cast<int>(threadIdx.x & 31) >> 2, static_cast<int>(threadIdx.x & 3)}; }

// The warp's A fragments of rows [r0, r0 + 16) of a [seq, hd] f32 slab (row
// stride ld), one per k-step of 16 along head_dim, rounded to bf16; zeros
// past S rows and past hd. Register e holds row g + 8 (e & 1), columns
// 16 ks + 2t + 8 (e >> 1) and the next.
template <int DP>
__device__ __forceinline__ void load_a(uint32_t (*frag)[4], Operand src, int64_t ld, int r0, int S, int hd) {
  const Lane l = lane();
#pragma unroll
  for (int ks = 0; ks < Tc<DP>::KS; ++ks)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = r0 + l.g + 8 * (e & 1), d = 16 * ks + 2 * l.t + 8 * (e >> 1);
      float lo = 0, hi = 0;
      if (r < S) {
        const int64_t at = static_cast<int64_t>(r) * ld + d;
        if (d < hd) lo = value(src, at);
        if (d + 1 < hd) hi = value(src, at + 1);
      }
      frag[ks][e] = pack_bf16(lo, hi);
    }
}

// The B fragment (16 x 8) whose column n is row n0 + n of a staged tile
// (row stride ld), over elements [k0, k0 + 16) of those rows (in kslot's
// order: the lane's two pairs are adjacent).
__device__ __forceinline__ void load_b(uint32_t* b, const uint16_t* tile, int ld, int n0, int k0) {
  const Lane l = lane();
  const uint2 pairs = *reinterpret_cast<const uint2*>(tile + (n0 + l.g) * ld + k0 + 4 * l.t);
  b[0] = pairs.x;
  b[1] = pairs.y;
}

// The A fragment of a product over 16 staged rows from two score tiles'
// accumulators (columns 16 kk to 16 kk + 15), rounded to bf16.
__device__ __forceinline__ void scores_as_a(uint32_t* a, const float (*s)[4], int kk) {
  a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// s[nt] (tile nt: staged rows 8 nt to 8 nt + 7) = the warp's 16 rows (A
// fragments over head_dim) times the staged rows of `rows` (row-major).
template <int DP>
__device__ __forceinline__ void products_over_head_dim(float (*s)[4], const uint32_t (*a)[4], const uint16_t* rows) {
  using T = Tc<DP>;
#pragma unroll
  for (int nt = 0; nt < T::NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = 0;
#pragma unroll
    for (int k = 0; k < T::KS; ++k) {
      uint32_t b[2];
      load_b(b, rows, T::LR, 8 * nt, 16 * k);
      mma_bf16(s[nt], a[k], b);
    }
  }
}

// acc (the warp's 16 rows over head_dim) += s (their scores against the
// staged rows, rounded to bf16) times the staged rows of `cols`
// (transposed).
template <int DP>
__device__ __forceinline__ void accumulate_over_rows(float (*acc)[4], const float (*s)[4], const uint16_t* cols) {
  using T = Tc<DP>;
#pragma unroll
  for (int kk = 0; kk < T::B / 16; ++kk) {
    uint32_t a[4];
    scores_as_a(a, s, kk);
#pragma unroll
    for (int dt = 0; dt < T::DT; ++dt) {
      uint32_t b[2];
      load_b(b, cols, T::LC, 8 * dt, 16 * kk);
      mma_bf16(acc[dt], a, b);
    }
  }
}

// The backward's scores s of the warp's 16 rows against the staged rows
// made into probabilities P (in s) and dP into dS = P (dP - D_i) scale (in
// dp): at(w, u, &lse2, &di) says whether score (row w of the lane's two, 0
// or 1; staged row u) is visible, and gives its query's log-sum-exp (log2
// units) and D_i. Where the lane's rows see the whole tile (whole), no
// score is masked, and at() is asked for the statistics only (the test of
// visibility, unused, is compiled away: most tiles of a long causal row).
template <int DP, class At>
__device__ __forceinline__ void probabilities_and_ds(float (*s)[4], float (*dp)[4], float c, float scale, bool whole,
                                                     At at) {
  const Lane l = lane();
  if (whole) {
#pragma unroll
    for (int nt = 0; nt < Tc<DP>::NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float lse2, di;
        at(e >> 1, 8 * nt + 2 * l.t + (e & 1), &lse2, &di);
        const float p = exp2_ftz(s[nt][e] * c - lse2);
        dp[nt][e] = p * (dp[nt][e] - di) * scale;
        s[nt][e] = p;
      }
    return;
  }
#pragma unroll
  for (int nt = 0; nt < Tc<DP>::NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float lse2, di;
      const bool vis = at(e >> 1, 8 * nt + 2 * l.t + (e & 1), &lse2, &di);
      const float p = vis ? exp2_ftz(s[nt][e] * c - lse2) : 0.f;
      dp[nt][e] = p * (dp[nt][e] - di) * scale;
      s[nt][e] = p;
    }
}

template <int N>
__device__ __forceinline__ void zero(float (*x)[4]) {
#pragma unroll
  for (int t = 0; t < N; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[t][e] = 0;
}

// Rows [r0, r0 + n) of a [seq, hd] slab (f32, or bf16 as its 16 bits) into
// a tile of B rows as bf16, where given: row-major (rows[r * LR +
// kslot(d)]) and transposed (cols[d * LC + kslot(r)]); zeros past n rows
// and past hd.
// Where the slab's rows are whole 16-byte vectors (vector_rows: hd = DP,
// the start and the row stride aligned), each thread reads them: for the
// row-major tile, half a run of 16 (its pairs 0 1 4 5 or 2 3 6 7, slots 0-3
// or 4-7 of kslot's order: one 128-bit store; a quarter-warp's stores are
// one row's 128 contiguous bytes); for the transposed one, two rows (a pair
// along its k dimension) x 8 elements (8 32-bit stores, the warp's 32 on
// distinct banks). f32 is rounded as it is read (float4s); bf16 is moved
// as it is (two 64-bit loads a half-run; a 128-bit load a row of the
// transposed pair). Else (a padded head_dim) a pair at a time.
template <int DP>
__device__ __forceinline__ void stage_bf16(uint16_t* rows, uint16_t* cols, Operand src, int64_t ld, int r0, int n,
                                           int hd) {
  using T = Tc<DP>;
  constexpr int B = T::B;
  if (src.bits16 && vector_rows(src, ld, hd, DP)) {
    const uint16_t* h16 = static_cast<const uint16_t*>(src.p);
    auto load = [&](auto zero, int r, int d) {  // (elements d, d + 1, ... of row r as their words)
      using V = decltype(zero);
      return r < n ? *reinterpret_cast<const V*>(h16 + static_cast<int64_t>(r0 + r) * ld + d) : zero;
    };
    if (rows)
      for (int x = threadIdx.x; x < B * DP / 8; x += blockDim.x) {
        const int r = x / (DP / 8), run = 16 * ((x % (DP / 8)) / 2), h = x % 2;
        // pairs 2h, 2h + 1 of the run (f) and 2h + 4, 2h + 5 (g)
        const uint2 f = load(uint2{0, 0}, r, run + 4 * h), g = load(uint2{0, 0}, r, run + 4 * h + 8);
        *reinterpret_cast<uint4*>(rows + r * T::LR + run + 8 * h) = uint4{f.x, g.x, f.y, g.y};
      }
    if (cols)
      for (int x = threadIdx.x; x < B / 2 * DP / 8; x += blockDim.x) {
        const int r = 2 * (x % (B / 2)), d0 = 8 * (x / (B / 2));
        const uint4 u = load(uint4{0, 0, 0, 0}, r, d0), w = load(uint4{0, 0, 0, 0}, r + 1, d0);
        const uint32_t a[4] = {u.x, u.y, u.z, u.w}, b[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 8; ++j)
          *reinterpret_cast<uint32_t*>(cols + (d0 + j) * T::LC + kslot(r)) =
              j % 2 ? (a[j / 2] >> 16) | (b[j / 2] & 0xffff0000u) : (a[j / 2] & 0xffffu) | (b[j / 2] << 16);
      }
    return;
  }
  if (!src.bits16 && vector_rows(src, ld, hd, DP)) {
    const float* f32 = static_cast<const float*>(src.p);
    auto load4 = [&](int r, int d) {
      return r < n ? *reinterpret_cast<const float4*>(f32 + static_cast<int64_t>(r0 + r) * ld + d)
                   : float4{0, 0, 0, 0};
    };
    if (rows)
      for (int x = threadIdx.x; x < B * DP / 8; x += blockDim.x) {
        const int r = x / (DP / 8), run = 16 * ((x % (DP / 8)) / 2), h = x % 2;
        // pairs 2h, 2h + 1 of the run (f) and 2h + 4, 2h + 5 (g)
        const float4 f = load4(r, run + 4 * h), g = load4(r, run + 4 * h + 8);
        *reinterpret_cast<uint4*>(rows + r * T::LR + run + 8 * h) =
            uint4{pack_bf16(f.x, f.y), pack_bf16(g.x, g.y), pack_bf16(f.z, f.w), pack_bf16(g.z, g.w)};
      }
    if (cols)
      for (int x = threadIdx.x; x < B / 2 * DP / 8; x += blockDim.x) {
        const int r = 2 * (x % (B / 2)), d0 = 8 * (x / (B / 2));
        const float4 f[2][2] = {{load4(r, d0), load4(r, d0 + 4)}, {load4(r + 1, d0), load4(r + 1, d0 + 4)}};
        const float e[2][8] = {{f[0][0].x, f[0][0].y, f[0][0].z, f[0][0].w, f[0][1].x, f[0][1].y, f[0][1].z, f[0][1].w},
                               {f[1][0].x, f[1][0].y, f[1][0].z, f[1][0].w, f[1][1].x, f[1][1].y, f[1][1].z, f[1][1].w}};
#pragma unroll
        for (int j = 0; j < 8; ++j)
          *reinterpret_cast<uint32_t*>(cols + (d0 + j) * T::LC + kslot(r)) = pack_bf16(e[0][j], e[1][j]);
      }
    return;
  }
  with_elements(src, [&](auto at) {
    for (int x = threadIdx.x; x < B * DP / 2; x += blockDim.x) {
      const int r = x / (DP / 2), d = 2 * (x % (DP / 2));
      float lo = 0, hi = 0;
      if (r < n) {
        const int64_t e = static_cast<int64_t>(r0 + r) * ld + d;
        if (d < hd) lo = at(e);
        if (d + 1 < hd) hi = at(e + 1);
      }
      const uint32_t pair = pack_bf16(lo, hi);
      if (rows) *reinterpret_cast<uint32_t*>(rows + r * T::LR + kslot(d)) = pair;
      if (cols) {
        cols[d * T::LC + kslot(r)] = static_cast<uint16_t>(pair & 0xffffu);
        cols[(d + 1) * T::LC + kslot(r)] = static_cast<uint16_t>(pair >> 16);
      }
    }
  });
}

// The warp's query rows (the forward and dQ): absolute head h, the lane's
// rows row(0) = r0 + g and row(1) = r0 + g + 8 (computed where needed: a
// register less each), their positions and their indices in the whole row.
struct TcRows {
  int h, b, kvh, r0, pos[2], qi[2];
  bool valid[2];
  __device__ __forceinline__ int row(int w) const { return r0 + lane().g + 8 * w; }
  // Whether both the lane's rows see every key of a full tile of B (whose
  // indices lie in each row's window [qi - pos, qi]).
  template <int B>
  __device__ __forceinline__ bool see_whole(const KeyTile& t) const {
    bool all = t.n == B;
#pragma unroll
    for (int w = 0; w < 2; ++w) all = all && valid[w] && qi[w] - pos[w] <= t.kmin && t.kmax <= qi[w];
    return all;
  }
};
__device__ __forceinline__ TcRows tc_rows(const Args& a, int rows_per_block) {
  const Lane l = lane();
  TcRows r;
  r.h = a.h0 + blockIdx.y, r.b = blockIdx.z, r.kvh = r.h / (a.H / a.KV);
  r.r0 = blockIdx.x * rows_per_block + (threadIdx.x >> 5) * 16;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int i = r.r0 + l.g + 8 * e;
    r.valid[e] = i < a.S;
    r.pos[e] = r.valid[e] ? a.pos[i * a.pos_s + r.b * a.pos_b] : -1;
    r.qi[e] = r.valid[e] ? token_index(a.qidx, a.qidx_s, a.qidx_b, i, r.b) : 0;
  }
  return r;
}
// The keys the block's rows see (key_range), and their kv head's rows of k
// and v. slots: three.
__device__ __forceinline__ KeyRange tc_keys(const Args& a, int* slots, const TcRows& r, int rows_per_block) {
  int lo = INT_MAX, hi = INT_MIN;
#pragma unroll
  for (int e = 0; e < 2; ++e)
    if (r.valid[e]) lo = min(lo, max(0, r.qi[e] - r.pos[e])), hi = max(hi, r.qi[e]);
  return key_range(a, slots, lo, hi, rows_per_block, offset(a.k, r.kvh * a.k_st.h + r.b * a.k_st.b),
                   offset(a.v, r.kvh * a.v_st.h + r.b * a.v_st.b));
}

// Keys [j0, j0 + B) (returned: n of them, 0 for a tile the rows do not
// see, not staged) and their values as bf16 into the tiles given
// (row-major, transposed; null for none), their indices into kis, for the
// whole block.
template <int DP>
__device__ __forceinline__ KeyTile stage_keys_bf16(const Args& a, const KeyRange& keys, int j0, uint16_t* k_rows,
                                                   uint16_t* k_cols, uint16_t* v_rows, uint16_t* v_cols, int* kis,
                                                   int* slots) {
  const KeyTile t = key_indices<Tc<DP>::B>(a, keys, j0, kis, slots);
  if (t.n == 0) return t;
  stage_bf16<DP>(k_rows, k_cols, keys.k, a.k_st.s, j0, t.n, a.D);
  if (v_rows || v_cols) stage_bf16<DP>(v_rows, v_cols, keys.v, a.v_st.s, j0, t.n, a.D);
  __syncthreads();
  return t;
}

template <int DP>
__device__ void forward_bf16(const Args& a) {
  using T = Tc<DP>;
  constexpr int B = T::B;
  __shared__ __align__(16) uint16_t ks[B * T::LR];
  __shared__ __align__(16) uint16_t vt[DP * T::LC];
  __shared__ int kis[B], slots[5];
  const Lane l = lane();
  const TcRows r = tc_rows(a, T::R);
  uint32_t qa[T::KS][4];
  load_a<DP>(qa, offset(a.q, r.h * a.q_st.h + r.b * a.q_st.b), a.q_st.s, r.r0, a.S, a.D);
  const KeyRange keys = tc_keys(a, slots, r, T::R);
  const float c = a.scale * kLog2e;
  float acc[T::DT][4], m[2] = {-INFINITY, -INFINITY}, sum[2] = {0, 0};
  zero<T::DT>(acc);
  for (int j0 = keys.lo; j0 < keys.hi; j0 += B) {
    // (no v for the log-sum-exp alone)
    const KeyTile t = stage_keys_bf16<DP>(a, keys, j0, ks, nullptr, nullptr, a.out ? vt : nullptr, kis, slots);
    if (t.n == 0) continue;
    float s[T::NT][4];
    products_over_head_dim<DP>(s, qa, ks);
    // Where the lane's rows see the whole tile (most tiles of a long causal
    // row), nothing is masked, and every score is finite.
    const bool whole = r.see_whole<B>(t);
    float mx[2] = {m[0], m[1]};
    if (whole) {
#pragma unroll
      for (int nt = 0; nt < T::NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nt][e] *= c;
          mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < T::NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int w = e >> 1, u = 8 * nt + 2 * l.t + (e & 1);
          const bool vis = r.valid[w] && u < t.n && visible(r.qi[w], kis[u], r.pos[w]);
          s[nt][e] = vis ? s[nt][e] * c : -INFINITY;
          mx[w] = fmaxf(mx[w], s[nt][e]);
        }
    }
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      mx[w] = fmaxf(mx[w], __shfl_xor_sync(0xffffffffu, mx[w], 1));
      mx[w] = fmaxf(mx[w], __shfl_xor_sync(0xffffffffu, mx[w], 2));
      // exp2(-inf - finite) = 0 drops an empty past; with nothing seen yet
      // (mx = -inf) nothing changes.
      const float alpha = mx[w] == -INFINITY ? 1.f : exp2_ftz(m[w] - mx[w]);
      sum[w] *= alpha;
      m[w] = mx[w];
#pragma unroll
      for (int dt = 0; dt < T::DT; ++dt) {
        acc[dt][2 * w] *= alpha;
        acc[dt][2 * w + 1] *= alpha;
      }
    }
    // (m is finite after a whole tile; a masked score is 0, also where m
    // is still -inf)
#pragma unroll
    for (int nt = 0; nt < T::NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = !whole && s[nt][e] == -INFINITY ? 0.f : exp2_ftz(s[nt][e] - m[e >> 1]);
        sum[e >> 1] += p;
        s[nt][e] = p;
      }
    if (a.out) accumulate_over_rows<DP>(acc, s, vt);
  }
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    sum[w] += __shfl_xor_sync(0xffffffffu, sum[w], 1);
    sum[w] += __shfl_xor_sync(0xffffffffu, sum[w], 2);
    if (!r.valid[w]) continue;
    const float inv = sum[w] > 0 ? 1.f / sum[w] : 0.f;
    if (a.out) {
      float* out = a.out + r.h * a.out_st.h + r.row(w) * a.out_st.s + r.b * a.out_st.b;
#pragma unroll
      for (int dt = 0; dt < T::DT; ++dt)
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const int d = 8 * dt + 2 * l.t + x;
          if (d < a.D) out[d] = acc[dt][2 * w + x] * inv;
        }
    }
    if (a.lse_out && l.t == 0)
      a.lse_out[r.h * a.lse_out_st.h + r.row(w) * a.lse_out_st.s + r.b * a.lse_out_st.b] =
          sum[w] > 0 ? (m[w] + log2f(sum[w])) * kLn2 : kNoKeysLse;
  }
}

// D_i = dO_i . O_i of the warp's rows w (0, 1) from the lane's elements of
// dO's A fragments (rounded) and O, summed over the row's 4 lanes.
template <int DP>
__device__ __forceinline__ void tc_dsum(float* di, const uint32_t (*da)[4], Operand o, const Args& a,
                                        const TcRows& r) {
  const Lane l = lane();
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    float x = 0;
    if (r.valid[w]) {
      const Operand orow = offset(o, r.row(w) * a.o_st.s);
#pragma unroll
      for (int k = 0; k < Tc<DP>::KS; ++k)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int d = 16 * k + 2 * l.t + 8 * h;
          const uint32_t p = da[k][w + 2 * h];
          if (d < a.D) x = fmaf(bf16_lo(p), value(orow, d), x);
          if (d + 1 < a.D) x = fmaf(bf16_hi(p), value(orow, d + 1), x);
        }
    }
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    di[w] = x;
  }
}

// dQ: dS = P (dP - D_i) scale, rounded; dQ = dS K. Grid and block as the
// forward's.
template <int DP>
__device__ void grad_q_bf16(const Args& a) {
  using T = Tc<DP>;
  constexpr int B = T::B;
  __shared__ __align__(16) uint16_t ks[B * T::LR];
  __shared__ __align__(16) uint16_t vs[B * T::LR];
  __shared__ __align__(16) uint16_t kt[DP * T::LC];
  __shared__ int kis[B], slots[5];
  const Lane l = lane();
  const TcRows r = tc_rows(a, T::R);
  uint32_t qa[T::KS][4], da[T::KS][4];
  load_a<DP>(qa, offset(a.q, r.h * a.q_st.h + r.b * a.q_st.b), a.q_st.s, r.r0, a.S, a.D);
  load_a<DP>(da, Operand{a.dO + r.h * a.dO_st.h + r.b * a.dO_st.b}, a.dO_st.s, r.r0, a.S, a.D);
  float di[2], lse2[2];
  tc_dsum<DP>(di, da, offset(a.o, r.h * a.o_st.h + r.b * a.o_st.b), a, r);
#pragma unroll
  for (int w = 0; w < 2; ++w)
    lse2[w] = r.valid[w] ? a.lse[r.h * a.lse_st.h + r.row(w) * a.lse_st.s + r.b * a.lse_st.b] * kLog2e : 0.f;
  const KeyRange keys = tc_keys(a, slots, r, T::R);
  const float c = a.scale * kLog2e;
  float dq[T::DT][4];
  zero<T::DT>(dq);
  for (int j0 = keys.lo; j0 < keys.hi; j0 += B) {
    const KeyTile t = stage_keys_bf16<DP>(a, keys, j0, ks, kt, vs, nullptr, kis, slots);
    if (t.n == 0) continue;
    float s[T::NT][4], dp[T::NT][4];
    products_over_head_dim<DP>(s, qa, ks);
    products_over_head_dim<DP>(dp, da, vs);
    probabilities_and_ds<DP>(s, dp, c, a.scale, r.see_whole<B>(t), [&](int w, int u, float* lse2_wu, float* di_wu) {
      *lse2_wu = lse2[w], *di_wu = di[w];
      return r.valid[w] && u < t.n && visible(r.qi[w], kis[u], r.pos[w]);
    });
    accumulate_over_rows<DP>(dq, dp, kt);
  }
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    if (!r.valid[w]) continue;
    float* out = a.dq + r.h * a.dq_st.h + r.row(w) * a.dq_st.s + r.b * a.dq_st.b;
    const float* sum = a.dq_in ? a.dq_in + r.h * a.dq_in_st.h + r.row(w) * a.dq_in_st.s + r.b * a.dq_in_st.b : nullptr;
#pragma unroll
    for (int dt = 0; dt < T::DT; ++dt)
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int d = 8 * dt + 2 * l.t + x;
        if (d < a.D) out[d] = sum ? sum[d] + dq[dt][2 * w + x] : dq[dt][2 * w + x];
      }
  }
}

// For the bf16 dK/dV kernel, with the whole block: D_i = dO_i . O_i of
// query tile [i0, i0 + n) of head h (dO_i as staged, rounded to bf16) into
// dis, and the queries' log-sum-exps (log2 units) into lse2s; zeros past n.
// The 128 threads split the B rows, P a row, each summing DP / P of its
// elements (the staged ones 8 at a time), so that a row costs log2(P)
// shuffles (tile_dsum, a warp a row, costs 5 each, and did the dK/dV
// kernel's tile as much work again as its products).
template <int DP>
__device__ __forceinline__ void tile_dsum_bf16(const Args& a, int h, int b, int i0, int n, const uint16_t* dos,
                                               float* dis, float* lse2s) {
  using T = Tc<DP>;
  constexpr int P = 128 / T::B, E = DP / P;
  static_assert(P * T::B == 128 && E % 8 == 0, "a row's elements are whole runs of 8 for each of its threads");
  const int x = threadIdx.x / P, first = static_cast<int>(threadIdx.x % P) * E;
  float di = 0;
  if (x < n) {
    const Operand o = offset(a.o, h * a.o_st.h + (i0 + x) * a.o_st.s + b * a.o_st.b);
    const uint16_t* row = dos + x * T::LR + first;
#pragma unroll
    for (int j8 = 0; j8 < E; j8 += 8) {
      const uint4 pairs = *reinterpret_cast<const uint4*>(row + j8);
      const uint32_t w[4] = {pairs.x, pairs.y, pairs.z, pairs.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int d = kdim(first + j8 + j);
        if (d < a.D) di = fmaf(j & 1 ? bf16_hi(w[j / 2]) : bf16_lo(w[j / 2]), value(o, d), di);
      }
    }
  }
  finish_dsum<P>(a, h, b, i0, n, x, first == 0, di, dis, lse2s);
}

// dK (into out) and dV: grid (key row blocks, kv heads from h0, batch
// rows); each warp owns 16 key rows, walking every query head of the kv
// head and every query tile that can see the block's keys. The transposed
// products: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q.
template <int DP>
__device__ void grad_kv_bf16(const Args& a) {
  using T = Tc<DP>;
  constexpr int B = T::B;
  __shared__ __align__(16) uint16_t qs[B * T::LR];
  __shared__ __align__(16) uint16_t dos[B * T::LR];
  __shared__ __align__(16) uint16_t qt[DP * T::LC];
  __shared__ __align__(16) uint16_t dot[DP * T::LC];
  __shared__ float lse2s[B], dis[B];
  __shared__ int poss[B], qis[B], slots[4], k_slots[2];
  const Lane l = lane();
  const int kvh = a.h0 + blockIdx.y, b = blockIdx.z, grp = a.H / a.KV;
  const int r0 = blockIdx.x * T::R + (threadIdx.x >> 5) * 16;
  int j[2], kj[2], lo = INT_MAX, hi = INT_MIN;
  bool valid[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    j[w] = r0 + l.g + 8 * w, valid[w] = j[w] < a.S;
    kj[w] = valid[w] ? token_index(a.kidx, a.kidx_s, a.kidx_b, j[w], b) : 0;
    if (valid[w]) lo = min(lo, kj[w]), hi = max(hi, kj[w]);
  }
  const int kmin = block_min(&k_slots[0], lo != INT_MAX, lo), kmax = block_max(&k_slots[1], hi != INT_MIN, hi);
  uint32_t ka[T::KS][4], va[T::KS][4];
  load_a<DP>(ka, offset(a.k, kvh * a.k_st.h + b * a.k_st.b), a.k_st.s, r0, a.S, a.D);
  load_a<DP>(va, offset(a.v, kvh * a.v_st.h + b * a.v_st.b), a.v_st.s, r0, a.S, a.D);
  const float c = a.scale * kLog2e;
  float dk[T::DT][4], dv[T::DT][4];
  zero<T::DT>(dk);
  zero<T::DT>(dv);
  for (int hw = 0; hw < grp; ++hw) {
    const int h = kvh * grp + hw;
    const Operand qh = offset(a.q, h * a.q_st.h + b * a.q_st.b);
    const Operand dOh{a.dO + h * a.dO_st.h + b * a.dO_st.b};  // (f32: a gradient)
    for (int i0 = a.qidx ? 0 : static_cast<int>(blockIdx.x) * T::R; i0 < a.S; i0 += B) {
      const int n = min(B, a.S - i0);
      const QueryTile tile = query_tile_sees<B>(a, b, i0, n, kmin, kmax, poss, qis, slots);
      if (!tile.sees) continue;
      // Whether every query of a full tile sees both the lane's keys.
      const bool whole = n == B && valid[0] && valid[1] && tile.start_max <= min(kj[0], kj[1]) &&
                         max(kj[0], kj[1]) <= tile.qi_min;
      stage_bf16<DP>(qs, qt, qh, a.q_st.s, i0, n, a.D);
      stage_bf16<DP>(dos, dot, dOh, a.dO_st.s, i0, n, a.D);
      __syncthreads();
      tile_dsum_bf16<DP>(a, h, b, i0, n, dos, dis, lse2s);
      float s[T::NT][4], dp[T::NT][4];
      products_over_head_dim<DP>(s, ka, qs);
      products_over_head_dim<DP>(dp, va, dos);
      probabilities_and_ds<DP>(s, dp, c, a.scale, whole, [&](int w, int u, float* lse2_wu, float* di_wu) {
        *lse2_wu = lse2s[u], *di_wu = dis[u];
        return valid[w] && u < n && visible(qis[u], kj[w], poss[u]);
      });
      accumulate_over_rows<DP>(dv, s, dot);
      accumulate_over_rows<DP>(dk, dp, qt);
    }
  }
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    if (!valid[w]) continue;
    float* ok = a.out + kvh * a.out_st.h + j[w] * a.out_st.s + b * a.out_st.b;
    float* ov = a.dv + kvh * a.dv_st.h + j[w] * a.dv_st.s + b * a.dv_st.b;
#pragma unroll
    for (int dt = 0; dt < T::DT; ++dt)
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int d = 8 * dt + 2 * l.t + x;
        if (d < a.D) ok[d] = dk[dt][2 * w + x], ov[d] = dv[dt][2 * w + x];
      }
  }
}

}  // namespace

// The entry points the launcher looks up by name, one per padded head_dim.
#define HALYARD_ATTENTION_KERNELS(D)                                                                   \
  extern "C" __global__ void __launch_bounds__(Shape<D>::R * Shape<D>::T)                             \
      halyard_attention_fwd_##D(Args a) { forward<D>(a); }                                            \
  extern "C" __global__ void __launch_bounds__(Shape<D>::R * Shape<D>::T)                             \
      halyard_attention_dq_##D(Args a) { grad_q<D>(a); }                                              \
  extern "C" __global__ void __launch_bounds__(Shape<D>::R * Shape<D>::T)                             \
      halyard_attention_dkdv_##D(Args a) { grad_kv<D>(a); }
HALYARD_ATTENTION_KERNELS(8)
HALYARD_ATTENTION_KERNELS(16)
HALYARD_ATTENTION_KERNELS(32)
HALYARD_ATTENTION_KERNELS(64)
HALYARD_ATTENTION_KERNELS(128)

// The bf16 ones (4 warps a block), one per tensor-core head_dim; the
// forward's launch bounds given (FWD_BOUNDS).
#define HALYARD_ATTENTION_BF16_KERNELS(D, FWD_BOUNDS)                                                          \
  extern "C" __global__ void __launch_bounds__ FWD_BOUNDS halyard_attention_fwd_bf16_##D(Args a) {              \
    forward_bf16<D>(a);                                                                                         \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(128) halyard_attention_dq_bf16_##D(Args a) { grad_q_bf16<D>(a); } \
  extern "C" __global__ void __launch_bounds__(128) halyard_attention_dkdv_bf16_##D(Args a) { grad_kv_bf16<D>(a); }
HALYARD_ATTENTION_BF16_KERNELS(16, (128))
HALYARD_ATTENTION_BF16_KERNELS(32, (128))
// (At head_dim 64 ptxas gives the forward 139 registers, 3 blocks an SM;
// asked for 4, it fits 128 without a spill, as before tiles went unmasked.
// At 32 and 16 the same ask spills; sm_90.)
HALYARD_ATTENTION_BF16_KERNELS(64, (128, 4))
HALYARD_ATTENTION_BF16_KERNELS(128, (128))
