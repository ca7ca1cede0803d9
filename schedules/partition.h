// Partitioning a joint graph into stages: which values are materialized.
//
// A stage computes one materialized value (its root) and inlines the cheap
// values that feed it; every other value it reads is a buffer (a parameter, an
// input, or another stage's root). Heavy ops (the op table's heavy and
// runtime classes) are always roots. A cheap op (add, mul, silu, rope,
// rms_norm, ...) is inlined into its consumers when it has one consumer, or
// when the schedule says `compute: inline` for it: then every consumer,
// backward included, re-derives it from stored inputs instead of reading a
// stored copy. Stages whose signatures
// match share one kernel, so a 32-layer model compiles each layer's kernels once.
// A collective (an all-to-all, a gather, an all-reduce) is a stage of its own
// with no kernel: the runtime performs it on its input buffer, so whatever
// feeds a collective is materialized.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsl/graph.h"
#include "schedules/schedule.h"

namespace halyard {

// Halide's 32-bit limits: the most bytes a buffer may hold without 64-bit
// addressing (large_buffers), and the largest stride or extent of any
// dimension (halide_dimension_t), with or without it.
constexpr int64_t kMax32Bit = (int64_t{1} << 31) - 1;

struct Stage {
  int root = -1;               // the node this stage materializes
  std::vector<int> inputs;     // buffers read, in kernel argument order
  std::vector<int> inlined;    // nodes computed inside, topological order
  std::string signature;       // structure + types; equal => same kernel
  int kernel = -1;             // index into Partition::kernels; -1 for a collective
  std::vector<int> extra_outputs;  // nodes the kernel writes too (dV with dK: they share the probabilities)
  // A ring block's library backward whose dQ is a part of the sum over the
  // ring's key blocks: the kernel adds its part (dq_part, never stored) to
  // the running sum of the blocks before (dq_sum_in, one of its inputs) and
  // writes that Add node, its last extra output, in dQ's place. So no
  // block's part is ever a buffer, and the sum is written over the running
  // sum where that dies (schedules/program.h: in_place_of).
  int dq_part = -1, dq_sum_in = -1;
  // The node whose value the kernel computes for output `x` (one of the
  // root and extra_outputs): x itself, or for the sum it writes, its dQ part.
  int computes(int x) const { return dq_part >= 0 && x == extra_outputs.back() ? dq_part : x; }
  // The kernel calls a library instead of being generated: attention
  // (runtime/attention_cpu.h, the schedule's attention_kernel; its backward
  // writes dK, then dV and dQ as extra outputs; a log-sum-exp the backward
  // recomputes alone is the forward without P V) or a weight gradient
  // (runtime/gemm_cpu.h, the schedule's weight_grad_kernel).
  bool library = false;
  // The contraction is one call of the runtime's device GEMM (runtime/gemm.h,
  // cuBLAS; the schedule's contract_kernel): it has gemm_form.
  bool gemm = false;
  // A value the kernel reads or computes, or all it writes together, holds
  // 2^31 bytes or more: it is compiled with 64-bit addressing (Halide's
  // large_buffers).
  bool large_buffers = false;
};

// A contraction the weight-gradient library computes: out[rows..., cols...]
// = sum over tokens of A[tokens..., rows...] B[tokens..., cols...], each
// operand's summed axes outermost and in the same order (at most 3), its
// kept ones in the output's order, B holding the output's innermost axis.
struct WeightGradForm {
  int a = -1, b = -1;          // which input is A (rows), which B (columns)
  int a_dims = 0, b_dims = 0;  // kept axes of each
  std::vector<int64_t> tokens; // the summed axes' sizes, innermost first
};
bool weight_grad_form(const Graph& g, const Node& n, WeightGradForm* form = nullptr);

// A contraction that is one GEMM over its operands' buffers, read in place:
// out[m..., n...] = sum over k... of A * B, where A holds the output's outer
// (m) axes and B its inner (n) ones, neither holds the other's, and each
// operand's axes are two runs: its kept ones in the output's order, and the
// summed ones (in the same order in both), either run first. Row-major, A is
// [M, K] (a_k_inner) or [K, M], and B [N, K] (b_k_inner) or [K, N]. At most
// 3 axes in a run (the runtime's descriptor), f32, no axis in all three.
struct GemmForm {
  int a = -1, b = -1;                     // which input is A, which B
  int m_dims = 0, n_dims = 0, k_dims = 0;
  bool a_k_inner = false, b_k_inner = false;
  std::vector<int64_t> k;                 // the summed axes' sizes, innermost first
};
bool gemm_form(const Graph& g, const Node& n, GemmForm* form = nullptr);

// The 16-bit copy that a kernel taking bf16 operands reads in place of
// value `id`, or -1: where `id` is load_bf16 of one of the stage's buffers
// (a saved value's or a contraction operand's copy, schedules/precision.h).
// Else a value computed inline, such as that decode, is copied to an f32
// buffer once per call. Read so by the runtime's GEMM (both operands such
// copies) and the attention libraries (attention_reads_copy).
int bf16_copy_read(const Graph& g, const Stage& st, int id);
// The copy that a library attention stage (runtime/attention_cpu.h,
// attention_cuda.h) reads in place of its input k, or -1: q, k, v and the
// backward's O, where each is such a copy. (dO, a gradient, never is.)
int attention_reads_copy(const Graph& g, const Stage& st, size_t k);
// Whether a library attention stage that copies its input k (a value
// computed inline, such as RoPE of a projection: neither a buffer nor a
// copy it reads in place) copies it to 16 bits, bf16, rather than to f32:
// q, k and v where the products read bf16 (Attrs::bf16). The kernels round
// those operands to bf16 (nearest, ties to even) before any product, as the
// copy does, so the bits are the same with half the bytes.
bool attention_copies_bf16(const Graph& g, const Stage& st, size_t k);

// How a Halide-lowered contraction (not a library one) reads its operands;
// generators/lower.cpp builds it so and the plan counts its copies. B, the
// operand holding the output's innermost axis, is read as vectors along it.
// B is copied once per call when it is not a buffer, or not in the order
// the kernel reads (its summed axes first, then its kept ones in the
// output's order), or when the kernel streams it along the sum (a
// projection: the sum runs along A's innermost axis) and it has a multiple
// of 32 columns (of every ISA's register tile: 8, 16 or 32): then the copy
// is in panels one vector wide, the sum inside, so that each vector of a
// register tile's strip of B follows the last. In a row-major B the strip's
// rows are a row apart (1 or 3 KiB here): a few cache sets, and a page every
// row or two (a 6x16 AVX2 tile over 256 x 768 floats: 62 GFLOP/s
// row-major, 80 in panels, one Zen 3 core).
struct ContractLayout {
  int b = 0;                             // which input is B
  std::vector<std::string> b_order;      // B's copy, row-major: summed axes, then kept ones
  bool b_copied = false, b_panels = false;
  bool a_staged = false;                 // A is an inlined expression, staged per row panel
};
ContractLayout contract_layout(const Graph& g, const Node& n, const std::vector<int>& stage_inputs);

// A sum over tokens into fewer elements than a GPU has threads (a norm's or
// a bias's weight gradient, the loss, the token count) would walk every
// token in each of a few hundred threads: 12 ms a norm at 32,768 tokens on
// an H200, one block busy. generators/schedule_gpu.cpp splits the longest
// summed axis into chunks, one thread for each output element's partial sum
// over one chunk (Halide's rfactor: an [outputs x chunks] f32 temporary,
// at most 1 MiB), then sums the chunks. chunks == 0: the sum stays whole
// (enough outputs to fill a GPU, or a short sum; for a node, also any other
// op).
struct GpuSumSplit {
  int64_t chunks = 0, length = 0;  // length: a chunk's, the last one's may be shorter
};
GpuSumSplit gpu_sum_split(int64_t outputs, int64_t summed);
GpuSumSplit gpu_sum_split(const Graph& g, const Node& n);

// Halide's GPU kernels index in 32 bits (its CUDA code generator does not
// widen indices for large_buffers), so a tensor of 2^31 elements or more
// that a Halide kernel reads, writes or computes would wrap silently: a
// [32768, 128256] block of logits, say. Library calls (cuBLAS, the CUDA
// attention kernels) are exempt; Halide's copies of their operands are
// not, nor are collectives. The first such tensor of a GPU stage, or -1.
int gpu_index_overflow(const Graph& g, const Stage& st);

struct Partition {
  std::vector<Stage> stages;           // in execution order
  std::vector<int> kernels;            // stage index of each distinct kernel's first use
  std::vector<bool> materialized;      // per node: a buffer (root, input or param)
};

// Stages needed to compute `outputs` (the loss and the gradients, or the loss alone).
Partition partition(const Graph& g, const std::vector<int>& outputs, const Schedule& s);

bool is_heavy(Op op);

}  // namespace halyard
