// For programs that JIT-compile lowered stages (tests, benchmarks): the
// library kernels' addresses, which such a pipeline calls. Link
// halyard_cpu_kernels (halyard_runtime brings it).
#pragma once

#include "generators/lowering.h"
#include "runtime/attention_cpu.h"
#include "runtime/gemm.h"
#include "runtime/gemm_cpu.h"

namespace halyard {

inline std::map<std::string, Halide::JITExtern> library_kernels() {
  return {{"halyard_attention_forward", Halide::JITExtern(&halyard_attention_forward)},
          {"halyard_attention_forward_lse", Halide::JITExtern(&halyard_attention_forward_lse)},
          {"halyard_attention_lse", Halide::JITExtern(&halyard_attention_lse)},
          {"halyard_attention_backward", Halide::JITExtern(&halyard_attention_backward)},
          {"halyard_attention_forward_ring", Halide::JITExtern(&halyard_attention_forward_ring)},
          {"halyard_attention_forward_lse_ring", Halide::JITExtern(&halyard_attention_forward_lse_ring)},
          {"halyard_attention_lse_ring", Halide::JITExtern(&halyard_attention_lse_ring)},
          {"halyard_attention_backward_ring", Halide::JITExtern(&halyard_attention_backward_ring)},
          {"halyard_attention_backward_ring_add", Halide::JITExtern(&halyard_attention_backward_ring_add)},
          {"halyard_written_beside", Halide::JITExtern(&halyard_written_beside)},
          {"halyard_weight_grad", Halide::JITExtern(&halyard_weight_grad)}};
}

inline void use_library_kernels_in_jit() { set_library_jit_externs(library_kernels()); }

// The same and the runtime's GEMM (runtime/gemm.h: on the host, its
// reference), for stages lowered with Stage::gemm. Link halyard_runtime.
inline void use_library_kernels_and_gemm_in_jit() {
  std::map<std::string, Halide::JITExtern> externs = library_kernels();
  externs.emplace("halyard_gemm", Halide::JITExtern(&halyard_gemm));
  set_library_jit_externs(std::move(externs));
}

}  // namespace halyard
