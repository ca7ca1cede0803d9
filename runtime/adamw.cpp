// AdamW (see adamw.h).
#include "runtime/adamw.h"

#include <cmath>

#include "runtime/error.h"

namespace halyard::runtime {

AdamW::AdamW(const std::vector<int64_t>& sizes, const std::vector<bool>& decay, AdamWConfig cfg)
    : cfg_(cfg), decay_(decay) {
  if (sizes.size() != decay.size())
    throw Error("error: AdamW got " + std::to_string(sizes.size()) + " parameter sizes but " +
                std::to_string(decay.size()) + " decay flags; give one flag per parameter.");
  for (int64_t n : sizes) {
    m_.emplace_back(static_cast<size_t>(n), 0.f);
    v_.emplace_back(static_cast<size_t>(n), 0.f);
  }
}

double global_grad_norm(const float* const* grads, const std::vector<int64_t>& sizes) {
  double ss = 0;
  for (size_t p = 0; p < sizes.size(); ++p)
    for (int64_t i = 0; i < sizes[p]; ++i) ss += static_cast<double>(grads[p][i]) * grads[p][i];
  return std::sqrt(ss);
}

AdamWStepConstants adamw_step_constants(const AdamWConfig& cfg, int64_t t, double lr, double grad_scale) {
  const double c1 = 1 - std::pow(cfg.beta1, static_cast<double>(t));
  const double c2 = 1 - std::pow(cfg.beta2, static_cast<double>(t));
  return {static_cast<float>(cfg.beta1), static_cast<float>(cfg.beta2), static_cast<float>(lr / c1),
          static_cast<float>(1 / c2),    static_cast<float>(cfg.eps),   static_cast<float>(grad_scale),
          static_cast<float>(1 - lr * cfg.weight_decay)};
}

void adamw_update(const AdamWStepConstants& k, bool decay, float* w, const float* g, float* m, float* v, int64_t n) {
  const float b1 = k.b1, b2 = k.b2, step = k.lr_over_c1, inv_c2 = k.inv_c2, eps = k.eps, scale = k.grad_scale;
  const float d = decay ? k.decay : 1.f;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * scale;
    m[i] = b1 * m[i] + (1 - b1) * gi;
    v[i] = b2 * v[i] + (1 - b2) * gi * gi;
    w[i] = w[i] * d - step * m[i] / (std::sqrt(v[i] * inv_c2) + eps);
  }
}

void AdamW::step(int64_t t, double lr, float* const* params, const float* const* grads, double grad_scale) {
  const AdamWStepConstants k = adamw_step_constants(cfg_, t, lr, grad_scale);
  for (size_t p = 0; p < m_.size(); ++p)
    adamw_update(k, decay_[p], params[p], grads[p], m_[p].data(), v_[p].data(), static_cast<int64_t>(m_[p].size()));
}

}  // namespace halyard::runtime
