// config.json as Hugging Face writes it: the forms of transformers 4.43, 4.57
// and 5.x (tests/fixtures/hf_configs, written by make_hf_configs.py) load to
// the same LlamaConfig, and every key that would change the math to something
// Halyard does not implement is refused by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "dsl/error.h"
#include "examples/llama/llama_config.h"
#include "examples/qwen2/qwen2_config.h"

namespace halyard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string fixture(const std::string& name) {
  std::string path = std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/hf_configs/" + name;
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string error_of(const std::string& json) {
  try {
    llama::LlamaConfig::parse(json, "config.json");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

const char* kVersions[] = {"4.43", "4.57", "5.24"};

TEST(HfConfig, EveryTransformersFormLoadsTheSameLlama31) {
  std::string first;
  for (const char* v : kVersions) {
    std::string file = std::string("llama31.tf") + v + ".json";
    auto c = llama::LlamaConfig::parse(fixture(file), file);
    EXPECT_EQ(c.rope_theta, 500000.0) << file;
    EXPECT_EQ(c.rope_scaling.factor, 8.0) << file;
    EXPECT_EQ(c.rope_scaling.high_freq_factor, 4.0) << file;
    EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192) << file;
    EXPECT_EQ(c.head_dim, 16) << file;
    EXPECT_EQ(c.num_key_value_heads, 2) << file;
    if (first.empty()) first = c.to_json();
    EXPECT_EQ(c.to_json(), first) << file;
  }
}

TEST(HfConfig, EveryTransformersFormLoadsTheSamePlainTiedLlama) {
  std::string first;
  for (const char* v : kVersions) {
    std::string file = std::string("llama_plain_tied.tf") + v + ".json";
    auto c = llama::LlamaConfig::parse(fixture(file), file);
    EXPECT_EQ(c.rope_theta, 10000.0) << file;
    EXPECT_EQ(c.rope_scaling.factor, 0.0) << file;
    EXPECT_TRUE(c.tie_word_embeddings) << file;
    if (first.empty()) first = c.to_json();
    EXPECT_EQ(c.to_json(), first) << file;
  }
}

TEST(HfConfig, EveryTransformersFormLoadsTheSameQwen2) {
  std::string first;
  for (const char* v : kVersions) {
    std::string file = std::string("qwen2_tied.tf") + v + ".json";
    auto c = qwen2::Qwen2Config::parse(fixture(file), file);
    EXPECT_EQ(c.rope_theta, 1e6) << file;
    EXPECT_EQ(c.rms_norm_eps, 1e-6) << file;
    EXPECT_TRUE(c.tie_word_embeddings) << file;
    if (first.empty()) first = c.to_json();
    EXPECT_EQ(c.to_json(), first) << file;
  }
  // A Qwen2 config is not a Llama one, and the other way round.
  EXPECT_THAT(error_of(fixture("qwen2_tied.tf5.24.json")), HasSubstr("model_type is \"qwen2\""));
  try {
    qwen2::Qwen2Config::parse(fixture("llama31.tf5.24.json"), "llama31");
    ADD_FAILURE() << "a Llama config parsed as Qwen2";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), HasSubstr("model_type is \"llama\""));
  }
}

const char* kBase = R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256)";

std::string with(const std::string& extra) { return std::string(kBase) + ", " + extra + "}"; }

TEST(HfConfig, RopeParametersAndTopLevelKeysAgreeOrAreRefused) {
  auto c = llama::LlamaConfig::parse(with(R"("rope_theta": 5e5, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"})"), "c");
  EXPECT_EQ(c.rope_theta, 5e5);
  EXPECT_THAT(error_of(with(R"("rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"})")),
              AllOf(HasSubstr("rope_theta (10000.0) and rope_parameters.rope_theta (500000.0) disagree"),
                    HasSubstr("legal: the same value")));
  EXPECT_THAT(error_of(with(R"("rope_scaling": {"rope_type": "llama3", "factor": 8}, "rope_parameters": {"rope_type": "llama3", "factor": 4})")),
              HasSubstr("rope_scaling and rope_parameters"));
  EXPECT_THAT(error_of(with(R"("rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4})")),
              AllOf(HasSubstr("rope type \"yarn\""), HasSubstr("legal: \"default\" (plain RoPE) or \"llama3\"")));
  EXPECT_THAT(error_of(with(R"("rope_scaling": {"type": "linear", "factor": 2})")), HasSubstr("rope type \"linear\""));
}

