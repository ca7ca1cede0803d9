// One test per user mistake in building or running a model: each asserts the
// message names the tensor, the types, the rule broken and what is legal.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dsl/autodiff.h"
#include "dsl/error.h"
#include "dsl/interpreter.h"
#include "dsl/ops.h"
#include "examples/llama/llama_config.h"

namespace halyard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a UserError";
  return "";
}

const Axis B{"batch", 2}, S{"seq", 8}, M{"model", 16}, H{"heads", 6}, KV{"kv_heads", 4}, D{"head_dim", 4};

TEST(Errors, ContractionOverMismatchedAxisSizes) {
  Graph g;
  Value x = input(g, "x", DType::f32, {B, S, M});
  Value w = param(g, "w", DType::f32, {{"ffn", 32}, {"model", 12}});
  EXPECT_THAT(error_of([&] { contract(x, w, {"model"}); }),
              AllOf(HasSubstr("contraction over axes that do not match"), HasSubstr("axis \"model\" is 16"),
                    HasSubstr("but 12 in %1 \"w\" f32[ffn=32, model=12]"),
                    HasSubstr("legal: axes with the same name must have the same size")));
}

TEST(Errors, ContractionOverAxisOnlyOneOperandHas) {
  Graph g;
  Value x = input(g, "x", DType::f32, {B, S, M});
  Value w = param(g, "w", DType::f32, {{"ffn", 32}, {"vocab", 16}});
  EXPECT_THAT(error_of([&] { contract(x, w, {"model"}); }),
              AllOf(HasSubstr("contraction over axes that do not match"),
                    HasSubstr("\"model\" is not an axis of %1 \"w\" f32[ffn=32, vocab=16]"),
                    HasSubstr("legal: sum over axes both operands have")));
  EXPECT_THAT(error_of([&] { contract_to(x, w, {"batch", "seq", "ffn", "vocab"}); }),
              AllOf(HasSubstr("axis \"model\" of %0 \"x\" f32[batch=2, seq=8, model=16] is summed over"),
                    HasSubstr("has no such axis")));
}

TEST(Errors, HeadsNotMultipleOfKvHeads) {
  Graph g;
  Value q = input(g, "q", DType::f32, {B, S, H, D});
  Value k = input(g, "k", DType::f32, {B, S, KV, D});
  Value v = input(g, "v", DType::f32, {B, S, KV, D});
  Value pos = input(g, "pos", DType::i32, {B, S});
  EXPECT_THAT(error_of([&] { attention(q, k, v, pos); }),
              AllOf(HasSubstr("error: attention(%0 \"q\" f32[batch=2, seq=8, heads=6, head_dim=4]"),
                    HasSubstr("heads (6) is not a multiple of kv_heads (4)"),
                    HasSubstr("legal: kv_heads dividing 6: 1, 2, 3, 6.")));
}

TEST(Errors, UnknownAxis) {
  Graph g;
  EXPECT_THAT(error_of([&] { input(g, "x", DType::f32, {{"sequence", 8}, M}); }),
              AllOf(HasSubstr("input \"x\" f32[sequence=8, model=16]"), HasSubstr("unknown axis \"sequence\""),
                    HasSubstr("legal axes: batch, seq, kv_seq, heads, kv_heads, head_dim, model, ffn, vocab")));
}

TEST(Errors, DuplicatedAxis) {
  Graph g;
  EXPECT_THAT(error_of([&] { param(g, "w", DType::f32, {M, M}); }),
              AllOf(HasSubstr("parameter \"w\" f32[model=16, model=16]"), HasSubstr("axis \"model\" appears twice"),
                    HasSubstr("kv_seq")));
}

TEST(Errors, NonPositiveAxisSize) {
  Graph g;
  EXPECT_THAT(error_of([&] { input(g, "x", DType::f32, {{"seq", 0}}); }),
              HasSubstr("axis \"seq\" has size 0; sizes must be positive"));
}

TEST(Errors, AddShapeMismatch) {
  Graph g;
  Value a = input(g, "a", DType::f32, {B, S, M});
  Value b = input(g, "b", DType::f32, {B, S, {"ffn", 16}});
  EXPECT_THAT(error_of([&] { a + b; }),
              AllOf(HasSubstr("error: add(%0 \"a\" f32[batch=2, seq=8, model=16], %1 \"b\" f32[batch=2, seq=8, ffn=16])"),
                    HasSubstr("operands must have the same axes, sizes and order"), HasSubstr("legal: add is elementwise")));
}

