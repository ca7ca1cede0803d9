// Finite-difference gradient checks in f64 for every differentiable op, a
// whole Llama block and the whole tiny model: max relative error <= 1e-6.
#include <gtest/gtest.h>

#include "examples/llama/llama_model.h"
#include "examples/qwen2/qwen2_model.h"
#include "schedules/schedule.h"
#include "schedules/tiling.h"
#include "tests/dsl/gradcheck.h"

namespace halyard {
namespace {

using testing::check_gradients;
using testing::GradcheckOptions;
using testing::iota_positions;

constexpr double kTol = 1e-6;
const Axis B{"batch", 2}, S{"seq", 5}, M{"model", 6}, F{"ffn", 4}, H{"heads", 4}, KV{"kv_heads", 2},
    D{"head_dim", 4}, V{"vocab", 7};

TEST(Gradcheck, Embedding) {
  Graph g;
  Value table = param(g, "table", DType::f64, {V, M});
  Value ids = input(g, "ids", DType::i32, {B, S});
  GradcheckOptions o;
  o.ints["ids"] = {0, 3, 3, 6, 1, 2, 2, 2, 5, 0};  // repeats: scatter-add must accumulate
  EXPECT_LE(check_gradients(embedding(table, ids), {table}, o), kTol);
}

TEST(Gradcheck, ContractLinear) {
  Graph g;
  Value x = param(g, "x", DType::f64, {B, S, M});
  Value w = param(g, "w", DType::f64, {F, M});
  EXPECT_LE(check_gradients(contract(x, w, {"model"}), {x, w}), kTol);
}

TEST(Gradcheck, ContractMultiAxisAndBatched) {
  Graph g;
  Value a = param(g, "a", DType::f64, {B, S, H, D});
  Value w = param(g, "w", DType::f64, {M, H, D});
  EXPECT_LE(check_gradients(contract(a, w, {"heads", "head_dim"}), {a, w}), kTol);
  // batch kept on both sides, output reordered
  Value p = param(g, "p", DType::f64, {B, H, S});
  Value q = param(g, "q", DType::f64, {B, S, D});
  EXPECT_LE(check_gradients(contract_to(p, q, {"head_dim", "batch", "heads"}), {p, q}), kTol);
}

TEST(Gradcheck, AddMul) {
  Graph g;
  Value a = param(g, "a", DType::f64, {B, S, M});
  Value b = param(g, "b", DType::f64, {B, S, M});
  EXPECT_LE(check_gradients((a + b) * a, {a, b}), kTol);
}

TEST(Gradcheck, BiasAdd) {
  Graph g;
  Value x = param(g, "x", DType::f64, {B, S, H, D});
  Value b = param(g, "b", DType::f64, {H, D});  // a projection's bias: repeated over batch and seq
  EXPECT_LE(check_gradients(bias_add(x, b), {x, b}), kTol);
  Value c = param(g, "c", DType::f64, {D, B});  // axes apart and out of x's order
  EXPECT_LE(check_gradients(bias_add(x, c) * x, {x, c}), kTol);
}

// A bias inside a sequence-tiled chain (schedules/tiling.h): each tile adds
// the whole bias, and its gradient is the sum of the tiles' partial sums.
TEST(Gradcheck, BiasAddInSequenceTiles) {
  Graph src;
  Value x = input(src, "x", DType::f64, {B, S, M});
  Value labels = input(src, "labels", DType::i32, {B, S});
  Value w1 = param(src, "w1", DType::f64, {F, M});
  Value b = param(src, "b", DType::f64, {F});
  Value w2 = param(src, "w2", DType::f64, {V, F});
  Value loss = cross_entropy(contract(silu(bias_add(contract(x, w1, {"model"}), b)), w2, {"ffn"}), labels);
  RebuiltGraph tiled = tile_sequence(src, loss.id, 2);  // seq 5: tiles of 2, 2 and 1
  int bias_adds = 0;
  for (const Node& n : tiled.graph->nodes()) bias_adds += n.op == Op::BiasAdd;
  EXPECT_EQ(bias_adds, 3);
  GradcheckOptions o;
  o.ints["labels"] = {1, -100, 6, 0, 3, 2, 5, 2, 2, 5};
  EXPECT_LE(check_gradients(tiled.loss, tiled.params, o), kTol);
}

TEST(Gradcheck, Silu) {
  Graph g;
  Value x = param(g, "x", DType::f64, {B, S, F});
  EXPECT_LE(check_gradients(silu(x), {x}), kTol);
}

TEST(Gradcheck, RmsNorm) {
  Graph g;
  Value x = param(g, "x", DType::f64, {B, S, M});
  Value w = param(g, "w", DType::f64, {M});
  EXPECT_LE(check_gradients(rms_norm(x, w, 1e-5), {x, w}), kTol);
}

TEST(Gradcheck, RmsNormOverInnerAxis) {
  Graph g;
  Value x = param(g, "x", DType::f64, {B, M, S});  // normalized axis not last
  Value w = param(g, "w", DType::f64, {M});
  EXPECT_LE(check_gradients(rms_norm(x, w, 1e-6), {x, w}), kTol);
}

TEST(Gradcheck, Rope) {
  Graph g;
  Value x = param(g, "x", DType::f64, {B, S, H, D});
  Value pos = input(g, "pos", DType::i32, {B, S});
  GradcheckOptions o;
  o.ints["pos"] = {0, 1, 2, 3, 4, 100, 101, 102, 103, 104};  // global positions
  EXPECT_LE(check_gradients(rope(x, pos, 10000.0), {x}, o), kTol);
  RopeScaling llama3{8.0, 1.0, 4.0, 8192};
  EXPECT_LE(check_gradients(rope(x, pos, 500000.0, llama3), {x}, o), kTol);
}

TEST(Gradcheck, GroupedQueryCausalAttention) {
  Graph g;
  Value q = param(g, "q", DType::f64, {B, S, H, D});
  Value k = param(g, "k", DType::f64, {B, S, KV, D});
  Value v = param(g, "v", DType::f64, {B, S, KV, D});
  Value pos = input(g, "pos", DType::i32, {B, S});
  GradcheckOptions o;
  o.ints["pos"] = {0, 1, 2, 3, 4, 7, 3, 9, 0, 5};  // second row: positions out of order
  EXPECT_LE(check_gradients(attention(q, k, v, pos), {q, k, v}, o), kTol);
}

TEST(Gradcheck, CrossEntropyWithIgnoredTokens) {
  Graph g;
  Value z = param(g, "z", DType::f64, {B, S, V});
  Value labels = input(g, "labels", DType::i32, {B, S});
  GradcheckOptions o;
  o.ints["labels"] = {1, -100, 6, 0, 3, -100, -100, 2, 2, 5};
  EXPECT_LE(check_gradients(cross_entropy(z, labels), {z}, o), kTol);
}

llama::LlamaConfig micro_config(bool tied) {
  llama::LlamaConfig c;
  c.hidden_size = 8;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.intermediate_size = 12;
  c.vocab_size = 11;
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

TEST(Gradcheck, LlamaBlock) {
  Graph g;
  auto c = micro_config(false);
  Value x = param(g, "x", DType::f64, {{"batch", 2}, {"seq", 5}, {"model", c.hidden_size}});
  Value pos = input(g, "position_ids", DType::i32, {{"batch", 2}, {"seq", 5}});
  Value y = llama::llama_block(c, 0, x, pos, DType::f64);
  GradcheckOptions o;
  o.ints["position_ids"] = iota_positions(2, 5);
  EXPECT_LE(check_gradients(y, g.params(), o), kTol);
}

void check_whole_model(const llama::LlamaConfig& c, int per_tensor = 24, GradOptions grad_options = {}) {
  auto m = llama::build_llama(c, 2, 6, DType::f64);
  GradcheckOptions o;
  o.max_elements = per_tensor;
  o.grad_options = grad_options;
  o.ints["input_ids"] = {1, 4, 4, 9, 10, 0, 3, 3, 7, 2, 8, 5};
  o.ints["labels"] = {4, 4, 9, 10, -100, 3, 3, 7, 2, 8, 5, 6};
  o.ints["position_ids"] = iota_positions(2, 6);
  std::mt19937 rng(7);
  for (const Value& p : m.params) {
    // std 1/sqrt(size of the last axis, ~fan-in) keeps activations O(1) at any width
    std::normal_distribution<double> normal(0.0, p.type().rank() == 1 ? 0.5 : 1.0 / std::sqrt(double(p.type().axes.back().size)));
    std::vector<double> w(static_cast<size_t>(p.type().numel()));
    for (double& x : w) x = (p.type().rank() == 1 ? 1.0 : 0.0) + normal(rng);
    o.floats[p.node().name] = w;
  }
  EXPECT_LE(check_gradients(m.loss, m.params, o), kTol);
}

TEST(Gradcheck, WholeMicroModel) { check_whole_model(micro_config(false)); }

// Qwen2 (examples/qwen2): Llama's block with q/k/v biases.
TEST(Gradcheck, Qwen2Block) {
  Graph g;
  qwen2::Qwen2Config c;
  static_cast<llama::LlamaConfig&>(c) = micro_config(false);
  c.rope_theta = 1e6;
  Value x = param(g, "x", DType::f64, {{"batch", 2}, {"seq", 5}, {"model", c.hidden_size}});
  Value pos = input(g, "position_ids", DType::i32, {{"batch", 2}, {"seq", 5}});
  Value y = qwen2::qwen2_block(c, 0, x, pos, DType::f64);
  GradcheckOptions o;
  o.ints["position_ids"] = iota_positions(2, 5);
  EXPECT_LE(check_gradients(y, g.params(), o), kTol);
}
TEST(Gradcheck, WholeMicroModelTiedEmbeddings) { check_whole_model(micro_config(true)); }
// Activation checkpointing: the backward reads clones recomputed from the residual stream.
TEST(Gradcheck, WholeMicroModelCheckpointed) {
  check_whole_model(micro_config(false), 24, GradOptions{Schedule::named("checkpoint").rematerialize()});
}
// The demo's own config (examples/llama/configs/tiny.json) at a short sequence.
TEST(Gradcheck, WholeTinyModel) {
  check_whole_model(llama::LlamaConfig::load(HALYARD_SOURCE_DIR "/examples/llama/configs/tiny.json"), 6);
}

}  // namespace
}  // namespace halyard