TEST(HfConfig, DtypeInEitherSpellingIsNotMath) {
  EXPECT_EQ(error_of(with(R"("dtype": "bfloat16")")), "");
  EXPECT_EQ(error_of(with(R"("torch_dtype": "float16", "transformers_version": "4.43.4", "use_cache": true)")), "");
}

// head_dim null is head_dim absent, as in HF: hidden_size / heads, so heads
// must divide hidden_size. (Fuzzing found a config with 8 heads over a
// hidden_size of 6 and "head_dim": null accepted with head_dim 0; its input
// is tests/fuzz/corpus/llama_config/crash-head-dim-null-heads-not-dividing.json.)
TEST(HfConfig, HeadDimNullIsHiddenSizeOverHeads) {
  const std::string base = R"({"hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 96, "vocab_size": 32, )";
  EXPECT_EQ(llama::LlamaConfig::parse(base + R"("num_attention_heads": 4, "head_dim": null})", "config.json").head_dim, 16);
  for (const char* head_dim : {R"(, "head_dim": null)", ""})
    EXPECT_THAT(error_of(base + R"("num_attention_heads": 6)" + head_dim + "}"),
                AllOf(HasSubstr("hidden_size (64) is not a multiple of num_attention_heads (6) and no head_dim is given"),
                      HasSubstr("legal: give head_dim, or heads dividing hidden_size")));
}

TEST(HfConfig, EveryUnimplementedMathKeyIsRefusedByName) {
  struct Case { const char* json; const char* says; };
  const Case cases[] = {
      {R"("model_type": "mistral")", "model_type is \"mistral\": another architecture"},
      {R"("hidden_act": "gelu")", "hidden_act is \"gelu\""},
      {R"("attention_bias": true)", "attention_bias is true: biases on q/k/v/o projections"},
      {R"("mlp_bias": true)", "mlp_bias is true"},
      {R"("attention_dropout": 0.1)", "attention_dropout is 0.1: dropout"},
      {R"("sliding_window": 4096)", "sliding_window is 4096: sliding-window attention"},
      {R"("use_sliding_window": true)", "use_sliding_window is true"},
      {R"("partial_rotary_factor": 0.5)", "partial_rotary_factor is 0.5"},
      {R"("final_logit_softcapping": 30.0)", "final_logit_softcapping is 30.0"},
      {R"("quantization_config": {"quant_method": "gptq"})", "quantization_config is"},
      {R"("layer_types": ["full_attention", "sliding_attention"])", "layer_types is [\"full_attention\",\"sliding_attention\"]"},
      {R"("logits_scaling": 8.0)", "unknown key \"logits_scaling\" (8.0)"},
  };
  for (const Case& c : cases) {
    // The key replaces the base's own copy when it has one (model_type).
    std::string j = std::string(c.json).rfind("\"model_type\"", 0) == 0
                        ? std::string(R"({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "intermediate_size": 128, "vocab_size": 256, )") + c.json + "}"
                        : with(c.json);
    EXPECT_THAT(error_of(j), HasSubstr(c.says)) << c.json;
  }
  EXPECT_THAT(error_of(with(R"("attention_dropout": 0.1)")),
              HasSubstr("legal: 0.0 or absent. Training it as Llama would be a different model"));
  EXPECT_EQ(error_of(with(R"("attention_dropout": 0, "layer_types": ["full_attention", "full_attention"], "sliding_window": null)")), "");
}

}  // namespace
}  // namespace halyard
