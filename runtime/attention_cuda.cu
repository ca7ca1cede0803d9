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
#include <climits>

#include "runtime/attention_cuda_args.h"

using halyard::runtime::attention_cuda::Args;

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
__device__ __forceinline__ void load_slice(const float* row, int n, int t, float* x) {
#pragma unroll
  for (int c = 0; c < Shape<D>::C; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[4 * c + e] = elem<D>(t, c) + e < n ? row[elem<D>(t, c) + e] : 0.f;
}

template <int D>
__device__ __forceinline__ void store_slice(float* row, int n, int t, const float* x, float scale) {
#pragma unroll
  for (int c = 0; c < Shape<D>::C; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (elem<D>(t, c) + e < n) row[elem<D>(t, c) + e] = x[4 * c + e] * scale;
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

// Rows [r0, r0 + n) of a [seq, hd] slab (row stride ld) into tile[B][D];
// zeros past n rows and past hd elements.
template <int D>
__device__ __forceinline__ void stage(float* tile, const float* src, int64_t ld, int r0, int n, int hd) {
  for (int x = threadIdx.x; x < Shape<D>::B * D; x += blockDim.x) {
    const int r = x / D, d = x % D;
    tile[x] = r < n && d < hd ? src[static_cast<int64_t>(r0 + r) * ld + d] : 0.f;
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

// A query row's thread in a grid of (row blocks, heads from h0, batch rows):
// its lane t of the row's T, row i of head h of batch row b, the kv head,
// and the row's position (-1 past the rows).
struct QueryRow {
  int t, i, h, b, kvh, pos;
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
  return r;
}

// The keys a block of query rows sees, walked in tiles of B: from the least
// document start of its rows (block_min) to its last row.
struct KeyRange {
  int lo, hi;
  const float *k, *v;  // the kv head's rows of the batch row
};

template <int D>
__device__ __forceinline__ KeyRange key_range(const Args& a, int* slot, const QueryRow& r) {
  const int lo = block_min(slot, r.valid && r.t == 0, r.i - r.pos < 0 ? 0 : r.i - r.pos);
  return {lo, min(a.S, static_cast<int>(blockIdx.x + 1) * Shape<D>::R), a.k + r.kvh * a.k_st.h + r.b * a.k_st.b,
          a.v + r.kvh * a.v_st.h + r.b * a.v_st.b};
}

// Keys [j0, j0 + n) and their values into ks and vs, for the whole block;
// returns n.
template <int D>
__device__ __forceinline__ int stage_keys(const Args& a, const KeyRange& kr, int j0, float* ks, float* vs) {
  const int n = min(Shape<D>::B, kr.hi - j0);
  __syncthreads();
  stage<D>(ks, kr.k, a.k_st.s, j0, n, a.D);
  stage<D>(vs, kr.v, a.v_st.s, j0, n, a.D);
  __syncthreads();
  return n;
}

// grid (row blocks, heads from h0, batch rows); block R * T threads.
template <int D>
__device__ void forward(const Args& a) {
  using S_ = Shape<D>;
  constexpr int T = S_::T, B = S_::B, KC = 8;
  __shared__ __align__(16) float ks[B * D];
  __shared__ __align__(16) float vs[B * D];
  __shared__ int lo_slot;
  const QueryRow row = query_row<D>(a);
  const auto [t, i, h, b, kvh, pi, valid] = row;
  const float c = a.scale * kLog2e;  // scores in log2 units: exp2 instead of exp
  float q[4 * S_::C], acc[4 * S_::C];
  if (valid) load_slice<D>(a.q + h * a.q_st.h + i * a.q_st.s + b * a.q_st.b, a.D, t, q);
#pragma unroll
  for (int x = 0; x < 4 * S_::C; ++x) {
    if (!valid) q[x] = 0;
    acc[x] = 0;
  }
  const KeyRange kr = key_range<D>(a, &lo_slot, row);
  float m = -INFINITY, l = 0;
  for (int j0 = kr.lo; j0 < kr.hi; j0 += B) {
    const int n = stage_keys<D>(a, kr, j0, ks, vs);
    for (int u0 = 0; u0 < n; u0 += KC) {
      float s[KC];
      float mx = m;
#pragma unroll
      for (int u = 0; u < KC; ++u) {
        const float dot = lanes_sum<T>(dot_shared<D>(ks + (u0 + u) * D, q, t));
        const int j = j0 + u0 + u;
        const bool vis = valid && u0 + u < n && j <= i && i - j <= pi;
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
        add_shared<D>(vs + (u0 + u) * D, p, acc, t);
      }
      m = mx;
    }
  }
  if (!valid) return;
  const float inv = l > 0 ? 1.f / l : 0.f;
  store_slice<D>(a.out + h * a.out_st.h + i * a.out_st.s + b * a.out_st.b, a.D, t, acc, inv);
  if (a.lse_out && t == 0)
    a.lse_out[h * a.lse_out_st.h + i * a.lse_out_st.s + b * a.lse_out_st.b] = l > 0 ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// dQ: grid and block as the forward's. dS = P (dP - rowsum(dO * O)), dQ = scale dS K.
template <int D>
__device__ void grad_q(const Args& a) {
  using S_ = Shape<D>;
  constexpr int T = S_::T, B = S_::B;
  __shared__ __align__(16) float ks[B * D];
  __shared__ __align__(16) float vs[B * D];
  __shared__ int lo_slot;
  const QueryRow row = query_row<D>(a);
  const auto [t, i, h, b, kvh, pi, valid] = row;
  const float c = a.scale * kLog2e;
  float q[4 * S_::C], dO[4 * S_::C], dq[4 * S_::C];
  float di = 0, lse2 = 0;
  if (valid) {
    load_slice<D>(a.q + h * a.q_st.h + i * a.q_st.s + b * a.q_st.b, a.D, t, q);
    load_slice<D>(a.dO + h * a.dO_st.h + i * a.dO_st.s + b * a.dO_st.b, a.D, t, dO);
    float o[4 * S_::C];
    load_slice<D>(a.o + h * a.o_st.h + i * a.o_st.s + b * a.o_st.b, a.D, t, o);
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
  const KeyRange kr = key_range<D>(a, &lo_slot, row);
  for (int j0 = kr.lo; j0 < kr.hi; j0 += B) {
    const int n = stage_keys<D>(a, kr, j0, ks, vs);
    for (int u = 0; u < n; ++u) {
      const float s = lanes_sum<T>(dot_shared<D>(ks + u * D, q, t));
      const float dp = lanes_sum<T>(dot_shared<D>(vs + u * D, dO, t));
      const int j = j0 + u;
      const bool vis = valid && j <= i && i - j <= pi;
      const float p = vis ? exp2f(s * c - lse2) : 0.f;
      add_shared<D>(ks + u * D, p * (dp - di), dq, t);
    }
  }
  if (!valid) return;
  store_slice<D>(a.dq + h * a.dq_st.h + i * a.dq_st.s + b * a.dq_st.b, a.D, t, dq, a.scale);
}

// dK (into out) and dV: grid (key row blocks, kv heads from h0, batch rows);
// block R * T threads, one key row each, walking every query head of the kv
// head and every query tile that can see the block's keys.
template <int D>
__device__ void grad_kv(const Args& a) {
  using S_ = Shape<D>;
  constexpr int T = S_::T, R = S_::R, B = S_::B;
  __shared__ __align__(16) float qs[B * D];
  __shared__ __align__(16) float ds_[B * D];  // dO rows
  __shared__ float lse2s[B], dis[B];
  __shared__ int poss[B];
  __shared__ int lo_slot;
  const int t = threadIdx.x % T, j = blockIdx.x * R + threadIdx.x / T;
  const int g = a.h0 + blockIdx.y, b = blockIdx.z, grp = a.H / a.KV;
  const bool valid = j < a.S;
  const float c = a.scale * kLog2e;
  float k[4 * S_::C], v[4 * S_::C], dk[4 * S_::C], dv[4 * S_::C];
  if (valid) {
    load_slice<D>(a.k + g * a.k_st.h + j * a.k_st.s + b * a.k_st.b, a.D, t, k);
    load_slice<D>(a.v + g * a.v_st.h + j * a.v_st.s + b * a.v_st.b, a.D, t, v);
  }
#pragma unroll
  for (int x = 0; x < 4 * S_::C; ++x) {
    if (!valid) k[x] = v[x] = 0;
    dk[x] = dv[x] = 0;
  }
  const int j_first = blockIdx.x * R, j_last = min(a.S, j_first + R) - 1;
  for (int w = 0; w < grp; ++w) {
    const int h = g * grp + w;
    for (int i0 = j_first; i0 < a.S; i0 += B) {
      const int n = min(B, a.S - i0);
      __syncthreads();
      if (threadIdx.x == 0) lo_slot = INT_MAX;
      __syncthreads();
      for (int x = threadIdx.x; x < B; x += blockDim.x) {
        const int i = i0 + x;
        const int p = x < n ? a.pos[i * a.pos_s + b * a.pos_b] : -1;
        poss[x] = p;
        if (x < n) atomicMin(&lo_slot, i - p);
      }
      __syncthreads();
      if (lo_slot > j_last) continue;  // no query of the tile sees a key of the block
      stage<D>(qs, a.q + h * a.q_st.h + b * a.q_st.b, a.q_st.s, i0, n, a.D);
      stage<D>(ds_, a.dO + h * a.dO_st.h + b * a.dO_st.b, a.dO_st.s, i0, n, a.D);
      __syncthreads();
      for (int x = threadIdx.x; x < B; x += blockDim.x) {
        float di = 0, l2 = 0;
        if (x < n) {
          const int i = i0 + x;
          const float* o = a.o + h * a.o_st.h + i * a.o_st.s + b * a.o_st.b;
          for (int d = 0; d < a.D; ++d) di = fmaf(ds_[x * D + d], o[d], di);
          l2 = a.lse[h * a.lse_st.h + i * a.lse_st.s + b * a.lse_st.b] * kLog2e;
        }
        dis[x] = di;
        lse2s[x] = l2;
      }
      __syncthreads();
      for (int u = 0; u < n; ++u) {
        const float s = lanes_sum<T>(dot_shared<D>(qs + u * D, k, t));
        const float dp = lanes_sum<T>(dot_shared<D>(ds_ + u * D, v, t));
        const int i = i0 + u;
        const bool vis = valid && j <= i && i - j <= poss[u];
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
