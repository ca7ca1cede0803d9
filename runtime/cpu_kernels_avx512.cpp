// The CPU library kernels (attention_cpu_impl.h, gemm_cpu_impl.h) compiled for
// one vector ISA (flags: runtime/CMakeLists.txt).
#define HALYARD_ISA avx512
#include "runtime/attention_cpu_impl.h"
#include "runtime/gemm_cpu_impl.h"
