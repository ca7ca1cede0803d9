// Generated (AOT-compiled Halide) train steps against the PyTorch fixture and
// the reference interpreter: loss and every gradient within 1e-4 relative in
// f32, for each schedule the test build compiles. Several generated models
// link into this one binary through a single Halide runtime.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "dsl/autodiff.h"
#include "dsl/interpreter.h"
#include "examples/llama/llama_model.h"
#include "examples/llama/llama_builder.h"
#include "llama_micro_autoscheduled.h"
#include "llama_micro_bf16_checkpoint_tiled.h"
#include "llama_micro_bf16_contract.h"
#include "llama_micro_bf16_mixed.h"
#include "llama_micro_bf16_saved.h"
#include "llama_micro_checkpoint.h"
#include "llama_micro_default.h"
#include "llama_micro_recompute.h"
#include "llama_micro_tiled.h"
#include "schedules/plan.h"
#include "schedules/tiling.h"
#include "runtime/error.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"

namespace halyard {
namespace {

const std::string kFixture = std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/llama_micro.safetensors";

double rel_error(const float* a, const std::vector<double>& b) {
  double diff = 0, scale = 1e-300;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

struct Loaded {
  runtime::Safetensors st;
  std::vector<int32_t> ids, labels, pos;
};

Loaded load_fixture() {
  Loaded l{runtime::Safetensors::read(kFixture), {}, {}, {}};
  l.ids = l.st.to_i32("input_ids");
  l.labels = l.st.to_i32("labels");
  l.pos = l.st.to_i32("position_ids");
  return l;
}

void load_params(runtime::Model& m, const runtime::Safetensors& st) {
  for (int i = 0; i < m.num_params(); ++i) {
    const auto& p = m.param_spec(i);
    auto w = st.to_f32(p.name);
    ASSERT_EQ(static_cast<int64_t>(w.size()), p.numel) << p.name;
    std::copy(w.begin(), w.end(), m.param(i));
  }
}

void check_against_fixture(const runtime::ModelSpec& spec) {
  Loaded f = load_fixture();
  runtime::Model m(spec);
  load_params(m, f.st);
  const double loss = m.train_step(f.ids.data(), f.labels.data(), f.pos.data());
  const double want = f.st.to_f64("loss")[0];
  std::printf("  %s (%s, %d kernels, arena %lld bytes): loss %.9f vs torch %.9f\n", spec.name, spec.schedule,
              spec.num_kernels, static_cast<long long>(m.arena_bytes()), loss, want);
  EXPECT_LE(std::abs(loss - want) / want, 1e-4);
  double worst = 0;
  for (int i = 0; i < m.num_params(); ++i) {
    const auto& p = m.param_spec(i);
    double err = rel_error(m.grad(i), f.st.to_f64(std::string("grad/") + p.name));
    EXPECT_LE(err, 1e-4) << p.name;
    worst = std::max(worst, err);
  }
  std::printf("  worst gradient rel err vs torch %.2e\n", worst);
  EXPECT_NEAR(m.forward_loss(f.ids.data(), f.labels.data(), f.pos.data()), loss, 1e-6 * std::abs(loss));
}

TEST(Lowering, DefaultScheduleMatchesTorch) { check_against_fixture(halyard_models::llama_micro_default()); }
TEST(Lowering, RecomputeScheduleMatchesTorch) { check_against_fixture(halyard_models::llama_micro_recompute()); }
TEST(Lowering, CheckpointScheduleMatchesTorch) { check_against_fixture(halyard_models::llama_micro_checkpoint()); }
TEST(Lowering, AutoscheduledMatchesTorch) { check_against_fixture(halyard_models::llama_micro_autoscheduled()); }
TEST(Lowering, SequenceTiledMlpAndLossMatchTorch) { check_against_fixture(halyard_models::llama_micro_tiled()); }

// Saved values stored in bf16, and contractions reading bf16 copies
// (schedules/precision.h). The backward, and the forward's attention, read
// the saved values rounded to bf16; every contraction reads its operands
// rounded: loss and gradients are the reference interpreter's on the same
// graph, and torch's f32 ones within bf16's rounding (but not to f32's:
// the copies are what they read). Storing saved values in bf16 makes the
// arena smaller. The gradients agree with the interpreter's to 1e-3, not
// 1e-4, or to twice the interpreter's own f32 against its f64 when that is
// larger (with every contraction rounding, up to 3.3e-3 on the micro
// Llama): two orders of summation give a value f32 bits that may straddle
// a bf16 rounding boundary, and then round apart by 2^-8. The loss agrees
// to 1e-5, where rounding to bf16 moves it by 1e-4 from torch's f32.
void check_bf16(const runtime::ModelSpec& spec, const std::string& schedule_file) {
  Loaded f = load_fixture();
  runtime::Model m(spec);
  load_params(m, f.st);
  const double loss = m.train_step(f.ids.data(), f.labels.data(), f.pos.data());
  const double want = f.st.to_f64("loss")[0];
  EXPECT_LE(std::abs(loss - want) / want, 1e-3);

  const std::string config = std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/llama_micro.json";
  const Plan p = plan(llama::llama_builder(), {config, 2, 24}, Schedule::named(schedule_file), Cluster::named("local-cpu"));
  ASSERT_GT(p.stored_bf16(), 0);
  Interpreter<float> in(*p.model.graph);
  for (const char* name : {"input_ids", "labels", "position_ids"}) in.set_int(name, f.st.to_i32(name));
  for (const Value& v : p.model.params) in.set(v.node().name, f.st.to_f32(v.node().name));
  in.run();
  // The same graph in f64: how far two exact orders of summation land apart
  // once bf16 rounds their values (the noise the library's error sits in).
  Interpreter<double> exact(*p.model.graph);
  for (const char* name : {"input_ids", "labels", "position_ids"}) exact.set_int(name, f.st.to_i32(name));
  for (const Value& v : p.model.params) {
    const std::vector<float> w = f.st.to_f32(v.node().name);
    exact.set(v.node().name, std::vector<double>(w.begin(), w.end()));
  }
  exact.run();
  EXPECT_LE(std::abs(loss - in.scalar(p.model.loss)) / want, 1e-5);
  EXPECT_NEAR(m.forward_loss(f.ids.data(), f.labels.data(), f.pos.data()), loss, 1e-6 * loss);
  double worst_interp = 0, worst_torch = 0, worst_noise = 0;
  for (int i = 0; i < m.num_params(); ++i) {
    const std::string name = m.param_spec(i).name;
    size_t k = 0;
    while (k < p.model.params.size() && p.model.params[k].node().name != name) ++k;
    ASSERT_LT(k, p.model.params.size()) << name;
    const auto& ref = in.value(p.grad_ids[k]);
    const double e_interp = rel_error(m.grad(i), std::vector<double>(ref.begin(), ref.end()));
    const double e_torch = rel_error(m.grad(i), f.st.to_f64("grad/" + name));
    const auto& e64 = exact.value(p.grad_ids[k]);
    std::vector<float> ref32(ref.begin(), ref.end());
    const double noise = rel_error(ref32.data(), std::vector<double>(e64.begin(), e64.end()));
    EXPECT_LE(e_interp, 1e-2) << name;
    worst_noise = std::max(worst_noise, noise);
    EXPECT_LE(e_torch, 3e-2) << name;
    worst_interp = std::max(worst_interp, e_interp);
    worst_torch = std::max(worst_torch, e_torch);
  }
  EXPECT_LE(worst_interp, std::max(1e-3, 2 * worst_noise)) << "the interpreter's f32 against its f64: " << worst_noise;
  EXPECT_GT(worst_torch, 1e-4);  // bf16's rounding shows: the backward read the copies
  // The same schedule in f32, planned: storing saved values in bf16 makes
  // its arena smaller. (Copies for contractions alone add bytes, and may not.)
  Schedule f32 = Schedule::named(schedule_file);
  for (ValueRule& r : f32.values) r.store.clear();
  f32.contract_precision = "f32";
  const int64_t f32_arena = plan(llama::llama_builder(), {config, 2, 24}, f32, Cluster::named("local-cpu")).train_program.arena_bytes;
  EXPECT_EQ(m.arena_bytes(), p.train_program.arena_bytes);
  if (p.schedule.stores_bf16()) {
    EXPECT_LT(m.arena_bytes(), f32_arena);
  }
  std::printf("  %s: %d bf16 copies; loss %.9f vs torch %.9f; worst gradient rel err vs the interpreter on "
              "the same graph %.2e (its f32 vs its f64: %.2e), vs torch (f32) %.2e; arena %lld bytes (%lld in f32)\n",
              spec.schedule, p.stored_bf16(), loss, want, worst_interp, worst_noise, worst_torch, static_cast<long long>(m.arena_bytes()),
              static_cast<long long>(f32_arena));
}

TEST(Lowering, SavedValuesInBf16MatchTheInterpreter) {
  check_bf16(halyard_models::llama_micro_bf16_saved(), std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/bf16_saved_micro.json");
}
TEST(Lowering, CheckpointedTiledValuesInBf16MatchTheInterpreter) {
  check_bf16(halyard_models::llama_micro_bf16_checkpoint_tiled(),
             std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/bf16_checkpoint_tiled_micro.json");
}
TEST(Lowering, ContractionsInBf16MatchTheInterpreter) {
  check_bf16(halyard_models::llama_micro_bf16_contract(), std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/bf16_contract_micro.json");
}
TEST(Lowering, ContractionsAndSavedValuesInBf16MatchTheInterpreter) {
  check_bf16(halyard_models::llama_micro_bf16_mixed(), std::string(HALYARD_SOURCE_DIR) + "/examples/llama/schedules/bf16_mixed.json");
}

// The tiling transform itself, in f64 on the interpreter: tiles of 10, 10
// and 4 tokens give the untiled loss and gradients to rounding.
TEST(Lowering, TiledGraphEqualsUntiledInF64) {
  Loaded f = load_fixture();
  auto cfg = llama::LlamaConfig::parse(f.st.metadata.at("config"), "fixture");
  auto run = [&](int64_t tile, std::vector<std::vector<double>>& grads_out) {
    auto src = llama::build_llama(cfg, 2, 24, DType::f64);
    RebuiltGraph m = tile_sequence(*src.graph, src.loss.id, tile);
    Gradients grads = grad(m.loss, m.params);
    Interpreter<double> in(*m.graph);
    for (const char* name : {"input_ids", "labels", "position_ids"}) in.set_int(name, f.st.to_i32(name));
    for (const Value& p : m.params) {
      auto w = f.st.to_f32(p.node().name);
      in.set(p.node().name, std::vector<double>(w.begin(), w.end()));
    }
    in.run();
    for (const Value& p : m.params) grads_out.push_back(in.value(grads[p].id));
    return in.scalar(m.loss);
  };
  std::vector<std::vector<double>> whole, tiled;
  const double l_whole = run(0, whole), l_tiled = run(10, tiled);
  EXPECT_NEAR(l_tiled, l_whole, 1e-12 * std::abs(l_whole));
  double worst = 0;
  for (size_t i = 0; i < whole.size(); ++i) {
    double scale = 1e-300, diff = 0;
    for (size_t k = 0; k < whole[i].size(); ++k) {
      scale = std::max(scale, std::abs(whole[i][k]));
      diff = std::max(diff, std::abs(whole[i][k] - tiled[i][k]));
    }
    worst = std::max(worst, diff / scale);
  }
  std::printf("  tiled (10+10+4) vs untiled, f64: loss %.17g vs %.17g, worst gradient rel diff %.2e\n", l_tiled, l_whole,
              worst);
  EXPECT_LE(worst, 1e-12);
}

TEST(Lowering, DefaultScheduleMatchesInterpreter) {
  Loaded f = load_fixture();
  runtime::Model m(halyard_models::llama_micro_default());
  load_params(m, f.st);
  const double loss = m.train_step(f.ids.data(), f.labels.data(), f.pos.data());

  auto cfg = llama::LlamaConfig::parse(f.st.metadata.at("config"), "fixture");
  auto g = llama::build_llama(cfg, 2, 24);
  Gradients grads = grad(g.loss, g.params);
  Interpreter<float> in(*g.graph);
  for (const char* name : {"input_ids", "labels", "position_ids"}) in.set_int(name, f.st.to_i32(name));
  for (const Value& p : g.params) in.set(p.node().name, f.st.to_f32(p.node().name));
  in.run();
  EXPECT_LE(std::abs(loss - in.scalar(g.loss)) / std::abs(in.scalar(g.loss)), 1e-4);
  double worst = 0;
  for (size_t i = 0; i < g.params.size(); ++i) {
    const auto& ref = in.value(grads[g.params[i]]);
    double err = rel_error(m.grad(static_cast<int>(i)), std::vector<double>(ref.begin(), ref.end()));
    EXPECT_LE(err, 1e-4) << g.params[i].node().name;
    worst = std::max(worst, err);
  }
  std::printf("  worst gradient rel err vs the reference interpreter %.2e\n", worst);
}

TEST(Lowering, BadTokensAreUserErrors) {
  Loaded f = load_fixture();
  runtime::Model m(halyard_models::llama_micro_default());
  auto ids = f.ids;
  ids[30] = 256;
  try {
    m.train_step(ids.data(), f.labels.data(), f.pos.data());
    FAIL() << "expected an error";
  } catch (const runtime::Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("token id 256 at input_ids[batch=1, seq=6] is outside the vocabulary"));
  }
  auto labels = f.labels;
  labels[0] = -5;
  try {
    m.forward_loss(f.ids.data(), labels.data(), f.pos.data());
    FAIL() << "expected an error";
  } catch (const runtime::Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("label -5 at labels[batch=0, seq=0]"));
  }
  auto pos = f.pos;
  pos[27] = 1;  // row 1 counts 0, 1, 2, then 1
  try {
    m.train_step(f.ids.data(), f.labels.data(), pos.data());
    FAIL() << "expected an error";
  } catch (const runtime::Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("position_ids[batch=1, seq=3] is 1 after 2"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("where the next document restarts at 0"));
  }
  EXPECT_THROW(m.param_index("nope"), runtime::Error);
}

}  // namespace
}  // namespace halyard
