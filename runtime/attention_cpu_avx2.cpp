// attention_cpu_impl.h compiled for one vector ISA (flags: runtime/CMakeLists.txt).
#define HALYARD_ISA avx2
#include "runtime/attention_cpu_impl.h"
