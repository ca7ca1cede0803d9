// The weight-gradient GEMM on the CPU: C[m][n] = sum_k A[k][m] B[k][n],
// both operands token-major (a row of A or B per token, as activations and
// their gradients are), C row-major. Every step of the sum reads a new row
// of each operand, rows a power-of-two length apart that map onto a few
// cache sets; so, as BLIS does, the sum runs in blocks of kc tokens whose
// operands are first packed: B's block into panels of NR columns, A's into
// panels of MR rows, each panel contiguous in the order the micro-kernel
// reads it. The micro-kernel keeps an MR x NR tile of C in registers over
// the block (A broadcast, B's columns vectorized) and adds it into C.
//
// Compiled once per vector ISA, inside namespace HALYARD_ISA, with
// attention_cpu_impl.h (cpu_kernels_<isa>.cpp).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "runtime/cpu_vector.h"
#include "runtime/gemm_cpu.h"

#ifndef HALYARD_ISA
#error "define HALYARD_ISA (the namespace of this compilation) before including gemm_cpu_impl.h"
#endif

namespace halyard::runtime::gemm_cpu::HALYARD_ISA {
namespace {

using namespace cpu_vector::HALYARD_ISA;

// Register tiles: MR rows x NV vectors of accumulators, with room for NV
// loads of B and a broadcast of A (AVX-512: 24 + 3 of 32 zmm; AVX2 and the
// baseline: 12 + 3 of 16).
#if defined(__AVX512F__)
constexpr int MR = 12, NV = 2;
#else
constexpr int MR = 6, NV = 2;
#endif
constexpr int NR = NV * W;

// tile[MR][NR] = (first ? 0 : C) + sum over the block of a (x) b; the
// packed panels hold, per token, MR values of A and NR of B.
inline __attribute__((always_inline)) void micro(const float* a, const float* b, int kc, float* c, int64_t ldc,
                                                 bool first) {
  if (first) return nn_tile<MR, NV, false>(a, 1, MR, b, NR, c, ldc, kc);
  nn_tile<MR, NV>(a, 1, MR, b, NR, c, ldc, kc);
}

// Packs `count` columns from `col0` of kc rows (ld apart) into panels of P
// columns, zero past the last column.
template <int P>
void pack(const float* src, int64_t ld, int kc, int64_t col0, int64_t count, float* dst) {
  for (int64_t p = 0; p < count; p += P) {
    const int64_t n = std::min<int64_t>(P, count - p);
    float* d = dst + (p / P) * static_cast<int64_t>(kc) * P;
    const float* s = src + col0 + p;
    if (n == P) {
      for (int k = 0; k < kc; ++k) std::memcpy(d + k * P, s + k * ld, P * sizeof(float));
      continue;
    }
    for (int k = 0; k < kc; ++k) {
      std::memcpy(d + k * P, s + k * ld, static_cast<size_t>(n) * sizeof(float));
      std::fill(d + k * P + n, d + (k + 1) * P, 0.f);
    }
  }
}

}  // namespace

Tile tile() { return {MR, NR}; }

// Rows [m0, m0 + mc) of C, all its columns. Per block of kc tokens and nc
// columns: B's block packed (into bp, kc x nc floats), then, per panel of
// MR rows, A's panel packed and the micro-kernel across the columns.
void rows(const Operands& o, int64_t m0, int64_t mc, float* c, float* bp) {
  const int kc_max = o.kc, nc_max = std::max<int>(NR, o.nc / NR * NR);
  alignas(64) float ap[MR * kMaxKc];  // 48 KiB at most (AVX-512)
  float edge[MR * NR] = {};
  for (int64_t k0 = 0; k0 < o.K; k0 += kc_max) {
    const int kc = static_cast<int>(std::min<int64_t>(kc_max, o.K - k0));
    const bool first = k0 == 0 && !o.accumulate;
    for (int64_t n0 = 0; n0 < o.N; n0 += nc_max) {
      const int64_t nc = std::min<int64_t>(nc_max, o.N - n0), np = (nc + NR - 1) / NR;
      pack<NR>(o.b + k0 * o.ldb, o.ldb, kc, n0, nc, bp);
      for (int64_t r0 = m0; r0 < m0 + mc; r0 += MR) {
        const int64_t nrows = std::min<int64_t>(MR, m0 + mc - r0);
        pack<MR>(o.a + k0 * o.lda, o.lda, kc, r0, nrows, ap);
        for (int64_t j = 0; j < np; ++j) {
          const int64_t c0 = n0 + j * NR, cols = std::min<int64_t>(NR, o.N - c0);
          float* dst = c + r0 * o.ldc + c0;
          if (nrows == MR && cols == NR) {
            micro(ap, bp + j * NR * kc, kc, dst, o.ldc, first);
            continue;
          }
          // An edge tile goes through a full tile on the stack.
          for (int64_t r = 0; r < nrows; ++r)
            std::memcpy(edge + r * NR, dst + r * o.ldc, static_cast<size_t>(cols) * sizeof(float));
          micro(ap, bp + j * NR * kc, kc, edge, NR, first);
          for (int64_t r = 0; r < nrows; ++r)
            std::memcpy(dst + r * o.ldc, edge + r * NR, static_cast<size_t>(cols) * sizeof(float));
        }
      }
    }
  }
}

}  // namespace halyard::runtime::gemm_cpu::HALYARD_ISA
