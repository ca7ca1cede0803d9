// The reference interpreter against the independent PyTorch oracle
// (tests/fixtures/make_llama_fixture.py): loss and every parameter gradient
// of the micro Llama, in f32 within 1e-4 relative and in f64 within 1e-6
// (the fixture's gradients are stored as f32), printing the error per tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "dsl/autodiff.h"
#include "dsl/interpreter.h"
#include "examples/llama/llama_model.h"
#include "runtime/safetensors.h"

namespace halyard {
namespace {

// max |a - b| / max |b|
double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, scale = 1e-300;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

template <class T>
void compare_with_fixture(const std::string& file, double tol) {
  auto st = runtime::Safetensors::read(std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/" + file);
  auto cfg = llama::LlamaConfig::parse(st.metadata.at("config"), file + " metadata");
  const int64_t batch = std::stoll(st.metadata.at("batch")), seq = std::stoll(st.metadata.at("seq"));
  auto m = llama::build_llama(cfg, batch, seq, std::is_same_v<T, float> ? DType::f32 : DType::f64);
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

  const double want_loss = st.to_f64("loss")[0], got_loss = static_cast<double>(in.scalar(m.loss));
  const double loss_err = std::abs(got_loss - want_loss) / std::abs(want_loss);
  std::printf("  %s (%s): loss %.9f vs torch %.9f, rel err %.2e\n", file.c_str(),
              std::is_same_v<T, float> ? "f32" : "f64", got_loss, want_loss, loss_err);
  EXPECT_LE(loss_err, tol);
  EXPECT_EQ(m.params.size() + 1 /* loss */ + 3 /* ids */ + m.params.size(), st.size())
      << "the fixture holds tensors this model does not have";
  double worst = 0;
  for (const Value& p : m.params) {
    const std::string& name = p.node().name;
    const auto& g = in.value(grads[p]);
    double err = rel_error(std::vector<double>(g.begin(), g.end()), st.to_f64("grad/" + name));
    std::printf("    grad %-48s rel err %.2e\n", name.c_str(), err);
    EXPECT_LE(err, tol) << name;
    worst = std::max(worst, err);
  }
  std::printf("  worst gradient rel err %.2e (tolerance %.0e)\n", worst, tol);
}

TEST(Reference, MicroLlamaF32MatchesTorch) { compare_with_fixture<float>("llama_micro.safetensors", 1e-4); }
TEST(Reference, MicroLlamaTiedF32MatchesTorch) { compare_with_fixture<float>("llama_micro_tied.safetensors", 1e-4); }
TEST(Reference, MicroLlamaF64MatchesTorch) { compare_with_fixture<double>("llama_micro.safetensors", 1e-6); }
TEST(Reference, MicroLlamaTiedF64MatchesTorch) { compare_with_fixture<double>("llama_micro_tied.safetensors", 1e-6); }

}  // namespace
}  // namespace halyard
