// The Llama-3 decoder written in the DSL: the algorithm only, no schedule.
//
// Math matches Hugging Face's LlamaForCausalLM; parameters carry HF's state
// dict names, and their memory layout is HF's (q_proj's f32[heads, head_dim,
// model] is the same bytes as HF's [heads*head_dim, hidden]). Positions are an
// input, so that a sharded schedule can feed each rank global positions.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dsl/graph.h"
#include "examples/llama/llama_config.h"

namespace halyard::llama {

struct LlamaGraph {
  std::unique_ptr<Graph> graph = std::make_unique<Graph>();
  Value input_ids, position_ids, labels;  // i32[batch, seq]
  Value logits;                           // [batch, seq, vocab]
  Value loss;                             // scalar
  std::vector<Value> params;              // in HF state-dict order
  std::map<std::string, std::vector<int64_t>> hf_shapes;  // name -> HF tensor shape
};

// One decoder layer: x + attn(norm(x)), then + mlp(norm(.)). Adds the layer's
// parameters (model.layers.{layer}.*) to x's graph.
Value llama_block(const LlamaConfig& c, int layer, Value x, Value positions, DType dtype,
                  std::map<std::string, std::vector<int64_t>>* hf_shapes = nullptr);

// The whole causal LM with its cross-entropy loss over [batch, seq] tokens.
LlamaGraph build_llama(const LlamaConfig& c, int64_t batch, int64_t seq, DType dtype = DType::f32);

}  // namespace halyard::llama
