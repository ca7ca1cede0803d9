// Single generated kernels against the f64 reference interpreter: each stage
// is lowered and scheduled as an AOT build does it (lower_stage +
// schedule_cpu), JIT-compiled for the host, and run on random data.
//
// The linear layer's three contractions run at token counts below, at and
// past the blocks that weight gradients are summed in (schedule_cpu.cpp: 32
// to 512 tokens, chosen from the L1 size), none of them a multiple of a
// block, and with column counts that are and are not a multiple of the
// register tile (the latter keeps the unblocked schedule).
#include <gtest/gtest.h>

#include <HalideBuffer.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include "dsl/interpreter.h"
#include "dsl/ops.h"
#include "generators/lowering.h"

namespace halyard {
namespace {

struct Case {
  const char* kind;
  int64_t tokens, k, n;
};

std::string name_of(const Case& c) {
  return std::string(c.kind) + " " + std::to_string(c.tokens) + "x" + std::to_string(c.k) + "x" + std::to_string(c.n);
}

// The largest difference from the reference, relative to its largest magnitude.
double run_case(const Case& c) {
  Graph g;
  const Axis R{"seq", c.tokens}, K{"model", c.k}, N{"ffn", c.n};
  Value out;
  const std::string kind = c.kind;
  if (kind == "forward") {  // y[s, f] = sum_m x[s, m] w[f, m]
    out = contract(input(g, "a", DType::f32, {R, K}), param(g, "b", DType::f32, {N, K}), {"model"});
  } else if (kind == "grad_input") {  // dx[s, m] = sum_f dy[s, f] w[f, m]
    out = contract_to(input(g, "a", DType::f32, {R, N}), param(g, "b", DType::f32, {N, K}), {"seq", "model"});
  } else {  // dw[f, m] = sum_s dy[s, f] x[s, m]
    out = contract_to(input(g, "a", DType::f32, {R, N}), input(g, "b", DType::f32, {R, K}), {"ffn", "model"});
  }
  Partition p = partition(g, {out.id}, Schedule{});
  const Stage& st = p.stages.at(0);
  LoweredStage ls = lower_stage(g, st);
  const Halide::Target t = Halide::get_host_target();
  schedule_cpu(ls, g, st, t);

  std::mt19937 rng(static_cast<unsigned>(c.tokens * 131 + c.k));
  std::normal_distribution<float> normal(0.f, 1.f);
  Interpreter<double> ref(g);
  std::vector<Halide::Buffer<float>> ins;
  for (size_t i = 0; i < st.inputs.size(); ++i) {
    const Node& in = g.node(st.inputs[i]);
    std::vector<int> sizes;
    for (int d = in.type.rank() - 1; d >= 0; --d) sizes.push_back(static_cast<int>(in.type.axes[static_cast<size_t>(d)].size));
    Halide::Buffer<float> b(sizes);
    std::vector<double> values;
    // Row-major element order is the buffer's memory order (innermost axis first).
    for (int64_t e = 0; e < in.type.numel(); ++e) values.push_back(b.data()[e] = normal(rng));
    ref.set(in.name, values);
    ins.push_back(b);
    ls.inputs[i].set(ins.back());
  }
  ref.run();
  std::vector<int> sizes;
  for (int d = out.type().rank() - 1; d >= 0; --d) sizes.push_back(static_cast<int>(out.type().axes[static_cast<size_t>(d)].size));
  Halide::Buffer<float> result(sizes);
  ls.pipeline.compile_jit(t);
  ls.pipeline.realize(result);
  const std::vector<double>& want = ref.value(out);
  double diff = 0, scale = 1e-300;
  for (size_t e = 0; e < want.size(); ++e) {
    diff = std::max(diff, std::abs(static_cast<double>(result.data()[e]) - want[e]));
    scale = std::max(scale, std::abs(want[e]));
  }
  return diff / scale;
}

TEST(Kernels, ContractionsMatchTheInterpreterAtEveryLength) {
  const std::vector<Case> cases = {
      {"forward", 300, 64, 160},       {"grad_input", 300, 64, 160},    {"grad_weight", 37, 64, 160},
      {"grad_weight", 300, 64, 160},   {"grad_weight", 1100, 64, 160},  {"grad_weight", 2053, 64, 160},
      {"grad_weight", 1100, 160, 64},  {"grad_weight", 1100, 72, 100},
  };
  for (const Case& c : cases) {
    const double err = run_case(c);
    std::printf("  %-28s max |diff| / max |ref| = %.2e\n", name_of(c).c_str(), err);
    // f32 sums of up to 2053 products: rounding grows like sqrt(n) * 6e-8.
    EXPECT_LE(err, 2e-5) << name_of(c);
  }
}

}  // namespace
}  // namespace halyard
