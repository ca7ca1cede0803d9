// Causal grouped-query attention on a CUDA device: the library attention
// kernels (Schedule::attention_kernel = "library") of a CUDA target.
// generators/lower.cpp calls these entry points as Halide extern stages on
// the device, with the arguments and buffers of their CPU twins
// (attention_cpu.h), so both libraries run one algorithm: FlashAttention-2,
// O(S) memory (attention_cuda.cu), in f32 on CUDA cores, or with bf16 (the
// node's Attrs::bf16) in bf16 on tensor cores. They launch on the runtime's
// compute stream (cuda_context.h) and return without waiting for it.
//
// Buffers a call reads that the host wrote last go up first; outputs it
// writes beside its own (the log-sum-exp, dV, dQ) get device memory if they
// have none, and are marked as newer on the device.
#pragma once

#include <string>
#include <vector>

#include "runtime/attention_cpu.h"
#include "runtime/attention_cuda_args.h"

struct halide_buffer_t;

extern "C" {
int halyard_attention_forward_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                                   int heads, int kv_heads, int head_dim, int query_block, int key_block, int bf16,
                                   halide_buffer_t* out);
int halyard_attention_forward_lse_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                       halide_buffer_t* pos, halide_buffer_t* lse, int heads, int kv_heads,
                                       int head_dim, int query_block, int key_block, int bf16, halide_buffer_t* out);
int halyard_attention_lse_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* pos, int heads, int kv_heads,
                               int head_dim, int query_block, int key_block, int bf16, halide_buffer_t* out);
int halyard_attention_backward_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                                    halide_buffer_t* o, halide_buffer_t* dO, halide_buffer_t* lse, halide_buffer_t* dv,
                                    halide_buffer_t* dq, int heads, int kv_heads, int query_block, int key_block,
                                    int bf16, halide_buffer_t* out);// A ring attention key block's (attention_cpu.h: the _ring entry points).
int halyard_attention_forward_ring_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                        halide_buffer_t* pos, halide_buffer_t* kidx, halide_buffer_t* qidx, int heads,
                                        int kv_heads, int head_dim, int query_block, int key_block, int bf16,
                                        halide_buffer_t* out);
int halyard_attention_forward_lse_ring_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                            halide_buffer_t* pos, halide_buffer_t* kidx, halide_buffer_t* qidx,
                                            halide_buffer_t* lse, int heads, int kv_heads, int head_dim,
                                            int query_block, int key_block, int bf16, halide_buffer_t* out);
int halyard_attention_lse_ring_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* pos,
                                    halide_buffer_t* kidx, halide_buffer_t* qidx, int heads, int kv_heads,
                                    int head_dim, int query_block, int key_block, int bf16, halide_buffer_t* out);
int halyard_attention_backward_ring_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                         halide_buffer_t* pos, halide_buffer_t* o, halide_buffer_t* dO,
                                         halide_buffer_t* lse, halide_buffer_t* kidx, halide_buffer_t* qidx,
                                         halide_buffer_t* dv, halide_buffer_t* dq, int heads, int kv_heads,
                                         int query_block, int key_block, int bf16, halide_buffer_t* out);
// Adding dQ to the running sum dq_sum (attention_cpu.h: halyard_attention_backward_ring_add).
int halyard_attention_backward_ring_add_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                             halide_buffer_t* pos, halide_buffer_t* o, halide_buffer_t* dO,
                                             halide_buffer_t* lse, halide_buffer_t* kidx, halide_buffer_t* qidx,
                                             halide_buffer_t* dq_sum, halide_buffer_t* dv, halide_buffer_t* dq,
                                             int heads, int kv_heads, int query_block, int key_block, int bf16,
                                             halide_buffer_t* out);
}

namespace halyard::runtime::attention_cuda {

// Whether the kernels hold this head_dim (1 to kMaxHeadDim of
// attention_cuda_args.h; a generator refuses a larger one for a CUDA target).
bool supports_head_dim(int head_dim);
// Empty when the kernels can run here; else one line saying why not (no
// device, or a runtime built without nvcc).
std::string why_unusable();

// One kernel launch of a call: the kernel's name in attention_cuda.cu, its
// grid, threads per block, and arguments.
struct Launch {
  std::string kernel;
  unsigned grid[3] = {1, 1, 1};
  unsigned threads = 0;
  Args args;
};
// The launches of a call (the entry points' arguments, its buffers' device
// fields holding their addresses; a ring block's indices, where given), or
// an error naming what is wrong with the buffers. The entry points launch
// these; the tests also run them through an emulator on the CPU
// (tests/runtime/cuda_emulation.h).
std::string forward_launches(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                             halide_buffer_t* lse, int heads, int kv_heads, int head_dim, bool bf16,
                             halide_buffer_t* out, std::vector<Launch>* launches,
                             attention_cpu::RingIndices idx = {});
// The log-sum-exp alone [heads, seq, batch] (lse): the forward's kernel
// without its output.
std::string lse_launches(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* pos, int heads, int kv_heads,
                         int head_dim, bool bf16, halide_buffer_t* lse, std::vector<Launch>* launches,
                         attention_cpu::RingIndices idx = {});
std::string backward_launches(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                              halide_buffer_t* o, halide_buffer_t* dO, halide_buffer_t* lse, halide_buffer_t* dv,
                              halide_buffer_t* dq, int heads, int kv_heads, bool bf16, halide_buffer_t* out,
                              std::vector<Launch>* launches, attention_cpu::RingIndices idx = {},
                              halide_buffer_t* dq_sum = nullptr);

}  // namespace halyard::runtime::attention_cuda
