// Qwen2's rows of the shared Hugging Face config reader (see qwen2_config.h).
#include "examples/qwen2/qwen2_config.h"

namespace halyard::qwen2 {

const llama::HfArchitecture& qwen2_architecture() {
  static const llama::HfArchitecture arch = {
      "qwen2", "Qwen2ForCausalLM", "Qwen2", "Qwen2Config",
      {
          {"hidden_act", "\"silu\"", "another MLP activation (Qwen2's SwiGLU uses silu)"},
          // Qwen2 always has q/k/v biases and no o_proj bias; HF's Qwen2
          // ignores the key, so a config saying false is contradicting its weights.
          {"attention_bias", "true", "no biases on q/k/v (Qwen2 has them)"},
          {"mlp_bias", "false", "biases on the MLP projections"},
          {"attention_dropout", "0.0", "dropout on attention probabilities"},
          {"use_sliding_window", "false", "sliding-window attention"},
          {"partial_rotary_factor", "1.0", "RoPE on part of each head"},
          {"attn_logit_softcapping", "null", "soft-capped attention logits"},
          {"final_logit_softcapping", "null", "soft-capped output logits"},
          {"quantization_config", "null", "quantized weights"},
          {"pruned_heads", "{}", "pruned attention heads"},
      },
      // With use_sliding_window false, the window's size and the layers it
      // would start at are never used (layer_types, when given, is checked).
      {"sliding_window", "max_window_layers"}};
  return arch;
}

Qwen2Config Qwen2Config::parse(const std::string& json_text, const std::string& what) {
  return {llama::parse_hf_config(json_text, what, qwen2_architecture())};
}

Qwen2Config Qwen2Config::load(const std::string& path) {
  return {llama::load_hf_config(path, qwen2_architecture())};
}

std::string Qwen2Config::to_json() const { return llama::hf_config_json(*this, qwen2_architecture()); }

}  // namespace halyard::qwen2
