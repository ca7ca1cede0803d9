// Kernel scratch: the temporaries a kernel allocates while it runs (Halide's
// halide_malloc, through the hooks runtime::Model installs, and the CPU
// library kernels' packed blocks). Each thread takes them from a stack of its
// own, reserved once as address space; a block freed out of order stays
// until the blocks above it go.
//
// Why not malloc: scratch comes and goes thousands of times a step in blocks
// of a few MiB. glibc kept them in the heap (runtime::keep_freed_memory, so
// that no tile pays page faults), but there freed holes fragment and each
// thread's arena keeps its own high water: on the tiny Llama at 16,384 tokens
// the process held 10 MiB (1 thread) and 17 MiB (2 threads) more than was
// ever live at once, which no plan could predict. A thread's stack holds
// exactly its deepest nesting of blocks, so what a rank keeps is what
// plan() counts (schedules/plan.cpp: kernel_scratch): the calling thread's
// deepest kernel, plus on each other thread the most one task holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace halyard::runtime::scratch {

// Whether blocks come from the stacks: not under ASan, whose books on
// malloc's blocks catch an overrun past one.
bool stacks_enabled();

// 128-byte aligned (Halide's alignment), uninitialized. Where the thread's
// stack cannot grow (address space refused, or the reservation full) the
// block comes from malloc instead; either way release() frees it.
void* allocate(size_t bytes);
void release(void* p);  // nullptr is fine; from any thread

// This thread's stack: the bytes in use (blocks, headers and padding) and the
// most it has ever held. Both 0 on a thread that has not allocated.
int64_t in_use();
int64_t high_water();
// What every live thread's stack keeps resident: the sum of their high
// waters (a stack's pages stay once touched; a thread that ended gave its
// back).
int64_t resident();
// Hands back the pages above every stack's top and starts the high waters
// again from there (measure.h: reset_peak_rss). Only while no kernel runs.
void trim();

// A thread's scratch array of n zeroed elements (T trivially copyable).
template <class T>
class Array {
 public:
  explicit Array(size_t n) : n_(n), p_(static_cast<T*>(allocate(n * sizeof(T)))) {
    std::memset(static_cast<void*>(p_), 0, n * sizeof(T));
  }
  ~Array() { release(p_); }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  T* data() { return p_; }
  T* begin() { return p_; }
  T* end() { return p_ + n_; }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return p_[i]; }

 private:
  size_t n_;
  T* p_;
};

}  // namespace halyard::runtime::scratch
