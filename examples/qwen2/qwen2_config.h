// The Qwen2 model's configuration, read from a Hugging Face config.json.
//
// Qwen2's config has Llama's keys and meanings (examples/llama/llama_config.h
// reads them, in the forms transformers 4.4x and 5.x write) and the same
// fields; what differs is its rows of math keys: model_type "qwen2", and the
// biases on q/k/v that every Qwen2 has (attention_bias, when a config gives
// it, must say so). Sliding-window attention is refused unless
// use_sliding_window is false; then sliding_window and max_window_layers
// say nothing about the math (published Qwen2.5 configs carry both).
// YaRN rope scaling (Qwen2.5's recipe past 32k) is refused by the shared
// RoPE reader: only default and llama3 RoPE are implemented.
#pragma once

#include <string>

#include "examples/llama/llama_config.h"

namespace halyard::qwen2 {

struct Qwen2Config : llama::LlamaConfig {
  static Qwen2Config parse(const std::string& json_text, const std::string& what);
  static Qwen2Config load(const std::string& path);
  std::string to_json() const;  // what a generated library records and a checkpoint carries
};

const llama::HfArchitecture& qwen2_architecture();

}  // namespace halyard::qwen2
