// The collectives' own CUDA kernels: a gradient sum over ranks moved in
// bf16 and summed in f32 (Communicator::all_reduce_sum_bf16's arithmetic)
// on device memory. Built by nvcc into a fatbin that collectives_cuda.cpp
// loads through the driver, like the attention kernels.
#include "runtime/collectives_cuda_args.h"

using halyard::runtime::collectives_cuda::RoundArgs;
using halyard::runtime::collectives_cuda::SumArgs;

extern "C" __global__ void halyard_round_bf16(RoundArgs a) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= a.rows * a.out_width) return;
  const int64_t r = t / a.out_width, i = t % a.out_width;
  if (i >= a.width) {
    a.out[t] = 0;
    return;
  }
  const uint32_t u = __float_as_uint(a.in[r * a.in_pitch + i]);
  a.out[t] = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                             : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

extern "C" __global__ void halyard_sum_bf16(SumArgs a) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.n) return;
  float s = 0.f;
  for (int p = 0; p < a.ranks; ++p) s += __uint_as_float(static_cast<uint32_t>(a.in[p * a.n + i]) << 16);
  a.out[i] = s;
}
