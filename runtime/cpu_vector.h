// The native float vector of the ISA a CPU library kernel is compiled for
// (cpu_kernels_<isa>.cpp: AVX-512, AVX2 + FMA, the x86 baseline), as GCC
// vector types: W floats, and loads, stores and broadcasts of it. A wider
// generic vector on a narrower ISA spills through the stack (18 s instead of
// well under one for attention at seq 4096, AVX2).
#pragma once

#include <cstdint>
#include <cstring>

#ifndef HALYARD_ISA
#error "define HALYARD_ISA (the namespace of this compilation) before including cpu_vector.h"
#endif

namespace halyard::runtime::cpu_vector::HALYARD_ISA {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX2__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));

inline __attribute__((always_inline)) vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline __attribute__((always_inline)) void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// (x - 0 is x exactly, so this folds to a broadcast; x + 0 would not: -0 + 0 is +0.)
inline __attribute__((always_inline)) vf splat(float x) { return x - vf{}; }

// A register tile: C[r][:] (+)= sum_k P[r*prs + k*pcs] * X[k*ldx + :] for
// r < R, k < inner, over NV vectors of columns: the columns vectorized, P
// broadcast, the R x NV accumulators in registers across the sum; added to
// C where Add, else stored over it. With (prs, pcs) = (ld, 1) this is P.X;
// with (1, ld) it is P^T.X.
template <int R, int NV, bool Add = true>
inline __attribute__((always_inline)) void nn_tile(const float* P, int64_t prs, int64_t pcs, const float* X, int64_t ldx,
                                                   float* C, int64_t ldc, int inner) {
  vf acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) acc[r][n] = Add ? load(C + r * ldc + n * W) : vf{};
  for (int k = 0; k < inner; ++k) {
    vf x[NV];
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) x[n] = load(X + k * ldx + n * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vf p = splat(P[r * prs + k * pcs]);
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) acc[r][n] += p * x[n];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) store(C + r * ldc + n * W, acc[r][n]);
}

}  // namespace halyard::runtime::cpu_vector::HALYARD_ISA
