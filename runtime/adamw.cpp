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

void AdamW::step(int64_t t, double lr, float* const* params, const float* const* grads, double grad_scale) {
  const double c1 = 1 - std::pow(cfg_.beta1, static_cast<double>(t));
  const double c2 = 1 - std::pow(cfg_.beta2, static_cast<double>(t));
  const float b1 = static_cast<float>(cfg_.beta1), b2 = static_cast<float>(cfg_.beta2);
  for (size_t p = 0; p < m_.size(); ++p) {
    float* w = params[p];
    const float* g = grads[p];
    float* m = m_[p].data();
    float* v = v_[p].data();
    const float decay = decay_[p] ? static_cast<float>(1 - lr * cfg_.weight_decay) : 1.f;
    const float step = static_cast<float>(lr / c1), inv_c2 = static_cast<float>(1 / c2), eps = static_cast<float>(cfg_.eps);
    const float scale = static_cast<float>(grad_scale);
    for (size_t i = 0; i < m_[p].size(); ++i) {
      const float gi = g[i] * scale;
      m[i] = b1 * m[i] + (1 - b1) * gi;
      v[i] = b2 * v[i] + (1 - b2) * gi * gi;
      w[i] = w[i] * decay - step * m[i] / (std::sqrt(v[i] * inv_c2) + eps);
    }
  }
}

}  // namespace halyard::runtime
