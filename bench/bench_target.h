// The Halide target the JIT benchmarks compile for: the one their build's
// HALYARD_BENCH_ISA chose (bench/CMakeLists.txt), the same as the AOT bench
// models', so that an ISA-limited run limits every kernel it measures.
#pragma once

#include <Halide.h>

#include <string>

namespace halyard::bench {

inline Halide::Target target() {
  const std::string t = HALYARD_BENCH_TARGET;
  return t == "host" ? Halide::get_host_target() : Halide::Target(t);
}

}  // namespace halyard::bench
