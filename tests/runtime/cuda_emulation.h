// Runs CUDA C++ kernels on the CPU, for tests of kernel code on machines
// without a GPU: each thread of a block is a std::thread; __syncthreads is a
// barrier of the block, and so is a warp shuffle, which is therefore only
// right for kernels whose every thread reaches each shuffle together (as
// runtime/attention_cuda.cu's do), and returns only at their end. Blocks run
// one after another, so a __shared__ variable (a static here) belongs to the
// block that runs.
// mma.sync (runtime/attention_cuda.cu's mma_bf16) is a collective of the
// block too: each lane leaves its fragments, and computes its own output
// elements from its warp's, PTX's m16n8k16 layouts read back.
// Include it before the .cu file, which is then compiled as C++.
#pragma once

#define HALYARD_CUDA_EMULATION 1

#include <math.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

namespace cuda_emulation {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3 thread_idx, block_idx;
inline Dim3 block_dim;
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<float> lanes;  // a shuffle's values, one per thread
inline std::vector<std::array<uint32_t, 6>> fragments;  // an mma's A and B registers, one per thread

// kernel(args...) over grid (gx, gy, gz), `threads` threads per block.
template <class Kernel, class... Args>
void launch(Kernel kernel, unsigned gx, unsigned gy, unsigned gz, unsigned threads, Args... args) {
  block_dim = {threads, 1, 1};
  std::barrier<> barrier(threads);
  block_barrier = &barrier;
  lanes.assign(threads, 0.f);
  fragments.assign(threads, {});
  // One std::thread per thread of a block, which runs every block in turn,
  // all meeting between blocks.
  std::vector<std::thread> block;
  for (unsigned t = 0; t < threads; ++t)
    block.emplace_back([&, t] {
      thread_idx = {t, 0, 0};
      for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
          for (unsigned x = 0; x < gx; ++x) {
            block_idx = {x, y, z};
            kernel(args...);
            barrier.arrive_and_wait();
          }
    });
  for (std::thread& th : block) th.join();
  block_barrier = nullptr;
}

}  // namespace cuda_emulation

#define threadIdx cuda_emulation::thread_idx
#define blockIdx cuda_emulation::block_idx
#define blockDim cuda_emulation::block_dim
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct alignas(16) float4 {
  float x, y, z, w;
};

inline void __syncthreads() { cuda_emulation::block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int mask) {
  const unsigned t = threadIdx.x;
  cuda_emulation::lanes[t] = v;
  __syncthreads();
  const float other = cuda_emulation::lanes[t ^ static_cast<unsigned>(mask)];
  __syncthreads();
  return other;
}

inline int atomicMin(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}

using std::max;
using std::min;

inline uint32_t __float_as_uint(float x) { return std::bit_cast<uint32_t>(x); }
inline float __uint_as_float(uint32_t x) { return std::bit_cast<float>(x); }

// d (16 x 8) += a (16 x 16) b (16 x 8) over the calling thread's warp, the
// operands bf16 pairs in PTX's m16n8k16 fragments: lane l = 4 g + t holds
// a's rows g and g + 8 at columns 2t, 2t + 1 (registers 0, 1) and 2t + 8,
// 2t + 9 (registers 2, 3); b's column g at rows 2t, 2t + 1 and 2t + 8, 2t + 9;
// d's rows g and g + 8 at columns 2t, 2t + 1.
inline void mma_bf16(float* d, const uint32_t* a, const uint32_t* b) {
  const unsigned t = threadIdx.x, warp = t & ~31u;
  cuda_emulation::fragments[t] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  __syncthreads();
  auto half = [](uint32_t pair, int k) { return __uint_as_float(k & 1 ? pair & 0xffff0000u : pair << 16); };
  auto A = [&](int r, int k) {
    const auto& f = cuda_emulation::fragments[warp + 4 * (r % 8) + (k % 8) / 2];
    return half(f[(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k);
  };
  auto B = [&](int k, int n) {
    const auto& f = cuda_emulation::fragments[warp + 4 * n + (k % 8) / 2];
    return half(f[4 + (k >= 8 ? 1 : 0)], k);
  };
  const int g = static_cast<int>(t & 31) / 4, tq = static_cast<int>(t & 3);
  for (int e = 0; e < 4; ++e) {
    const int r = g + 8 * (e >> 1), n = 2 * tq + (e & 1);
    float sum = d[e];
    for (int k = 0; k < 16; ++k) sum += A(r, k) * B(k, n);
    d[e] = sum;
  }
  __syncthreads();
}
