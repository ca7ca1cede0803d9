// The Llama example as a ModelBuilder (schedules/plan.h): what llama_aot,
// halyard-calibrate and halyard-plan hand to plan().
#pragma once

#include "examples/llama/llama_config.h"
#include "examples/llama/llama_model.h"
#include "schedules/plan.h"

namespace halyard::llama {

inline ModelBuilder llama_builder() {
  return [](const std::string& config_path, int64_t batch, int64_t seq, int64_t layers) {
    auto cfg = LlamaConfig::load(config_path);
    const int64_t configured = cfg.num_hidden_layers;
    if (layers > 0) cfg.num_hidden_layers = layers;
    auto m = build_llama(cfg, batch, seq);
    BuiltModel b;
    b.graph = std::move(m.graph);
    b.loss = m.loss;
    b.params = m.params;
    b.hf_shapes = m.hf_shapes;
    b.vocab = cfg.vocab_size;
    cfg.num_hidden_layers = configured;
    b.config_json = cfg.to_json();
    b.layers = layers > 0 ? layers : configured;
    return b;
  };
}

}  // namespace halyard::llama
