// Runs CUDA C++ kernels on the CPU, for tests of kernel code on machines
// without a GPU: each thread of a block is a fiber (ucontext) of the
// launching thread; __syncthreads switches to the next fiber, and a barrier
// is passed once every fiber of the block has reached it. A warp shuffle is
// such a barrier too, which is therefore only right for kernels whose every
// thread reaches each shuffle together (as runtime/attention_cuda.cu's do);
// a thread that ends while others wait at a barrier aborts the test, where
// CUDA would hang. Blocks run one after another, so a __shared__ variable
// (a static here) belongs to the block that runs.
// mma.sync (runtime/attention_cuda.cu's mma_bf16) is a collective of the
// block too: each lane leaves its fragments, and computes its own output
// elements from its warp's, PTX's m16n8k16 layouts read back.
// (Each thread was a std::thread, and a barrier of 128 of them on 2 cores
// cost more than the kernels: the ring blocks' test took 23 s alone, 32 s of
// it in the kernel, and 108 s beside a parallel ctest.)
// Include it before the .cu file, which is then compiled as C++.
#pragma once

#define HALYARD_CUDA_EMULATION 1

#include <math.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>

namespace cuda_emulation {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
// The launching thread's block: its fibers all run on that thread.
inline thread_local Dim3 thread_idx, block_idx, block_dim;
inline thread_local std::vector<float> lanes;  // a shuffle's values, one per thread
inline thread_local std::vector<std::array<uint32_t, 6>> fragments;  // an mma's A and B registers, one per thread

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;  // (not zeroed: 128 x 256 KiB a launch)
  bool done = false;
};
inline thread_local ucontext_t scheduler;
inline thread_local Fiber* running = nullptr;
inline thread_local const std::function<void()>* fiber_body = nullptr;

inline void fiber_entry() {
  (*fiber_body)();
  running->done = true;  // (then to the scheduler: uc_link)
}

inline void barrier() { swapcontext(&running->context, &scheduler); }

// body() on `threads` fibers, each given its threadIdx, round by round: a
// round runs every fiber up to its next barrier (or its end).
inline void run_fibers(unsigned threads, const std::function<void()>& body) {
  constexpr size_t kStack = 256 << 10;  // a kernel's locals are registers' worth
  std::vector<Fiber> fibers(threads);
  fiber_body = &body;
  for (Fiber& f : fibers) {
    f.stack.reset(new char[kStack]);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStack;
    f.context.uc_link = &scheduler;
    makecontext(&f.context, fiber_entry, 0);
  }
  for (unsigned ended = 0; ended < threads;) {
    ended = 0;
    for (unsigned t = 0; t < threads; ++t) {
      thread_idx = {t, 0, 0};
      running = &fibers[t];
      swapcontext(&scheduler, &fibers[t].context);
      ended += fibers[t].done ? 1 : 0;
    }
    if (ended > 0 && ended < threads) {
      std::fprintf(stderr, "cuda_emulation: %u of %u threads ended while the others wait at a barrier\n", ended,
                   threads);
      std::abort();
    }
  }
  running = nullptr;
}

// kernel(args...) over grid (gx, gy, gz), `threads` threads per block.
template <class Kernel, class... Args>
void launch(Kernel kernel, unsigned gx, unsigned gy, unsigned gz, unsigned threads, Args... args) {
  block_dim = {threads, 1, 1};
  lanes.assign(threads, 0.f);
  fragments.assign(threads, {});
  // Each fiber runs every block in turn, all meeting between blocks.
  run_fibers(threads, [&] {
    for (unsigned z = 0; z < gz; ++z)
      for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) {
          block_idx = {x, y, z};
          kernel(args...);
          barrier();
        }
  });
}

}  // namespace cuda_emulation

#define threadIdx cuda_emulation::thread_idx
#define blockIdx cuda_emulation::block_idx
#define blockDim cuda_emulation::block_dim
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  uint32_t x, y;
};
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};

inline void __syncthreads() { cuda_emulation::barrier(); }

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
