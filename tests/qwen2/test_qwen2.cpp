// The Qwen2 example against its independent PyTorch oracle
// (tests/fixtures/make_qwen2_fixture.py), as Llama's tests check Llama:
// - the reference interpreter: loss and every gradient within 1e-4 relative
//   in f32 and 1e-6 in f64, untied and tied;
// - the generated libraries (default and sequence-tiled schedules), their
//   weights loaded from a Hugging Face folder (model.safetensors +
//   config.json) through runtime::load_checkpoint: loss and every gradient
//   within 1e-4 in f32, and within 1e-4 of the interpreter.
// Each prints its errors per tensor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>

#include "dsl/autodiff.h"
#include "dsl/error.h"
#include "dsl/interpreter.h"
#include "dsl/ops.h"
#include "examples/qwen2/qwen2_model.h"
#include "qwen2_micro_default.h"
#include "qwen2_micro_tiled.h"
#include "runtime/checkpoint.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"
#include "tests/temp_dir.h"

namespace halyard {
namespace {

std::string fixture_path(const std::string& file) { return std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/" + file; }

// max |a - b| / max |b|
template <class T>
double rel_error(const T* a, const std::vector<double>& b) {
  double diff = 0, scale = 1e-300;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

template <class T>
void interpreter_matches_fixture(const std::string& file, double tol) {
  auto st = runtime::Safetensors::read(fixture_path(file));
  auto cfg = qwen2::Qwen2Config::parse(st.metadata.at("config"), file + " metadata");
  const int64_t batch = std::stoll(st.metadata.at("batch")), seq = std::stoll(st.metadata.at("seq"));
  auto m = qwen2::build_qwen2(cfg, batch, seq, std::is_same_v<T, float> ? DType::f32 : DType::f64);
  Gradients grads = grad(m.loss, m.params);

  Interpreter<T> in(*m.graph);
  for (const char* name : {"input_ids", "labels", "position_ids"}) in.set_int(name, st.to_i32(name));
  for (const Value& p : m.params) {
    const std::string& name = p.node().name;
    ASSERT_EQ(st.at(name).shape, m.hf_shapes.at(name)) << name << ": Halyard's layout differs from HF's";
    auto w = st.to_f64(name);
    in.set(name, std::vector<T>(w.begin(), w.end()));
  }
  in.run();
  EXPECT_EQ(2 * m.params.size() + 1 /* loss */ + 3 /* ids */, st.size()) << "the fixture holds tensors this model does not have";

  const double want = st.to_f64("loss")[0], got = static_cast<double>(in.scalar(m.loss));
  std::printf("  %s (interpreter, %s): loss %.9f vs torch %.9f, rel err %.2e\n", file.c_str(),
              std::is_same_v<T, float> ? "f32" : "f64", got, want, std::abs(got - want) / std::abs(want));
  EXPECT_LE(std::abs(got - want) / std::abs(want), tol);
  double worst = 0;
  for (const Value& p : m.params) {
    const std::string& name = p.node().name;
    const double err = rel_error(in.value(grads[p]).data(), st.to_f64("grad/" + name));
    std::printf("    grad %-48s rel err %.2e\n", name.c_str(), err);
    EXPECT_LE(err, tol) << name;
    worst = std::max(worst, err);
  }
  std::printf("  worst gradient rel err %.2e (tolerance %.0e)\n", worst, tol);
}

TEST(Qwen2Reference, MicroF32MatchesTorch) { interpreter_matches_fixture<float>("qwen2_micro.safetensors", 1e-4); }
TEST(Qwen2Reference, MicroTiedF32MatchesTorch) { interpreter_matches_fixture<float>("qwen2_micro_tied.safetensors", 1e-4); }
TEST(Qwen2Reference, MicroF64MatchesTorch) { interpreter_matches_fixture<double>("qwen2_micro.safetensors", 1e-6); }
TEST(Qwen2Reference, MicroTiedF64MatchesTorch) { interpreter_matches_fixture<double>("qwen2_micro_tied.safetensors", 1e-6); }

// The fixture's weights written as a user downloads them from the Hub: a
// folder with model.safetensors (HF names and shapes) and config.json.
void write_hf_folder(const runtime::Safetensors& st, const runtime::ModelSpec& spec, const std::string& dir) {
  runtime::Safetensors hf;
  hf.metadata = {{"format", "pt"}};
  for (int i = 0; i < spec.num_params; ++i) hf.put(spec.params[i].name, st.at(spec.params[i].name));
  hf.write(dir + "/model.safetensors");
  std::ofstream(dir + "/config.json") << st.metadata.at("config");  // as Python's json wrote it
}

void library_matches_fixture(const runtime::ModelSpec& spec) {
  const auto st = runtime::Safetensors::read(fixture_path("qwen2_micro.safetensors"));
  testing::TempDir dir;
  write_hf_folder(st, spec, dir.path);
  runtime::Model m(spec);
  m.init_params(1);
  EXPECT_EQ(runtime::load_checkpoint(dir.path, m, nullptr), 0);
  const auto ids = st.to_i32("input_ids"), labels = st.to_i32("labels"), pos = st.to_i32("position_ids");
  const double loss = m.train_step(ids.data(), labels.data(), pos.data());
  const double want = st.to_f64("loss")[0];
  std::printf("  %s (%s, %d kernels): loss %.9f vs torch %.9f, rel err %.2e\n", spec.name, spec.schedule,
              spec.num_kernels, loss, want, std::abs(loss - want) / want);
  EXPECT_LE(std::abs(loss - want) / want, 1e-4);
  double worst = 0;
  for (int i = 0; i < m.num_params(); ++i) {
    const std::string name = m.param_spec(i).name;
    const double err = rel_error(m.grad(i), st.to_f64("grad/" + name));
    std::printf("    grad %-48s rel err %.2e\n", name.c_str(), err);
    EXPECT_LE(err, 1e-4) << name;
    worst = std::max(worst, err);
  }
  std::printf("  worst gradient rel err vs torch %.2e (tolerance 1e-04)\n", worst);
  EXPECT_NEAR(m.forward_loss(ids.data(), labels.data(), pos.data()), loss, 1e-6 * std::abs(loss));
}

TEST(Qwen2Lowering, DefaultScheduleFromHfFolderMatchesTorch) { library_matches_fixture(halyard_models::qwen2_micro_default()); }
TEST(Qwen2Lowering, SequenceTiledFromHfFolderMatchesTorch) { library_matches_fixture(halyard_models::qwen2_micro_tiled()); }

TEST(Qwen2Lowering, DefaultScheduleMatchesInterpreter) {
  const auto st = runtime::Safetensors::read(fixture_path("qwen2_micro.safetensors"));
  runtime::Model m(halyard_models::qwen2_micro_default());
  for (int i = 0; i < m.num_params(); ++i) {
    const auto w = st.to_f32(m.param_spec(i).name);
    std::copy(w.begin(), w.end(), m.param(i));
  }
  const auto ids = st.to_i32("input_ids"), labels = st.to_i32("labels"), pos = st.to_i32("position_ids");
  const double loss = m.train_step(ids.data(), labels.data(), pos.data());

  auto g = qwen2::build_qwen2(qwen2::Qwen2Config::parse(st.metadata.at("config"), "fixture"), 2, 24);
  Gradients grads = grad(g.loss, g.params);
  Interpreter<float> in(*g.graph);
  for (const char* name : {"input_ids", "labels", "position_ids"}) in.set_int(name, st.to_i32(name));
  for (const Value& p : g.params) in.set(p.node().name, st.to_f32(p.node().name));
  in.run();
  EXPECT_LE(std::abs(loss - in.scalar(g.loss)) / std::abs(in.scalar(g.loss)), 1e-4);
  double worst = 0;
  ASSERT_EQ(static_cast<size_t>(m.num_params()), g.params.size());
  for (size_t i = 0; i < g.params.size(); ++i) {
    ASSERT_EQ(m.param_spec(static_cast<int>(i)).name, g.params[i].node().name);
    const auto& ref = in.value(grads[g.params[i]]);
    const double err = rel_error(m.grad(static_cast<int>(i)), std::vector<double>(ref.begin(), ref.end()));
    EXPECT_LE(err, 1e-4) << g.params[i].node().name;
    worst = std::max(worst, err);
  }
  std::printf("  worst gradient rel err vs the reference interpreter %.2e\n", worst);
}

// The config reader: Qwen2's rows on Llama's shared reader.
std::string config_error(const std::string& json) {
  try {
    qwen2::Qwen2Config::parse(json, "test");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(Qwen2Config, PublishedFormsLoadAndUnimplementedMathIsRefusedByName) {
  // Qwen2.5-0.5B's config.json as transformers 4.43 wrote it (trimmed of
  // token ids): a window size that use_sliding_window false leaves unused.
  const std::string base = R"({"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
      "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
      "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
      "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
      "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": true,
      "use_sliding_window": false, "vocab_size": 151936)";
  auto with = [&](const std::string& extra) { return base + (extra.empty() ? "" : ", " + extra) + "}"; };
  auto replaced = [](std::string s, const std::string& from, const std::string& to) {
    return s.replace(s.find(from), from.size(), to);
  };
  const auto c = qwen2::Qwen2Config::parse(with(""), "qwen2.5-0.5b");
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_TRUE(c.tie_word_embeddings);
  // transformers 5.x: rope_parameters, dtype, layer_types, no window.
  const std::string v5 = replaced(with(R"("rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
      "dtype": "bfloat16", "layer_types": ["full_attention"])"), R"("sliding_window": 32768)", R"("sliding_window": null)");
  EXPECT_EQ(qwen2::Qwen2Config::parse(v5, "v5").to_json(), c.to_json());
  EXPECT_THAT(c.to_json(), ::testing::HasSubstr("\"model_type\": \"qwen2\""));

  EXPECT_THAT(config_error(replaced(with(""), R"("use_sliding_window": false)", R"("use_sliding_window": true)")),
              ::testing::HasSubstr("use_sliding_window is true: sliding-window attention, which Halyard's Qwen2 does not implement"));
  EXPECT_THAT(config_error(with(R"("attention_bias": false)")), ::testing::HasSubstr("attention_bias is false"));
  EXPECT_EQ(config_error(with(R"("attention_bias": true)")), "");
  EXPECT_THAT(config_error(with(R"("rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})")),
              ::testing::HasSubstr("rope type \"yarn\""));
  EXPECT_THAT(config_error(with(R"("logits_scaling": 8.0)")), ::testing::HasSubstr("the keys of HF's Qwen2Config"));
  EXPECT_THAT(config_error(replaced(with(""), R"("model_type": "qwen2")", R"("model_type": "llama")")), ::testing::HasSubstr("model_type is \"llama\": another architecture"));
}

// bias_add (the op Qwen2 added to the DSL): each user mistake names the
// operands, the rule and what is legal.
TEST(Qwen2Dsl, BiasAddMistakesAreUserErrors) {
  auto error_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  };
  Graph g;
  Value q = param(g, "q", DType::f32, {{"batch", 1}, {"seq", 4}, {"heads", 2}, {"head_dim", 8}});
  Value short_bias = param(g, "q_proj.bias", DType::f32, {{"heads", 2}, {"head_dim", 4}});
  EXPECT_THAT(error_of([&] { bias_add(q, short_bias); }),
              ::testing::AllOf(::testing::HasSubstr("axis \"head_dim\" is 8 in %0 \"q\""),
                               ::testing::HasSubstr("but 4 in bias %1 \"q_proj.bias\""),
                               ::testing::HasSubstr("legal: the bias's axes with x's sizes")));
  Value ffn_bias = param(g, "up_proj.bias", DType::f32, {{"ffn", 8}});
  EXPECT_THAT(error_of([&] { bias_add(q, ffn_bias); }),
              ::testing::AllOf(::testing::HasSubstr("axis \"ffn\" of bias %2 \"up_proj.bias\" f32[ffn=8] is not an axis"),
                               ::testing::HasSubstr("legal: a bias over some of [batch, seq, heads, head_dim]")));
  EXPECT_THAT(error_of([&] { bias_add(q, q); }),
              ::testing::AllOf(::testing::HasSubstr("a bias repeats over at least one axis of x"),
                               ::testing::HasSubstr("for tensors of one type use add")));
  Value q64 = param(g, "q64", DType::f64, {{"heads", 2}, {"head_dim", 8}});
  EXPECT_THAT(error_of([&] { bias_add(q, q64); }), ::testing::HasSubstr("operands have different dtypes: f32 vs f64"));
  EXPECT_THAT(error_of([&] { bias_add_grad(q, {"heads", "vocab"}); }),
              ::testing::HasSubstr("bias axis \"vocab\" is not an axis of %0 \"q\""));
}

}  // namespace
}  // namespace halyard
