// The Llama example as a ModelBuilder (schedules/plan.h): what llama_aot,
// halyard-calibrate and halyard-plan hand to plan().
#pragma once

#include "examples/llama/llama_config.h"
#include "examples/llama/llama_model.h"
#include "schedules/plan.h"

namespace halyard::llama {

// A ModelBuilder from a config type (LlamaConfig or one derived from it)
// and the function that builds its graph: the config is recorded as
// published, whatever number of layers the search builds (a checkpoint must
// match it), and `layers` > 0 builds that many (the AutoSP search builds a
// few and extrapolates).
template <class Config, class Build>
ModelBuilder config_builder(Build build) {
  return [build](const std::string& config_path, int64_t batch, int64_t seq, int64_t layers) {
    auto cfg = Config::load(config_path);
    const std::string config_json = cfg.to_json();
    const int64_t configured = cfg.num_hidden_layers;
    if (layers > 0) cfg.num_hidden_layers = layers;
    return built_model(build(cfg, batch, seq), cfg.vocab_size, config_json, layers > 0 ? layers : configured);
  };
}

inline ModelBuilder llama_builder() {
  return config_builder<LlamaConfig>([](const LlamaConfig& c, int64_t batch, int64_t seq) { return build_llama(c, batch, seq); });
}

}  // namespace halyard::llama
