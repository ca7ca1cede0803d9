// A user's model and its generator: one transformer layer (RMSNorm, RoPE,
// causal attention with as many key/value heads as query heads, an MLP, a
// language-model head), written with Halyard's
// public DSL ops. halyard_add_model runs this program at build time.
#include <fstream>
#include <nlohmann/json.hpp>

#include "dsl/ops.h"
#include "generators/aot.h"

using namespace halyard;

namespace {

BuiltModel build(const std::string& config_path, int64_t batch, int64_t seq, int64_t /*layers*/) {
  std::ifstream in(config_path);
  const auto c = nlohmann::json::parse(in);
  const Axis B{"batch", batch}, S{"seq", seq}, vocab{"vocab", c["vocab_size"]}, model{"model", c["hidden_size"]},
      heads{"heads", c["num_attention_heads"]}, kv_heads{"kv_heads", c["num_attention_heads"]}, head_dim{"head_dim", c["head_dim"]}, ffn{"ffn", c["intermediate_size"]};
  BuiltModel m;
  m.graph = std::make_unique<Graph>();
  Graph& g = *m.graph;
  // Parameters, each with the 2-D (or 1-D) shape a checkpoint stores it in.
  auto weight = [&](const std::string& name, std::vector<Axis> axes, size_t rows_axes) {
    int64_t rows = 1, cols = 1;
    for (size_t i = 0; i < axes.size(); ++i) (i < rows_axes ? rows : cols) *= axes[i].size;
    m.hf_shapes[name] = rows_axes < axes.size() ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{rows};
    return param(g, name, DType::f32, std::move(axes));
  };
  Value ids = input(g, "input_ids", DType::i32, {B, S}), pos = input(g, "position_ids", DType::i32, {B, S}),
        labels = input(g, "labels", DType::i32, {B, S});
  Value embed = weight("embed.weight", {vocab, model}, 1), norm1 = weight("norm1.weight", {model}, 1),
        wq = weight("q.weight", {heads, head_dim, model}, 2), wk = weight("k.weight", {kv_heads, head_dim, model}, 2),
        wv = weight("v.weight", {kv_heads, head_dim, model}, 2), wo = weight("o.weight", {model, heads, head_dim}, 1),
        norm2 = weight("norm2.weight", {model}, 1), w_in = weight("mlp_in.weight", {ffn, model}, 1),
        w_out = weight("mlp_out.weight", {model, ffn}, 1), norm_f = weight("norm_f.weight", {model}, 1),
        head = weight("head.weight", {vocab, model}, 1);

  Value x = embedding(embed, ids);
  Value h = rms_norm(x, norm1, 1e-5);
  Value q = rope(contract(h, wq, {"model"}), pos, 10000.0), k = rope(contract(h, wk, {"model"}), pos, 10000.0);
  x = x + contract(attention(q, k, contract(h, wv, {"model"}), pos), wo, {"heads", "head_dim"});
  x = x + contract(silu(contract(rms_norm(x, norm2, 1e-5), w_in, {"model"})), w_out, {"ffn"});
  m.loss = cross_entropy(contract(rms_norm(x, norm_f, 1e-5), head, {"model"}), labels);

  m.params = g.params();
  m.vocab = vocab.size;
  m.config_json = c.dump();
  m.layers = 1;
  return m;
}

}  // namespace

int main(int argc, char** argv) { return aot_main(argc, argv, build); }