TEST(Errors, MulShapeMismatch) {
  Graph g;
  Value a = input(g, "a", DType::f32, {B, S, M});
  Value b = input(g, "b", DType::f32, {B, {"seq", 4}, M});
  EXPECT_THAT(error_of([&] { a* b; }),
              AllOf(HasSubstr("error: mul("), HasSubstr("f32[batch=2, seq=8, model=16] vs f32[batch=2, seq=4, model=16]")));
}

TEST(Errors, MixedDtypes) {
  Graph g;
  Value a = input(g, "a", DType::f32, {B, S, M});
  Value b = input(g, "b", DType::f64, {B, S, M});
  EXPECT_THAT(error_of([&] { a + b; }),
              AllOf(HasSubstr("operands have different dtypes: f32 vs f64"), HasSubstr("legal: convert one operand")));
}

TEST(Errors, OpOnWrongDtype) {
  Graph g;
  Value ids = input(g, "ids", DType::i32, {B, S});
  Value w = param(g, "norm", DType::f32, {S});
  EXPECT_THAT(error_of([&] { rms_norm(ids, w, 1e-5); }),
              AllOf(HasSubstr("operand %0 \"ids\" i32[batch=2, seq=8] has dtype i32; rms_norm computes in floating point"),
                    HasSubstr("legal: f32 or f64")));
  Value table = param(g, "table", DType::f32, {{"vocab", 10}, M});
  Value fids = input(g, "fids", DType::f32, {B, S});
  EXPECT_THAT(error_of([&] { embedding(table, fids); }),
              AllOf(HasSubstr("token ids %3 \"fids\" f32[batch=2, seq=8] has dtype f32"), HasSubstr("legal: i32")));
  EXPECT_THAT(error_of([&] { param(g, "int_weight", DType::i32, {M}); }),
              HasSubstr("parameters are trained by gradient and must be floating point"));
}

TEST(Errors, CrossEntropyLabelsLayout) {
  Graph g;
  Value logits = input(g, "logits", DType::f32, {B, S, {"vocab", 10}});
  Value labels = input(g, "labels", DType::i32, {S, B});
  EXPECT_THAT(error_of([&] { cross_entropy(logits, labels); }),
              AllOf(HasSubstr("must have the logits' axes without vocab"), HasSubstr("legal: labels i32[batch=2, seq=8]")));
}

TEST(Errors, GradOfNonScalar) {
  Graph g;
  Value x = param(g, "x", DType::f32, {B, S});
  EXPECT_THAT(error_of([&] { grad(silu(x), {x}); }),
              AllOf(HasSubstr("the loss must be a floating-point scalar"), HasSubstr("f32[batch=2, seq=8]")));
}

TEST(Errors, DuplicateParameterName) {
  Graph g;
  param(g, "w", DType::f32, {M});
  EXPECT_THAT(error_of([&] { param(g, "w", DType::f32, {M}); }),
              AllOf(HasSubstr("the name is already used by %0 \"w\""), HasSubstr("unique name")));
}

TEST(Errors, TokenIdOutsideVocabulary) {
  Graph g;
  Value table = param(g, "table", DType::f32, {{"vocab", 10}, M});
  Value ids = input(g, "input_ids", DType::i32, {{"batch", 1}, {"seq", 3}});
  embedding(table, ids);
  Interpreter<float> in(g);
  in.set("table", std::vector<float>(160, 0.f));
  in.set_int("input_ids", {1, 2, 10});
  EXPECT_THAT(error_of([&] { in.run(); }),
              AllOf(HasSubstr("token id 10 at input_ids[batch=0, seq=2] is outside the vocabulary"),
                    HasSubstr("legal ids: 0 .. 9 (vocab = 10)")));
}

