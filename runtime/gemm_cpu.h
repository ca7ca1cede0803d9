// The CPU library kernel of weight-gradient contractions, which a schedule
// may choose instead of a Halide-generated kernel (Schedule::weight_grad_kernel
// = "library"; generators/lower.cpp calls it as a Halide extern stage):
//   dW[rows..., cols...] = sum over tokens of A[tokens..., rows...] B[tokens..., cols...]
// a packed, register-tiled GEMM (gemm_cpu_impl.h), one build per vector ISA.
//
// Halide calls the entry point once per stage with the whole output; its
// tasks (blocks of rows, or of columns when there are more) run in parallel
// on Halide's thread pool. In a bounds query it asks for its operands whole.
// Buffers are Halide's, innermost first: a = (rows..., tokens...), b =
// (cols..., tokens...), out = (cols..., rows...); the first a_dims (b_dims)
// dimensions of a (b) are the kept ones, the rest (at most 3) the tokens, of
// extents tokens0.. (1 past the last). Rows and columns must be dense (strides multiply), as the
// lowering's buffers are; token dimensions may be strided (a sequence tile
// of a batch), the sum then runs over dense runs of them one at a time.
#pragma once

#include <cstdint>

struct halide_buffer_t;

extern "C" {
int halyard_weight_grad(halide_buffer_t* a, halide_buffer_t* b, int a_dims, int b_dims, int tokens0, int tokens1,
                        int tokens2, halide_buffer_t* out);
}

namespace halyard::runtime::gemm_cpu {

// C[M][N] = sum_k A[k][m] B[k][n]: rows of A, B and C lda, ldb, ldc apart.
struct Operands {
  int64_t M = 0, N = 0, K = 0;
  const float *a = nullptr, *b = nullptr;
  int64_t lda = 0, ldb = 0, ldc = 0;
  // Blocks: tokens (at most kMaxKc) and columns of B packed at a time (0:
  // from the caches, as weight_grad chooses them; the extern stage takes
  // HALYARD_GEMM_KC and HALYARD_GEMM_NC from the environment, for
  // measurements).
  int kc = 0, nc = 0;
  bool accumulate = false;  // C += the product (else C = it)
};
constexpr int kMaxKc = 1024;

// A register tile: rows of A by columns of B (each ISA's, cpu_kernels.cpp).
struct Tile {
  int rows = 0, cols = 0;
};

// The whole product on the calling thread and Halide's pool: one task per
// thread, each a block of rows or columns (for benchmarks and tests; the
// extern stage calls it too).
void weight_grad(const Operands& o, float* c);

}  // namespace halyard::runtime::gemm_cpu
