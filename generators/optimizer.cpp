// The optimizer's kernels (see optimizer.h).
#include "generators/optimizer.h"

namespace halyard {

using namespace Halide;

namespace {

// GPU targets: 64 threads per block, one element (one chunk) each. CPU
// targets (tests JIT them): vectors, no threads. Returns the loop of one
// element (a GPU thread's).
Var schedule_pointwise(Func f, const Var& i, const Target& target) {
  if (!target.has_gpu_feature()) {
    f.vectorize(i, target.natural_vector_size(Float(32)), TailStrategy::GuardWithIf);
    return i;
  }
  Var bx("bx"), tx("tx");
  f.gpu_tile(i, bx, tx, 64, TailStrategy::GuardWithIf);
  return tx;
}

}  // namespace

Module adamw_module(const Target& target, const std::string& fn) {
  ImageParam w(Float(32), 1, "w"), g(Float(32), 1, "g"), m(Float(32), 1, "m"), v(Float(32), 1, "v");
  Param<float> b1("b1"), b2("b2"), lr_over_c1("lr_over_c1"), inv_c2("inv_c2"), eps("eps"), grad_scale("grad_scale"),
      decay("decay");
  Var i("i");
  // adamw_update's expressions, in its order (runtime/adamw.cpp).
  Expr gi = g(i) * grad_scale;
  Expr mi = b1 * m(i) + (1.f - b1) * gi;
  Expr vi = b2 * v(i) + (1.f - b2) * gi * gi;
  Expr wi = w(i) * decay - lr_over_c1 * mi / (sqrt(vi * inv_c2) + eps);
  Func update(fn);
  update(i) = Tuple(wi, mi, vi);
  schedule_pointwise(update, i, target);
  Pipeline p(update);
  return p.compile_to_module({w, g, m, v, b1, b2, lr_over_c1, inv_c2, eps, grad_scale, decay}, fn, target);
}

Module grad_sumsq_module(const Target& target, const std::string& fn) {
  ImageParam g(Float(32), 1, "g");
  Param<int> chunk("chunk");
  Var j("j");
  RDom r(0, chunk, "r");
  Expr at = j * chunk + r;
  Expr x = cast<double>(g(clamp(at, 0, g.dim(0).extent() - 1)));
  Func acc(fn + "_acc"), part(fn);
  acc(j) = cast<double>(0);
  acc(j) += select(at < g.dim(0).extent(), x * x, Expr(0.0));
  part(j) = acc(j);
  acc.compute_at(part, schedule_pointwise(part, j, target));  // a thread's own sum, in its registers
  Pipeline p(part);
  return p.compile_to_module({g, chunk}, fn, target);
}

}  // namespace halyard
