// Finite-difference gradient checking on the reference interpreter, in f64.
//
// check_gradients() reduces `out` to a scalar with fixed random weights r
// (loss = sum(out * r), built in the DSL with contract), differentiates with
// grad(), and compares every analytic gradient with central differences. The
// error of a tensor is max |fd - analytic| over its checked elements divided
// by max |analytic| over the whole tensor: a relative error that stays
// meaningful where single elements are near zero.
#pragma once

#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "dsl/autodiff.h"
#include "dsl/interpreter.h"
#include "dsl/ops.h"

namespace halyard::testing {

struct GradcheckOptions {
  double eps = 1e-5;
  int max_elements = 24;  // per tensor; all when it is smaller
  unsigned seed = 1234;
  // Integer inputs by name (token ids, positions, labels).
  std::map<std::string, std::vector<int32_t>> ints;
  // Float inputs/params with given values; all others are random N(0, 1).
  std::map<std::string, std::vector<double>> floats;
  GradOptions grad_options;
};

// Returns the worst relative error over `wrt`, printing one line per tensor.
inline double check_gradients(Value out, const std::vector<Value>& wrt, const GradcheckOptions& o = {}) {
  Graph& g = *out.graph;
  std::mt19937 rng(o.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  Value r = input(g, "gradcheck.r" + std::to_string(g.size()), out.type().dtype, out.type().axes);
  Value loss = contract_to(out, r, {});
  Gradients grads = grad(loss, wrt, o.grad_options);
  verify(g);

  Interpreter<double> in(g);
  std::map<std::string, std::vector<double>> values;
  for (const Node& n : g.nodes()) {
    if (n.op != Op::Input && n.op != Op::Param) continue;
    if (n.type.dtype == DType::i32) {
      in.set_int(n.name, o.ints.at(n.name));
      continue;
    }
    auto it = o.floats.find(n.name);
    std::vector<double> v(static_cast<size_t>(n.type.numel()));
    if (it != o.floats.end()) v = it->second;
    else for (double& x : v) x = normal(rng);
    values[n.name] = v;
    in.set(n.name, v);
  }
  in.run();
  double worst = 0;
  for (const Value& w : wrt) {
    const std::string& name = w.node().name;
    const std::vector<double> analytic = in.value(grads[w]);
    double scale = 1e-300;
    for (double a : analytic) scale = std::max(scale, std::abs(a));
    std::vector<size_t> elems(analytic.size());
    for (size_t i = 0; i < elems.size(); ++i) elems[i] = i;
    if (static_cast<int>(elems.size()) > o.max_elements) {
      std::shuffle(elems.begin(), elems.end(), rng);
      elems.resize(static_cast<size_t>(o.max_elements));
    }
    double err = 0;
    std::vector<double> v = values.at(name);
    for (size_t i : elems) {
      const double x0 = v[i];
      v[i] = x0 + o.eps;
      in.set(name, v);
      in.run(loss.id);
      const double lp = in.scalar(loss);
      v[i] = x0 - o.eps;
      in.set(name, v);
      in.run(loss.id);
      const double lm = in.scalar(loss);
      v[i] = x0;
      err = std::max(err, std::abs((lp - lm) / (2 * o.eps) - analytic[i]));
    }
    in.set(name, v);
    std::printf("  gradcheck %-46s %-28s max|grad| %.3e  rel err %.3e (%zu elements)\n", name.c_str(),
                w.type().str().c_str(), scale, err / scale, elems.size());
    worst = std::max(worst, err / scale);
  }
  return worst;
}

inline std::vector<int32_t> iota_positions(int64_t batch, int64_t seq) {
  std::vector<int32_t> p;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < seq; ++s) p.push_back(static_cast<int32_t>(s));
  return p;
}

}  // namespace halyard::testing
