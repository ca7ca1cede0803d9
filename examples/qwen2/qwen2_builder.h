// The Qwen2 example as a ModelBuilder (schedules/plan.h): what qwen2_aot and
// the tests hand to plan().
#pragma once

#include "examples/llama/llama_builder.h"
#include "examples/qwen2/qwen2_config.h"
#include "examples/qwen2/qwen2_model.h"

namespace halyard::qwen2 {

inline ModelBuilder qwen2_builder() {
  return llama::config_builder<Qwen2Config>([](const Qwen2Config& c, int64_t batch, int64_t seq) { return build_qwen2(c, batch, seq); });
}

}  // namespace halyard::qwen2
