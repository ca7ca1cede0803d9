// The arguments of the collectives' CUDA kernels (collectives_cuda.cu),
// shared by the kernels and their launcher (collectives_cuda.cpp): one
// struct passed by value, so both sides must see the same layout.
#pragma once

#include <cstdint>

namespace halyard::runtime::collectives_cuda {

constexpr unsigned kThreads = 256;  // per block; one element per thread

// The summands of a sum over ranks moved in bf16, `rows` runs of them:
// out[r * out_width + i] = in[r * in_pitch + i] rounded to bf16 (nearest,
// ties to even; a NaN stays a NaN: runtime/bf16.h's bf16_bits) for
// i < width, and zeros from width to out_width.
struct RoundArgs {
  const float* in = nullptr;
  uint16_t* out = nullptr;
  int64_t rows = 1, width = 0, in_pitch = 0, out_width = 0;
};

// Their sums in f32: out[i] = the sum over p < ranks of in[p * n + i] as
// f32, in rank order from 0 (Communicator::reduce_scatter_sum_bf16's).
struct SumArgs {
  const uint16_t* in = nullptr;
  float* out = nullptr;
  int64_t n = 0;
  int ranks = 0;
};

}  // namespace halyard::runtime::collectives_cuda
