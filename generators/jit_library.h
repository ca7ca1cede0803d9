// For programs that JIT-compile lowered stages (tests, benchmarks): the
// library kernels' addresses, which such a pipeline calls. Link
// halyard_cpu_kernels (halyard_runtime brings it).
#pragma once

#include "generators/lowering.h"
#include "runtime/attention_cpu.h"
#include "runtime/gemm_cpu.h"

namespace halyard {

inline void use_library_kernels_in_jit() {
  set_library_jit_externs({{"halyard_attention_forward", Halide::JITExtern(&halyard_attention_forward)},
                           {"halyard_attention_backward", Halide::JITExtern(&halyard_attention_backward)},
                           {"halyard_weight_grad", Halide::JITExtern(&halyard_weight_grad)}});
}

}  // namespace halyard
