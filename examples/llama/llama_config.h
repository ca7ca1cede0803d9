// The Llama model's configuration, read from a Hugging Face config.json.
//
// Keys and meanings are HF's (`hidden_size`, `num_hidden_layers`, ...), so a
// real checkpoint's config.json loads as is, in the forms transformers 4.4x
// (top-level rope_theta / rope_scaling, torch_dtype) and 5.x (rope_parameters,
// dtype) write. Every key is accounted for: read, known not to change the
// math (generation settings, token ids, dtype, ...), or a math key whose
// value must be the one Halyard implements (no biases, silu, no dropout, no
// sliding window, RoPE default or llama3, ...). Anything else is refused by
// name rather than ignored: an unknown key might change the model.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

// What tells another Hugging Face architecture with Llama's config keys
// (Qwen2: examples/qwen2/qwen2_config.cpp) from Llama: its names, and its
// rows of math keys. The neutral keys, the keys read into LlamaConfig and the
// RoPE reader are shared; only these rows differ.
struct HfArchitecture {
  std::string model_type;    // config.json's model_type must be this, or absent: "llama"
  std::string architecture;  // written by hf_config_json: "LlamaForCausalLM"
  std::string name;          // in errors: "which Halyard's Llama does not implement"
  std::string config_class;  // in errors: "legal: the keys of HF's LlamaConfig"
  struct MathKey {
    std::string key;
    std::string implemented;  // JSON of the one value implemented ("false"; "null": null or absent)
    std::string meaning;      // what another value means: "biases on the MLP projections"
  };
  std::vector<MathKey> math_keys;
  // Keys whose value cannot change the math once the math keys hold their
  // values (max_window_layers: which layers a sliding window, never used, would skip).
  std::vector<std::string> irrelevant_keys;
};
const HfArchitecture& llama_architecture();

// LlamaConfig::parse/load/to_json for any such architecture: parse reads the
// shared keys, accepts the neutral ones, and refuses by name a math key with
// another value or a key it does not know.
LlamaConfig parse_hf_config(const std::string& json_text, const std::string& what, const HfArchitecture& arch);
LlamaConfig load_hf_config(const std::string& path, const HfArchitecture& arch);
std::string hf_config_json(const LlamaConfig& c, const HfArchitecture& arch);

}  // namespace halyard::llama
