// Causal grouped-query attention on the CPU, FlashAttention-2's way: the
// forward keeps a query block's running max, sum and output while it walks
// the key blocks; the backward walks the key blocks once, and for each one
// the query blocks that see it, producing dK and dV in a block-sized
// accumulator and adding into dQ (5 products per tile instead of the 7 of
// separate dQ and dK/dV kernels). Memory is O(S): nothing of [S, S] exists.
//
// This file is compiled once per vector ISA (cpu_kernels_avx512.cpp,
// _avx2.cpp, _base.cpp) inside namespace HALYARD_ISA; cpu_kernels.cpp picks
// one at run time from the CPU's features. Vectors are GCC vector types of
// the ISA's native width (cpu_vector.h), and the register tiles come from
// the ISA's register count.
//
// Visibility is the DSL's (dsl/ops.h): key j is visible to query i when
// 0 <= i - j <= pos[i], causal within each document of a packed row; in a
// ring's key block, with i and j the tokens' indices in the whole row
// (KeyRows::qidx, kidx).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "runtime/attention_cpu.h"
#include "runtime/bf16.h"
#include "runtime/cpu_vector.h"
#include "runtime/scratch.h"

#ifndef HALYARD_ISA
#error "define HALYARD_ISA (the namespace of this compilation) before including attention_cpu_impl.h"
#endif

