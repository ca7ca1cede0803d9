// The Qwen2 decoder written in the DSL: the algorithm only, no schedule.
//
// Math matches Hugging Face's Qwen2ForCausalLM: Llama's block with biases on
// the q, k and v projections. Parameters carry HF's state-dict names in HF's
// order, and HF's memory layout (q_proj.weight's f32[heads, head_dim, model]
// is the bytes of HF's [heads*head_dim, hidden]; q_proj.bias's f32[heads,
// head_dim] those of HF's [heads*head_dim]). Positions are an input, so that a
// sharded schedule can feed each rank global positions.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dsl/graph.h"
#include "examples/qwen2/qwen2_config.h"

namespace halyard::qwen2 {

struct Qwen2Graph {
  std::unique_ptr<Graph> graph = std::make_unique<Graph>();
  Value input_ids, position_ids, labels;  // i32[batch, seq]
  Value logits;                           // [batch, seq, vocab]
  Value loss;                             // scalar
  std::vector<Value> params;              // in HF state-dict order
  std::map<std::string, std::vector<int64_t>> hf_shapes;  // name -> HF tensor shape
};

// One decoder layer: x + attn(norm(x)), then + mlp(norm(.)). Adds the layer's
// parameters (model.layers.{layer}.*) to x's graph.
Value qwen2_block(const Qwen2Config& c, int layer, Value x, Value positions, DType dtype,
                  std::map<std::string, std::vector<int64_t>>* hf_shapes = nullptr);

// The whole causal LM with its cross-entropy loss over [batch, seq] tokens.
Qwen2Graph build_qwen2(const Qwen2Config& c, int64_t batch, int64_t seq, DType dtype = DType::f32);

}  // namespace halyard::qwen2
