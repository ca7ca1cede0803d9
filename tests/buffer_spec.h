// A step program's buffer description for tests of the collectives
// (runtime/step_program.h): an arena value of `type` and `shape`.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/step_program.h"

namespace halyard::testing {

inline runtime::BufferSpec buffer_spec(const char* name, runtime::ElemType type, const std::vector<int64_t>& shape) {
  runtime::BufferSpec s{};
  s.name = name;
  s.type = type;
  s.rank = static_cast<int>(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) s.shape[d] = shape[d];
  s.storage = runtime::Storage::Arena;
  return s;
}

}  // namespace halyard::testing
