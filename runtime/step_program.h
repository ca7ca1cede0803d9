// The data a generated model library hands to the runtime.
//
// halyard_aot emits these tables (plain constants, no code) next to the
// compiled Halide kernels: which buffers a step uses (the caller's inputs,
// parameters and gradients, or offsets into one activation arena whose size
// the generator computed from liveness), and the kernel calls in order. The
// runtime's Model (runtime/model.h) executes them. Shapes are row-major in
// the DSL's axis order; the kernels see them reversed (innermost first).
#pragma once

#include <cstdint>
#include <string_view>

namespace halyard::runtime {

// BF16: a saved value's 16-bit copy (schedules/precision.h), only ever
// written and read by kernels (Halide sees it as UInt(16)).
enum class ElemType : uint8_t { F32, F64, I32, BF16 };
// Input index: 0 input_ids, 1 position_ids, 2 labels, 3 token_index (each
// token's index in the row, which the runtime fills). A View is a tile of
// another buffer (sequence tiling): the rows [offset, offset + shape[dim])
// of buffer `index` along dimension `dim`, with that buffer's strides.
enum class Storage : uint8_t { Input, Param, Grad, Arena, View };

constexpr int kMaxRank = 6;

struct BufferSpec {
  const char* name;  // the node's label, for error messages and profiles
  ElemType type;
  int rank;
  int64_t shape[kMaxRank];
  Storage storage;
  int index;       // Input/Param/Grad: which one; View: the buffer it is a tile of
  int64_t offset;  // Arena: byte offset; View: first row along dim
  int dim;         // View: the tiled dimension (row-major index)
  // An Arena value the schedule offloads (keep "offload"): its host copy's
  // byte offset in the program's offload arena, where it stays from its
  // Offload call to its Reload; its device bytes (offset) are another
  // buffer's in between. -1: the arena only.
  int64_t host_offset = -1;
};

// Bytes of one element of a buffer, and of the buffer's dimensions from
// `dim` inward (0: the whole buffer; a View's own shape, not its rows' span).
inline int64_t elem_bytes(ElemType t) { return t == ElemType::F64 ? 8 : t == ElemType::BF16 ? 2 : 4; }
inline int64_t buffer_bytes(const BufferSpec& s, int dim = 0) {
  int64_t n = elem_bytes(s.type);
  for (int d = dim; d < s.rank; ++d) n *= s.shape[d];
  return n;
}

using KernelFn = int (*)(void**);

// What a call does: run a generated kernel, or a collective over the mesh
// (runtime/collectives.h) on its input and output buffers.
enum class CallKind : uint8_t {
  Kernel,
  SeqToHeads,      // [batch, seq@sp, H, d] -> [batch, seq, H@sp, d] (Ulysses all-to-all)
  HeadsToSeq,      // [batch, seq, H@sp, d] -> [batch, seq@sp, H, d], replicated heads summed
  GatherSeq,       // i32 [batch, seq@sp] -> [batch, seq]
  AllReduce,       // sum over the mesh, same type
  AllReduceGrads,  // no args: sums every parameter gradient over the mesh (last call of a train step)
  ConcatSeq,       // tiles (all args but the last) back to back along seq into the output (sequence tiling)
  RingShift,       // x -> y: rank r receives the x of rank r - direction (ring attention's block pass)
  // The finish of the collective an earlier call with the same args started
  // (a ring pass, or a Ulysses all-to-all started as soon as its input was
  // computed), just before the first call that reads its output: the calls
  // between run while the data moves.
  Wait,
  // An offloaded value (args = {buffer}) copied to its host memory after its
  // last use in the forward, its device bytes free from here; and copied
  // back before its first use in the backward.
  Offload,
  Reload,
};

struct CallSpec {
  KernelFn fn;         // Kernel only
  const char* kernel;  // kernel function name, or the collective's
  const char* label;   // op and the node it computes
  int num_args;
  const int* args;     // buffer indices: inputs in order, then the output
  CallKind kind;
  // Collectives: the mesh axis they run over, which picks the communicator:
  // "sp" (the ranks of one sequence), "dp,sp" (every rank), or a factor of
  // sp in a hybrid step ("sp_u", "sp_r"). nullptr for kernels.
  const char* mesh_axis;
  int direction;  // RingShift: 1 receives from the rank before along the axis, -1 from the one after
};

struct ProgramSpec {
  const BufferSpec* buffers;
  int num_buffers;
  const CallSpec* calls;
  int num_calls;
  int64_t arena_bytes;
  int loss;  // buffer holding the scalar loss
  int64_t offload_bytes = 0;  // host memory of offloaded values (BufferSpec::host_offset)
};

struct ParamSpec {
  const char* name;  // HF state-dict name
  int rank;
  int64_t shape[kMaxRank];  // Halyard layout; same bytes as HF's
  int64_t numel;
  int hf_rank;
  int64_t hf_shape[2];
};

struct ModelSpec {
  const char* name;
  const char* config_json;
  const char* schedule;  // Schedule::str()
  const char* target;    // Halide target string
  // seq: the global sequence the library was built for. Under sequence
  // parallelism over sp ranks, each rank holds local_seq = ceil(seq / sp)
  // tokens per row; the last rank's tail beyond seq is padding.
  int64_t batch, seq, vocab;
  int sp;
  int64_t local_seq;
  int64_t ignore_index;
  const ParamSpec* params;
  int num_params;
  int num_kernels;
  ProgramSpec train;    // forward + backward: loss and every gradient
  ProgramSpec forward;  // forward only: loss
  // The plan as data: a JSON object with the generator's predictions per rank
  // (e.g. "predicted_peak_bytes_per_rank", "memory_per_rank": {name: bytes},
  // "predicted_step_s"), which training programs print and log beside what
  // they measure (runtime/measure.h). nullptr or "" from generators that
  // predict nothing. Last on purpose: generated code initializes every member
  // in order, so new fields go after it.
  const char* plan_json;
  // Schedule::sequence_layout: which tokens each sp rank holds ("contiguous"
  // or "zigzag"); the batcher must place them the same way (runtime/data.h).
  const char* sequence_layout;
  // Hybrid sequence parallelism: the Ulysses degree u of sp = u x r (the
  // runtime splits the sp ranks into Ulysses groups of u consecutive ranks,
  // mesh axis "sp_u", and ring groups across them, "sp_r"); 0 otherwise.
  int ulysses_degree;
  // A GPU library's optimizer kernels (generators/optimizer.h), which
  // Model::adamw_step runs on the device; nullptr in CPU libraries (the
  // update runs on the host there, where the parameters are).
  KernelFn adamw = nullptr;
  KernelFn grad_sumsq = nullptr;
};

// Whether the library's sp ranks hold zigzag chunks (runtime::Shard::zigzag).
inline bool zigzag_layout(const ModelSpec& s) {
  return s.sequence_layout && std::string_view(s.sequence_layout) == "zigzag";
}

}  // namespace halyard::runtime
