// The Llama model's configuration, read from a Hugging Face config.json.
//
// Keys and meanings are HF's (`hidden_size`, `num_hidden_layers`, ...), so a
// real checkpoint's config.json loads as is. Keys Halyard does not model are
// ignored, except those that would change the math (biases, another
// activation, an unknown rope scaling): those are rejected, never guessed.
#pragma once

#include <cstdint>
#include <string>

#include "dsl/graph.h"

namespace halyard::llama {

struct LlamaConfig {
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // HF default: hidden_size / num_attention_heads
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  RopeScaling rope_scaling;  // factor 0: none

  // Parses and validates config.json text; `what` names the source in errors.
  static LlamaConfig parse(const std::string& json_text, const std::string& what);
  static LlamaConfig load(const std::string& path);
  std::string to_json() const;
};

}  // namespace halyard::llama