TEST(Errors, LabelOutsideVocabulary) {
  Graph g;
  Value z = input(g, "logits", DType::f32, {{"batch", 1}, {"seq", 2}, {"vocab", 4}});
  Value labels = input(g, "labels", DType::i32, {{"batch", 1}, {"seq", 2}});
  cross_entropy(z, labels);
  Interpreter<float> in(g);
  in.set("logits", std::vector<float>(8, 0.f));
  in.set_int("labels", {-100, -3});
  EXPECT_THAT(error_of([&] { in.run(); }),
              AllOf(HasSubstr("label -3 at labels[batch=0, seq=1]"), HasSubstr("or -100 to ignore the token")));
}

TEST(Errors, UnboundInput) {
  Graph g;
  Value x = input(g, "x", DType::f32, {S});
  silu(x);
  Interpreter<float> in(g);
  EXPECT_THAT(error_of([&] { in.run(); }), HasSubstr("input \"x\" f32[seq=8] was not set"));
  EXPECT_THAT(error_of([&] { in.set("x", {1.f}); }), HasSubstr("needs 8 values, got 1"));
}

// ---- config.json ----

std::string config_error(const std::string& json) {
  return error_of([&] { llama::LlamaConfig::parse(json, "config.json"); });
}

const char* kGood = R"({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
  "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "rope_theta": 10000.0,
  "rms_norm_eps": 1e-5, "tie_word_embeddings": false})";

TEST(Errors, ConfigGoodParses) {
  auto c = llama::LlamaConfig::parse(kGood, "config.json");
  EXPECT_EQ(c.head_dim, 8);  // HF's default: hidden / heads
  auto again = llama::LlamaConfig::parse(c.to_json(), "round trip");
  EXPECT_EQ(again.to_json(), c.to_json());
}

TEST(Errors, ConfigNotJson) {
  EXPECT_THAT(config_error("{\"hidden_size\": 64,"),
              AllOf(HasSubstr("config \"config.json\" is not valid JSON"), HasSubstr("Hugging Face config.json")));
  EXPECT_THAT(config_error("[1, 2]"), HasSubstr("is JSON array, not an object"));
}

TEST(Errors, ConfigMissingKey) {
  EXPECT_THAT(config_error(R"({"hidden_size": 64})"), AllOf(HasSubstr("missing key \"num_hidden_layers\""),
                                                            HasSubstr("legal: a positive integer")));
}

TEST(Errors, ConfigWrongType) {
  std::string j = kGood;
  j.replace(j.find("\"vocab_size\": 256"), 17, "\"vocab_size\": \"256\"");
  EXPECT_THAT(config_error(j), HasSubstr("key \"vocab_size\" is \"256\".\nlegal: a positive integer."));
}

TEST(Errors, ConfigHeadsNotMultipleOfKvHeads) {
  std::string j = kGood;
  j.replace(j.find("\"num_key_value_heads\": 2"), 24, "\"num_key_value_heads\": 3");
  EXPECT_THAT(config_error(j), AllOf(HasSubstr("num_attention_heads (8) is not a multiple of num_key_value_heads (3)"),
                                     HasSubstr("legal: num_key_value_heads dividing num_attention_heads")));
}

TEST(Errors, ConfigUnsupportedMath) {
  std::string j = kGood;
  j.insert(1, "\"hidden_act\": \"gelu\", ");
  EXPECT_THAT(config_error(j), AllOf(HasSubstr("hidden_act is \"gelu\": another MLP activation"),
                                     HasSubstr("legal: \"silu\" or absent")));
  j = kGood;
  j.insert(1, "\"attention_bias\": true, ");
  EXPECT_THAT(config_error(j), HasSubstr("attention_bias is true"));
  j = kGood;
  j.insert(1, "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}, ");
  EXPECT_THAT(config_error(j), AllOf(HasSubstr("rope type \"yarn\""), HasSubstr("not implemented"), HasSubstr("\"llama3\"")));
}

TEST(Errors, ConfigLlama31RopeScalingAccepted) {
  std::string j = kGood;
  j.insert(1, R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, )");
  EXPECT_EQ(llama::LlamaConfig::parse(j, "config.json").rope_scaling.factor, 8.0);
}

TEST(Errors, ConfigMissingFile) {
  EXPECT_THAT(error_of([] { llama::LlamaConfig::load("/nonexistent/config.json"); }),
              HasSubstr("cannot open config \"/nonexistent/config.json\""));
}

}  // namespace
}  // namespace halyard