namespace halyard::runtime::attention_cpu::HALYARD_ISA {
namespace {

using namespace cpu_vector::HALYARD_ISA;
using v16 = vf;
using i16 = vi;
using u16 = vu;

// The register tiles (rows x vectors of accumulators, 12 to 16 registers'
// worth) for this ISA's register file.
#if defined(__AVX512F__)
constexpr int kNtRows = 8, kNtVecs = 2;  // scores: 16 of 32 zmm
constexpr int kNnRows = 6, kNnVecs = 2;  // products along head_dim: 12 zmm
#else
constexpr int kNtRows = 6, kNtVecs = 2;  // 12 of 16 ymm (or xmm)
constexpr int kNnRows = 6, kNnVecs = 2;
#endif

inline __attribute__((always_inline)) float hmax(v16 v) {
  float m = v[0];
  for (int k = 1; k < W; ++k) m = std::max(m, v[k]);
  return m;
}
// A row's sum in one order on every ISA (so that results are bitwise the
// same on an AVX2 and an AVX-512 machine): 16 lanes, lane l summing the
// elements l, l + 16, ... of every key block, rescaled with the row's max;
// the lanes added in order once, at the end of the row. On narrower ISAs
// the 16 lanes are 16 / W vectors. (Adding the lanes once per key block, a
// chain of 16 dependent scalar adds per row and block, cost about a third
// of the forward's softmax.)
constexpr int kSumLanes = 16, kSumParts = kSumLanes / W;
struct RowSum {
  v16 part[kSumParts];
  float total() const {
    float lanes[kSumLanes];
    std::memcpy(lanes, part, sizeof lanes);
    float s = 0;
    for (float x : lanes) s += x;
    return s;
  }
};

// 2^x for x <= 0 (larger inputs are clamped to 126, smaller to -126): the
// integer part goes into the exponent, 2^r on [-1/2, 1/2] is a degree-6
// polynomial (relative error below 2e-7).
inline __attribute__((always_inline)) v16 exp2v(v16 x) {
  x = x < -126.0f ? splat(-126.0f) : x;
  x = x > 126.0f ? splat(126.0f) : x;
  const v16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const v16 t = x + magic;
  const v16 r = x - (t - magic);
  v16 p = splat(1.5403530393e-4f);
  p = p * r + 1.3333558146e-3f;
  p = p * r + 9.6181291076e-3f;
  p = p * r + 5.5504108665e-2f;
  p = p * r + 2.4022650696e-1f;
  p = p * r + 6.9314718056e-1f;
  p = p * r + 1.0f;
  i16 n, bits;
  std::memcpy(&n, &t, sizeof n);
  std::memcpy(&bits, &p, sizeof bits);
  bits += (n - 0x4B400000) << 23;
  v16 out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// x rounded to bf16 (nearest, ties to even; x finite), as an f32.
inline __attribute__((always_inline)) v16 round_bf16(v16 x) {
  u16 u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// C[r][c] = sum_k A[r*lda + k] * B[k*ldb + c] for r < R, c < NV * W:
// the columns vectorized, A broadcast.
template <int R, int NV>
inline __attribute__((always_inline)) void nt_tile(const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                                                   int64_t ldc, int K) {
  nn_tile<R, NV, false>(A, lda, 1, B, ldb, C, ldc, K);
}

// The last rows of a block in one tile of as many rows (one row at a time
// would leave too few independent sums to hide the FMA latency).
template <int NV, int R = 1>
inline __attribute__((always_inline)) void nt_rest(int n, const float* A, int64_t lda, const float* B, int64_t ldb,
                                                   float* C, int64_t ldc, int K) {
  if constexpr (R < kNtRows) {
    if (n == R) return nt_tile<R, NV>(A, lda, B, ldb, C, ldc, K);
    nt_rest<NV, R + 1>(n, A, lda, B, ldb, C, ldc, K);
  }
}

void gemm_nt(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int rows, int cols, int K) {
  for (int c0 = 0; c0 < cols; c0 += kNtVecs * W) {
    int r0 = 0;
    if (c0 + kNtVecs * W <= cols) {
      for (; r0 + kNtRows <= rows; r0 += kNtRows) nt_tile<kNtRows, kNtVecs>(A + r0 * lda, lda, B + c0, ldb, C + r0 * ldc + c0, ldc, K);
      if (r0 < rows) nt_rest<kNtVecs>(rows - r0, A + r0 * lda, lda, B + c0, ldb, C + r0 * ldc + c0, ldc, K);
    } else {
      for (int c = c0; c < cols; c += W)
        for (r0 = 0; r0 < rows; ++r0) nt_tile<1, 1>(A + r0 * lda, lda, B + c, ldb, C + r0 * ldc + c, ldc, K);
    }
  }
}

// (nn_tile, C[r][:] += P.X over a register tile, is cpu_vector.h's.)
template <int NV, int R = 1>
inline __attribute__((always_inline)) void nn_rest(int n, const float* P, int64_t prs, int64_t pcs, const float* X,
                                                   int64_t ldx, float* C, int64_t ldc, int inner) {
  if constexpr (R < kNnRows) {
    if (n == R) return nn_tile<R, NV>(P, prs, pcs, X, ldx, C, ldc, inner);
    nn_rest<NV, R + 1>(n, P, prs, pcs, X, ldx, C, ldc, inner);
  }
}

void gemm_nn_acc(const float* P, int64_t prs, int64_t pcs, const float* X, int64_t ldx, float* C, int64_t ldc, int rows,
                 int inner, int Dp) {
  for (int d0 = 0; d0 < Dp; d0 += kNnVecs * W) {
    if (d0 + kNnVecs * W <= Dp) {
      int r0 = 0;
      for (; r0 + kNnRows <= rows; r0 += kNnRows)
        nn_tile<kNnRows, kNnVecs>(P + r0 * prs, prs, pcs, X + d0, ldx, C + r0 * ldc + d0, ldc, inner);
      if (r0 < rows) nn_rest<kNnVecs>(rows - r0, P + r0 * prs, prs, pcs, X + d0, ldx, C + r0 * ldc + d0, ldc, inner);
    } else {
      for (int d = d0; d < Dp; d += W)
        for (int r0 = 0; r0 < rows; ++r0) nn_tile<1, 1>(P + r0 * prs, prs, pcs, X + d, ldx, C + r0 * ldc + d, ldc, inner);
    }
  }
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Blocks (0: the default; the entry points choose the query block from the
// L2, cpu_kernels.cpp). Measured with the kernels alone (8/2 heads, d 32,
// two threads): AMD EPYC Zen 3, AVX2, seq 4096: 128 queries x 64 keys 350
// ms, 64 x 64 452 ms, 96 x 96 463 ms; Intel Xeon (Sapphire Rapids class),
// AVX-512, seq 16384: 128 x 64 3.5-4.2 s, 128 x 128 3.2 s, 256 x 128 2.4-3.0 s,
// 256 x 256 3.1 s, 512 x 128 3.0 s (at 4096 all within noise, 0.16-0.17 s):
// a longer key block spreads each row's max, sum and rescale over more
// keys, a taller query block halves the backward's passes over the packed
// k and v and over dK and dV. Key blocks are a whole number of the widest
// ISA's score tiles (32 keys), so that every ISA (and every L2) sums in the
// same blocks; the query block does not change any sum's order.
inline int query_block(int requested) { return requested > 0 ? requested : 128; }
inline int key_block(int requested) { return static_cast<int>(round_up(requested > 0 ? requested : 128, 32)); }
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// Masks one block row: s[c] for key j0 + c stays where visible, else -inf.
// i is the query's index; kidx (padded past the keys with INT32_MAX, never
// visible) the keys', or null for their seq index.
inline void mask_row(float* s, int Bc, int64_t i, int64_t j0, int32_t pos, const int32_t* kidx) {
  i16 iota;
  for (int k = 0; k < W; ++k) iota[k] = k;
  const v16 ninf = splat(-INFINITY);
  for (int c = 0; c < Bc; c += W) {
    i16 dist;  // i - j
    if (kidx) {
      std::memcpy(&dist, kidx + j0 + c, sizeof dist);
      dist = static_cast<int32_t>(i) - dist;
    } else {
      dist = static_cast<int32_t>(i - j0 - c) - iota;
    }
    const u16 ud = reinterpret_cast<const u16&>(dist);
    const auto vis = ud <= static_cast<uint32_t>(pos);
    store(s + c, vis ? load(s + c) : ninf);
  }
}

// Per query block, over its real rows: the least and greatest first key
// each sees (its document's start, index - pos) and last key (its own
// index); per key block, the least and greatest index of its real keys. A
// key block outside every row's range is skipped, and one inside every
// row's range needs no mask. For one rank's row (no token indices) that is
// the key blocks from the block's earliest document start up to its last
// query; for a ring's block, also none at all where no query sees a key.
struct BlockBounds {
  int64_t lo_min, lo_max, hi_min, hi_max;
};
std::vector<BlockBounds> block_bounds(const KeyRows& a, int Br) {
  std::vector<BlockBounds> out;
  for (int64_t i0 = 0; i0 < a.S; i0 += Br) {
    BlockBounds b{INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN};
    for (int64_t i = i0; i < std::min<int64_t>(a.S, i0 + Br); ++i) {
      const int64_t hi = a.query_index(i), lo = std::max<int64_t>(0, hi - a.pos[i]);
      b.lo_min = std::min(b.lo_min, lo);
      b.lo_max = std::max(b.lo_max, lo);
      b.hi_min = std::min(b.hi_min, hi);
      b.hi_max = std::max(b.hi_max, hi);
    }
    out.push_back(b);
  }
  return out;
}
struct KeySpan {
  int64_t min = INT64_MAX, max = INT64_MIN;  // (none: no real key)
  bool whole = false;  // every key of the block is real
};
std::vector<KeySpan> key_spans(const KeyRows& a, int Bc) {
  std::vector<KeySpan> out(static_cast<size_t>((a.S + Bc - 1) / Bc));
  for (int64_t j0 = 0; j0 < a.S; j0 += Bc) {
    KeySpan& k = out[static_cast<size_t>(j0 / Bc)];
    const int64_t j1 = std::min<int64_t>(a.S, j0 + Bc);
    k.whole = j1 == j0 + Bc;
    if (!a.kidx) {
      k.min = j0, k.max = j1 - 1;
      continue;
    }
    for (int64_t j = j0; j < j1; ++j) k.min = std::min<int64_t>(k.min, a.kidx[j]), k.max = std::max<int64_t>(k.max, a.kidx[j]);
  }
  return out;
}
inline bool sees_none(const BlockBounds& b, const KeySpan& k) { return k.max < b.lo_min || k.min > b.hi_max; }
inline bool sees_all(const BlockBounds& b, const KeySpan& k) { return k.whole && b.lo_max <= k.min && k.max <= b.hi_min; }

// A ring block's key indices padded to Sp with a key no query sees (null
// without indices).
const int32_t* padded_key_index(const KeyRows& a, int64_t Sp, scratch::Array<int32_t>& pad) {
  if (!a.kidx) return nullptr;
  std::memcpy(pad.data(), a.kidx, sizeof(int32_t) * static_cast<size_t>(a.S));
  std::fill(pad.data() + a.S, pad.data() + Sp, INT32_MAX);
  return pad.data();
}

// The forward's online softmax over one key block of scores s[rows][Bc]
// (in place: the block's probabilities, unnormalized): each row's max m
// (log2 units) and lane sums l move on, the output rows o rescale with them.
// Masked: the block has masked (-inf) scores, whose probabilities are 0
// (exp2v would give 2^-126); in a block without, nothing is compared.
// Bf16: the probabilities are left rounded to bf16 for P V (the sums are
// the f32 ones).
template <bool Masked, bool Bf16>
void softmax_rows(float* s, int Bc, int rows, float c, float* m, RowSum* l, float* o, int Dp) {
  const v16 cv = splat(c);
  for (int r = 0; r < rows; ++r) {
    float* sr = s + static_cast<int64_t>(r) * Bc;
    v16 mx = load(sr);
    for (int cc = W; cc < Bc; cc += W) {
      const v16 x = load(sr + cc);
      mx = mx > x ? mx : x;
    }
    const float bmax = hmax(mx);
    if (Masked && bmax == -INFINITY) {  // this row sees no key of the block
      std::fill(sr, sr + Bc, 0.0f);
      continue;
    }
    const float mnew = std::max(m[r], bmax * c);
    const float alpha = m[r] == -INFINITY ? 0.0f : std::exp2(m[r] - mnew);
    m[r] = mnew;
    const v16 mv = splat(mnew), av = splat(alpha);
    RowSum& sum = l[r];
#pragma GCC unroll 4
    for (int p = 0; p < kSumParts; ++p) sum.part[p] *= av;
    for (int cc = 0; cc < Bc; cc += kSumLanes) {
#pragma GCC unroll 4
      for (int p = 0; p < kSumParts; ++p) {
        const v16 x = load(sr + cc + p * W);
        v16 e = exp2v(x * cv - mv);
        if constexpr (Masked) e = x == -INFINITY ? v16{} : e;
        sum.part[p] += e;
        store(sr + cc + p * W, Bf16 ? round_bf16(e) : e);
      }
    }
    if (o && alpha != 1.0f) {
      float* orow = o + static_cast<int64_t>(r) * Dp;
      for (int d = 0; d < Dp; d += W) store(orow + d, load(orow + d) * av);
    }
  }
}

// The backward's scores s[rows][Bc] made into probabilities P (in place,
// from each row's lse2, log2 units) and dP[rows][Bc] = dO V^T into dS =
// P (dP - D_i) scale. Masked as in softmax_rows; Bf16: P and dS are left
// rounded to bf16 for their products (dS from the f32 P).
template <bool Masked, bool Bf16>
void probabilities_and_ds(float* p, float* ds, int Bc, int rows, float c, float scale, const float* lse2, const float* dsum) {
  const v16 cv = splat(c), sc = splat(scale);
  for (int r = 0; r < rows; ++r) {
    float* pr = p + static_cast<int64_t>(r) * Bc;
    float* dr = ds + static_cast<int64_t>(r) * Bc;
    const v16 lv = splat(lse2[r]), dv0 = splat(dsum[r]);
    for (int cc = 0; cc < Bc; cc += W) {
      const v16 x = load(pr + cc);
      v16 e = exp2v(x * cv - lv);
      if constexpr (Masked) e = x == -INFINITY ? v16{} : e;
      const v16 ds = e * (load(dr + cc) - dv0) * sc;
      store(pr + cc, Bf16 ? round_bf16(e) : e);
      store(dr + cc, Bf16 ? round_bf16(ds) : ds);
    }
  }
}

inline float rounded(float x, bool bf16) { return bf16 ? bf16_value(bf16_bits(x)) : x; }

// Packs rows [r0, r0 + rows) of a [S, D] operand (row stride ld) into
// dst[rows_pad][Dp], zeros past the rows and past D; rounded to bf16 when
// bf16 (a bf16 operand is so already).
void pack_rows(Elems src, int64_t ld, int64_t S, int64_t r0, int rows_pad, int D, int Dp, float* dst, bool bf16) {
  for (int r = 0; r < rows_pad; ++r) {
    float* d = dst + static_cast<int64_t>(r) * Dp;
    if (r0 + r < S) {
      const Elems row = src + (r0 + r) * ld;
      if (!src.bits16) {
        std::memcpy(d, row.p, sizeof(float) * static_cast<size_t>(D));
        if (bf16)
          for (int x = 0; x < D; ++x) d[x] = rounded(d[x], true);
      } else {
        for (int x = 0; x < D; ++x) d[x] = row[x];
      }
      std::fill(d + D, d + Dp, 0.0f);
    } else {
      std::fill(d, d + Dp, 0.0f);
    }
  }
}
// The transpose in blocks of Bc keys, each block [D][Bc] contiguous:
// dst[(j / Bc) * D * Bc + d * Bc + j % Bc] = src[j * ld + d], zeros past S.
// (One [D][S] transpose would put a block's D rows a power of two apart, on
// the same few L1 sets: 4x slower at seq 4096.)
void pack_transposed(Elems src, int64_t ld, int64_t S, int64_t Sp, int D, int Bc, float* dst, bool bf16) {
  std::fill(dst, dst + static_cast<int64_t>(D) * Sp, 0.0f);
  for (int64_t j = 0; j < S; ++j) {
    float* blk = dst + j / Bc * D * Bc + j % Bc;
    if (src.bits16) {
      for (int d = 0; d < D; ++d) blk[d * Bc] = src[j * ld + d];
    } else {
      const float* row = static_cast<const float*>(src.p) + j * ld;
      for (int d = 0; d < D; ++d) blk[d * Bc] = rounded(row[d], bf16);
    }
  }
}

}  // namespace

// With out null, the log-sum-exp alone: the same scores, max and sums in the
// same blocks and order, so the same bits as beside an output, without
// P V (half the FLOPs) and without reading v.
void forward_head(const Head& a, float* out, int64_t out_ld, float* lse, int64_t lse_ld) {
  const int64_t S = a.S;
  const int D = a.D, Dp = static_cast<int>(round_up(D, W)), Br = query_block(a.query_block), Bc = key_block(a.key_block);
  const int64_t Sp = round_up(S, Bc);  // k and v (and dK, dV) padded to whole key blocks
  const size_t Vp = out ? static_cast<size_t>(Dp) : 0;  // the statistics alone need neither v nor an output block
  scratch::Array<float> kT(static_cast<size_t>(D * Sp)), v(static_cast<size_t>(Sp) * Vp), q(static_cast<size_t>(Br * Dp)),
      o(static_cast<size_t>(Br) * Vp), s(static_cast<size_t>(Br * Bc)), m(static_cast<size_t>(Br));
  scratch::Array<RowSum> l(static_cast<size_t>(Br));
  scratch::Array<int32_t> kpad(a.kidx ? static_cast<size_t>(Sp) : 0);
  const int32_t* kidx = padded_key_index(a, Sp, kpad);
  pack_transposed(a.k, a.k_ld, S, Sp, D, Bc, kT.data(), a.bf16);
  if (out) pack_rows(a.v, a.v_ld, S, 0, static_cast<int>(Sp), D, Dp, v.data(), a.bf16);
  const float c = a.scale * kLog2e;  // scores in log2 units: exp2 instead of exp
  const auto bounds = block_bounds(a, Br);
  const auto spans = key_spans(a, Bc);
  for (int64_t i0 = 0; i0 < S; i0 += Br) {
    const int rows = static_cast<int>(std::min<int64_t>(Br, S - i0));
    const BlockBounds bb = bounds[static_cast<size_t>(i0 / Br)];
    pack_rows(a.q, a.q_ld, S, i0, Br, D, Dp, q.data(), a.bf16);
    std::fill(o.begin(), o.end(), 0.0f);
    std::fill(m.begin(), m.end(), -INFINITY);
    std::fill(l.begin(), l.end(), RowSum{});
    for (int64_t j0 = 0; j0 < S; j0 += Bc) {
      const KeySpan& ks = spans[static_cast<size_t>(j0 / Bc)];
      if (sees_none(bb, ks)) continue;
      gemm_nt(q.data(), Dp, kT.data() + j0 * D, Bc, s.data(), Bc, rows, Bc, D);
      const bool full = sees_all(bb, ks);
      if (!full)
        for (int r = 0; r < rows; ++r)
          mask_row(s.data() + static_cast<int64_t>(r) * Bc, Bc, a.query_index(i0 + r), j0, a.pos[i0 + r], kidx);
      (full ? (a.bf16 ? softmax_rows<false, true> : softmax_rows<false, false>)
            : (a.bf16 ? softmax_rows<true, true> : softmax_rows<true, false>))(s.data(), Bc, rows, c, m.data(), l.data(),
                                                                                out ? o.data() : nullptr, Dp);
      if (out) gemm_nn_acc(s.data(), Bc, 1, v.data() + j0 * Dp, Dp, o.data(), Dp, rows, Bc, Dp);
    }
    for (int r = 0; r < rows; ++r) {
      const float sum = l[static_cast<size_t>(r)].total(), inv = sum > 0 ? 1.0f / sum : 0.0f;  // (0: a ring block after the query)
      if (out) {
        float* dst = out + (i0 + r) * out_ld;
        for (int d = 0; d < D; ++d) dst[d] = o[static_cast<size_t>(r * Dp + d)] * inv;
      }
      lse[(i0 + r) * lse_ld] = sum > 0 ? (m[static_cast<size_t>(r)] + std::log2(sum)) * kLn2 : kNoKeysLse;
    }
  }
}

// Per head of the group, per query block (its q and dO packed, its dQ in a
// block accumulator), the key blocks it sees: dK and dV sum over the
// group's heads and the queries in [S][Dp] accumulators (the outputs
// themselves when head_dim is a whole number of vectors). Scratch: k and v
// packed three ways, S x Dp floats each. With dq_in, each row of dQ is
// dq_in's plus the group's (dq_in may be dq itself: each row is read just
// before it is written).
void backward_group(const Group& a, const float* const* dq_in, int64_t dq_in_ld, float* const* dq, int64_t dq_ld,
                    float* dk, int64_t dk_ld, float* dv, int64_t dv_ld) {
  const int64_t S = a.S;
  const int D = a.D, Dp = static_cast<int>(round_up(D, W)), Br = query_block(a.query_block), Bc = key_block(a.key_block),
            grp = a.heads;
  const int64_t Sp = round_up(S, Bc);  // k and v (and dK, dV) padded to whole key blocks
  const bool direct = D == Dp;
  scratch::Array<float> kT(static_cast<size_t>(D * Sp)), vT(static_cast<size_t>(D * Sp)), kr(static_cast<size_t>(Sp * Dp)),
      q(static_cast<size_t>(Br * Dp)), dO(static_cast<size_t>(Br * Dp)), dqb(static_cast<size_t>(Br * Dp)),
      p(static_cast<size_t>(Br * Bc)), ds(static_cast<size_t>(Br * Bc)), lse2(static_cast<size_t>(Br)),
      dsum(static_cast<size_t>(Br)), pads(direct ? 0 : static_cast<size_t>(2 * Sp * Dp));
  scratch::Array<int32_t> kpad(a.kidx ? static_cast<size_t>(Sp) : 0);
  const int32_t* kidx = padded_key_index(a, Sp, kpad);
  pack_transposed(a.k, a.k_ld, S, Sp, D, Bc, kT.data(), a.bf16);
  pack_transposed(a.v, a.v_ld, S, Sp, D, Bc, vT.data(), a.bf16);
  pack_rows(a.k, a.k_ld, S, 0, static_cast<int>(Sp), D, Dp, kr.data(), a.bf16);
  float* dka = direct ? dk : pads.data();
  float* dva = direct ? dv : pads.data() + Sp * Dp;
  const int64_t dka_ld = direct ? dk_ld : Dp, dva_ld = direct ? dv_ld : Dp;
  for (int64_t j = 0; j < S; ++j) {
    std::fill(dka + j * dka_ld, dka + j * dka_ld + Dp, 0.0f);
    std::fill(dva + j * dva_ld, dva + j * dva_ld + Dp, 0.0f);
  }
  const float c = a.scale * kLog2e;
  const auto bounds = block_bounds(a, Br);
  const auto spans = key_spans(a, Bc);
  for (int w = 0; w < grp; ++w) {
    for (int64_t i0 = 0; i0 < S; i0 += Br) {
      const int rows = static_cast<int>(std::min<int64_t>(Br, S - i0));
      const BlockBounds bb = bounds[static_cast<size_t>(i0 / Br)];
      pack_rows(a.q[w], a.q_ld, S, i0, Br, D, Dp, q.data(), a.bf16);
      pack_rows(a.dO[w], a.dO_ld, S, i0, Br, D, Dp, dO.data(), a.bf16);
      std::fill(dqb.begin(), dqb.end(), 0.0f);
      for (int r = 0; r < rows; ++r) {  // lse in log2 units; D_i = dO_i . O_i
        const int64_t i = i0 + r;
        lse2[static_cast<size_t>(r)] = a.lse[w][i * a.lse_ld] * kLog2e;
        const Elems orow = a.o[w] + i * a.o_ld;
        float acc = 0;
        for (int d = 0; d < D; ++d) acc += orow[d] * dO[static_cast<size_t>(r * Dp + d)];
        dsum[static_cast<size_t>(r)] = acc;
      }
      for (int64_t j0 = 0; j0 < S; j0 += Bc) {
        const KeySpan& ks = spans[static_cast<size_t>(j0 / Bc)];
        if (sees_none(bb, ks)) continue;
        const int keys = static_cast<int>(std::min<int64_t>(Bc, S - j0));
        gemm_nt(q.data(), Dp, kT.data() + j0 * D, Bc, p.data(), Bc, rows, Bc, D);
        gemm_nt(dO.data(), Dp, vT.data() + j0 * D, Bc, ds.data(), Bc, rows, Bc, D);
        const bool full = sees_all(bb, ks);
        if (!full)
          for (int r = 0; r < rows; ++r)
            mask_row(p.data() + static_cast<int64_t>(r) * Bc, Bc, a.query_index(i0 + r), j0, a.pos[i0 + r], kidx);
        (full ? (a.bf16 ? probabilities_and_ds<false, true> : probabilities_and_ds<false, false>)
              : (a.bf16 ? probabilities_and_ds<true, true> : probabilities_and_ds<true, false>))(
            p.data(), ds.data(), Bc, rows, c, a.scale, lse2.data(), dsum.data());
        // dV += P^T dO, dK += dS^T Q over this block's queries; dQ += dS K.
        gemm_nn_acc(p.data(), 1, Bc, dO.data(), Dp, dva + j0 * dva_ld, dva_ld, keys, rows, Dp);
        gemm_nn_acc(ds.data(), 1, Bc, q.data(), Dp, dka + j0 * dka_ld, dka_ld, keys, rows, Dp);
        gemm_nn_acc(ds.data(), Bc, 1, kr.data() + j0 * Dp, Dp, dqb.data(), Dp, rows, Bc, Dp);
      }
      for (int r = 0; r < rows; ++r) {
        const float* part = dqb.data() + static_cast<int64_t>(r) * Dp;
        float* row = dq[w] + (i0 + r) * dq_ld;
        if (!dq_in) {
          std::memcpy(row, part, sizeof(float) * static_cast<size_t>(D));
          continue;
        }
        const float* sum = dq_in[w] + (i0 + r) * dq_in_ld;
        for (int d = 0; d < D; ++d) row[d] = sum[d] + part[d];
      }
    }
  }
  if (!direct)
    for (int64_t j = 0; j < S; ++j) {
      std::memcpy(dk + j * dk_ld, dka + j * Dp, sizeof(float) * static_cast<size_t>(D));
      std::memcpy(dv + j * dv_ld, dva + j * Dp, sizeof(float) * static_cast<size_t>(D));
    }
}

}  // namespace halyard::runtime::attention_cpu::HALYARD_ISA
