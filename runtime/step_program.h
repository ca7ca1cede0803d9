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

namespace halyard::runtime {

enum class ElemType : uint8_t { F32, F64, I32 };
// Input index: 0 input_ids, 1 position_ids, 2 labels.
enum class Storage : uint8_t { Input, Param, Grad, Arena };

constexpr int kMaxRank = 6;

struct BufferSpec {
  const char* name;  // the node's label, for error messages and profiles
  ElemType type;
  int rank;
  int64_t shape[kMaxRank];
  Storage storage;
  int index;       // Input/Param/Grad: which one
  int64_t offset;  // Arena: byte offset
};

using KernelFn = int (*)(void**);

struct CallSpec {
  KernelFn fn;
  const char* kernel;  // kernel function name
  const char* label;   // op and the node it computes
  int num_args;
  const int* args;     // buffer indices: inputs in order, then the output
};

struct ProgramSpec {
  const BufferSpec* buffers;
  int num_buffers;
  const CallSpec* calls;
  int num_calls;
  int64_t arena_bytes;
  int loss;  // buffer holding the scalar loss
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
  int64_t batch, seq, vocab;
  int64_t ignore_index;
  const ParamSpec* params;
  int num_params;
  int num_kernels;
  ProgramSpec train;    // forward + backward: loss and every gradient
  ProgramSpec forward;  // forward only: loss
};

}  // namespace halyard::runtime
