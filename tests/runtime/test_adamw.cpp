// AdamW and gradient clipping against their formulas, computed by hand here.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "runtime/adamw.h"
#include "runtime/error.h"

namespace halyard::runtime {
namespace {

TEST(AdamW, TwoStepsMatchTheFormula) {
  AdamWConfig cfg;  // beta1 0.9, beta2 0.95, eps 1e-8, weight decay 0.1
  std::vector<float> w = {1.0f, -2.0f}, norm = {0.5f};
  AdamW opt({2, 1}, {true, false}, cfg);
  float* params[] = {w.data(), norm.data()};
  const std::vector<std::vector<float>> g = {{0.5f, -1.0f}, {2.0f}};
  const float* grads[] = {g[0].data(), g[1].data()};
  double m[3] = {0, 0, 0}, v[3] = {0, 0, 0}, ref[3] = {1.0, -2.0, 0.5};
  const double lr = 0.01;
  for (int t = 1; t <= 2; ++t) {
    opt.step(t, lr, params, grads);
    const double gs[3] = {0.5, -1.0, 2.0};
    for (int i = 0; i < 3; ++i) {
      m[i] = 0.9 * m[i] + 0.1 * gs[i];
      v[i] = 0.95 * v[i] + 0.05 * gs[i] * gs[i];
      const double mh = m[i] / (1 - std::pow(0.9, t)), vh = v[i] / (1 - std::pow(0.95, t));
      const double decay = i < 2 ? 1 - lr * 0.1 : 1.0;  // norm weights are not decayed
      ref[i] = ref[i] * decay - lr * mh / (std::sqrt(vh) + 1e-8);
    }
  }
  EXPECT_NEAR(w[0], ref[0], 1e-6);
  EXPECT_NEAR(w[1], ref[1], 1e-6);
  EXPECT_NEAR(norm[0], ref[2], 1e-6);
}

TEST(AdamW, ClippingScalesTheGradients) {
  const std::vector<float> g0 = {3.0f, 0.0f}, g1 = {4.0f};
  const float* grads[] = {g0.data(), g1.data()};
  const double n = global_grad_norm(grads, {2, 1});
  EXPECT_DOUBLE_EQ(n, 5.0);
  EXPECT_DOUBLE_EQ(clip_scale(n, 1.0), 0.2);
  EXPECT_DOUBLE_EQ(clip_scale(n, 10.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_scale(n, 0.0), 1.0);  // 0 turns clipping off

  // A step with grad_scale s equals a step on gradients multiplied by s.
  std::vector<float> a = {1.0f, 1.0f, 1.0f}, b = a;
  const std::vector<float> g = {0.3f, -0.7f, 1.1f};
  std::vector<float> scaled = g;
  for (float& x : scaled) x *= 0.25f;
  AdamW oa({3}, {true}), ob({3}, {true});
  float* pa[] = {a.data()};
  float* pb[] = {b.data()};
  const float* ga[] = {g.data()};
  const float* gb[] = {scaled.data()};
  oa.step(1, 0.01, pa, ga, 0.25);
  ob.step(1, 0.01, pb, gb);
  EXPECT_EQ(a, b);
}

TEST(AdamW, MismatchedFlagsAreAnError) {
  EXPECT_THROW(AdamW({2, 3}, {true}), Error);
}

}  // namespace
}  // namespace halyard::runtime
