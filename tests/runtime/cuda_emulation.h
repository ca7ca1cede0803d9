// Runs CUDA C++ kernels on the CPU, for tests of kernel code on machines
// without a GPU: each thread of a block is a std::thread; __syncthreads is a
// barrier of the block, and so is a warp shuffle, which is therefore only
// right for kernels whose every thread reaches each shuffle together (as
// runtime/attention_cuda.cu's do), and returns only at their end. Blocks run
// one after another, so a __shared__ variable (a static here) belongs to the
// block that runs.
// Include it before the .cu file, which is then compiled as C++.
#pragma once

#include <math.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <climits>
#include <cmath>
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

// kernel(args...) over grid (gx, gy, gz), `threads` threads per block.
template <class Kernel, class... Args>
void launch(Kernel kernel, unsigned gx, unsigned gy, unsigned gz, unsigned threads, Args... args) {
  block_dim = {threads, 1, 1};
  std::barrier<> barrier(threads);
  block_barrier = &barrier;
  lanes.assign(threads, 0.f);
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
