// The Qwen2 decoder in the DSL (see qwen2_model.h). Reads like the math.
#include "examples/qwen2/qwen2_model.h"

#include "dsl/ops.h"

namespace halyard::qwen2 {
namespace {

// Declares a parameter and records the shape HF stores it with: the first
// `split` axes flattened into rows, the rest into columns (none: 1-D).
Value weight(Graph& g, const std::string& name, DType dtype, std::vector<Axis> axes, size_t split,
             std::map<std::string, std::vector<int64_t>>* hf_shapes) {
  if (hf_shapes) {
    int64_t rows = 1, cols = 1;
    for (size_t i = 0; i < axes.size(); ++i) (i < split ? rows : cols) *= axes[i].size;
    (*hf_shapes)[name] = split < axes.size() ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{rows};
  }
  return param(g, name, dtype, std::move(axes));
}

}  // namespace

Value qwen2_block(const Qwen2Config& c, int layer, Value x, Value positions, DType dt,
                  std::map<std::string, std::vector<int64_t>>* hf) {
  Graph& g = *x.graph;
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const Axis model{"model", c.hidden_size}, heads{"heads", c.num_attention_heads},
      kv_heads{"kv_heads", c.num_key_value_heads}, head_dim{"head_dim", c.head_dim},
      ffn{"ffn", c.intermediate_size};

  // In HF's state-dict order: attention, MLP, then the two norms.
  Value wq = weight(g, p + "self_attn.q_proj.weight", dt, {heads, head_dim, model}, 2, hf);
  Value bq = weight(g, p + "self_attn.q_proj.bias", dt, {heads, head_dim}, 2, hf);
  Value wk = weight(g, p + "self_attn.k_proj.weight", dt, {kv_heads, head_dim, model}, 2, hf);
  Value bk = weight(g, p + "self_attn.k_proj.bias", dt, {kv_heads, head_dim}, 2, hf);
  Value wv = weight(g, p + "self_attn.v_proj.weight", dt, {kv_heads, head_dim, model}, 2, hf);
  Value bv = weight(g, p + "self_attn.v_proj.bias", dt, {kv_heads, head_dim}, 2, hf);
  Value wo = weight(g, p + "self_attn.o_proj.weight", dt, {model, heads, head_dim}, 1, hf);
  Value w_gate = weight(g, p + "mlp.gate_proj.weight", dt, {ffn, model}, 1, hf);
  Value w_up = weight(g, p + "mlp.up_proj.weight", dt, {ffn, model}, 1, hf);
  Value w_down = weight(g, p + "mlp.down_proj.weight", dt, {model, ffn}, 1, hf);
  Value ln1 = weight(g, p + "input_layernorm.weight", dt, {model}, 1, hf);
  Value ln2 = weight(g, p + "post_attention_layernorm.weight", dt, {model}, 1, hf);

  // Attention: [batch, seq, model] -> q [.., heads, head_dim], k/v [.., kv_heads, head_dim].
  // Values are labelled like HF's modules, so schedule rules can address them.
  auto scope = [&](const char* module) { g.set_name_prefix(p + module); };
  scope("input_layernorm");
  Value h = rms_norm(x, ln1, c.rms_norm_eps);
  scope("self_attn.q_proj");
  Value q = rope(bias_add(contract(h, wq, {"model"}), bq), positions, c.rope_theta, c.rope_scaling);
  scope("self_attn.k_proj");
  Value k = rope(bias_add(contract(h, wk, {"model"}), bk), positions, c.rope_theta, c.rope_scaling);
  scope("self_attn.v_proj");
  Value v = bias_add(contract(h, wv, {"model"}), bv);
  scope("self_attn");
  Value a = attention(q, k, v, positions);
  scope("self_attn.o_proj");
  Value o = contract(a, wo, {"heads", "head_dim"});
  scope("self_attn.residual");
  x = x + o;

  // SwiGLU MLP: down(silu(gate(h)) * up(h)).
  scope("post_attention_layernorm");
  h = rms_norm(x, ln2, c.rms_norm_eps);
  scope("mlp.gate_proj");
  Value gate = contract(h, w_gate, {"model"});
  scope("mlp.up_proj");
  Value up = contract(h, w_up, {"model"});
  scope("mlp.act_fn");
  Value m = silu(gate) * up;
  scope("mlp.down_proj");
  Value down = contract(m, w_down, {"ffn"});
  scope("mlp.residual");
  x = x + down;
  g.set_name_prefix("");
  return x;
}

Qwen2Graph build_qwen2(const Qwen2Config& c, int64_t batch, int64_t seq, DType dt) {
  Qwen2Graph m;
  Graph& g = *m.graph;
  const Axis B{"batch", batch}, S{"seq", seq}, model{"model", c.hidden_size}, vocab{"vocab", c.vocab_size};
  m.input_ids = input(g, "input_ids", DType::i32, {B, S});
  m.position_ids = input(g, "position_ids", DType::i32, {B, S});
  m.labels = input(g, "labels", DType::i32, {B, S});

  Value embed = weight(g, "model.embed_tokens.weight", dt, {vocab, model}, 1, &m.hf_shapes);
  g.set_name_prefix("model.embed_tokens");
  Value x = embedding(embed, m.input_ids);
  for (int layer = 0; layer < c.num_hidden_layers; ++layer)
    x = qwen2_block(c, layer, x, m.position_ids, dt, &m.hf_shapes);
  Value norm = weight(g, "model.norm.weight", dt, {model}, 1, &m.hf_shapes);
  // Qwen2's small models (0.5B to 3B) tie the LM head to the embedding.
  Value head = c.tie_word_embeddings ? embed : weight(g, "lm_head.weight", dt, {vocab, model}, 1, &m.hf_shapes);
  g.set_name_prefix("model.norm");
  Value normed = rms_norm(x, norm, c.rms_norm_eps);
  g.set_name_prefix("lm_head");
  m.logits = contract(normed, head, {"model"});
  m.loss = cross_entropy(m.logits, m.labels);
  g.set_name_prefix("");
  m.params = g.params();
  return m;
}

}  // namespace halyard::qwen2
