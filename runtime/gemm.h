// The runtime's GEMM, which a generated kernel calls for a contraction the
// schedule gives to it (Schedule::contract_kernel = "cublas"; the stage's
// form is schedules/partition.h: gemm_form; generators/lower.cpp makes the
// call an extern stage on the device):
//   out[m..., n...] = sum over k... of A * B
// Buffers are Halide's, innermost first: out = (n..., m...); a = (k..., m...)
// when a_k_inner, else (m..., k...); b = (k..., n...) when b_k_inner, else
// (n..., k...); k0..k2 are the summed extents (1 past the last), which a
// bounds query needs. Each group of dimensions (m, n, k) is one dimension of
// the GEMM where its strides allow (a dense run, in every buffer holding
// it); a group that does not merge (a sequence tile's rows, strided over the
// batch) becomes loops of GEMMs around it, which accumulate over k.
//
// With bf16 set, a and b hold bf16 values as their 16 bits (the copies a
// schedule's contract_precision "bf16" makes); products are summed in f32
// and out is f32 either way.
//
// On device buffers (a CUDA target's extern stage) it runs cuBLAS on the
// runtime's compute stream (cuda_context.h), without waiting for it: SGEMM
// in f32 (no TF32), or cublasGemmEx with bf16 operands and f32 compute
// (tensor cores). On host buffers it runs the reference below: the
// descriptor's semantics in plain loops, what the tests compare with
// Halide's contraction on a machine without a GPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct halide_buffer_t;

extern "C" {
int halyard_gemm(halide_buffer_t* a, halide_buffer_t* b, int m_dims, int n_dims, int k_dims, int a_k_inner,
                 int b_k_inner, int bf16, int k0, int k1, int k2, halide_buffer_t* out);
}

namespace halyard::runtime::gemm {

// One GEMM as cuBLAS takes it, column-major: C[m x n] = op(A) op(B), plus C
// when accumulating; op(X) is X or its transpose; offsets in elements from
// each buffer's first one. A row-major out[M][N] is C^T: cuBLAS's A is the
// GEMM's B and its B the GEMM's A.
struct Call {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t offset_a = 0, offset_b = 0, offset_c = 0;
  bool accumulate = false;
};

// The calls that compute out from a and b, in order (those summing over a
// k loop accumulate after the first), or an error saying why the buffers
// cannot be read so (a dimension not starting at 0, an inner run not dense).
struct Calls {
  std::vector<Call> calls;
  std::string error;
};
// y[i * ldy + k] += x[i * ldx + k] for k < width, i < rows, on device
// memory, queued on `stream` (nullptr: the runtime's compute stream) with
// cuBLAS's geam, in place: the sums of replicated heads in a collective on
// the device (collectives.h). Empty, or why it could not.
std::string add_rows_on_device(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t width, int64_t rows,
                               void* stream = nullptr);

Calls describe(const halide_buffer_t* a, const halide_buffer_t* b, int m_dims, int n_dims, int k_dims, bool a_k_inner,
               bool b_k_inner, const halide_buffer_t* out);

// cuBLAS's semantics on host memory (a, b and c at their offset 0); the
// second form reads bf16 operands (their 16 bits).
void reference(const Call& call, const float* a, const float* b, float* c);
void reference(const Call& call, const uint16_t* a, const uint16_t* b, float* c);

}  // namespace halyard::runtime::gemm
