// AdamW (Loshchilov & Hutter): decoupled weight decay, bias-corrected moments.
//
// State (m, v) is f32 per parameter. Parameters flagged `decay` get weight
// decay (matrices, embeddings); norm weights usually do not. ZeroAdamW
// (runtime/zero.h) shards the state over ranks and applies the same update.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace halyard::runtime {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

// The L2 norm of all gradients together, accumulated in double.
double global_grad_norm(const float* const* grads, const std::vector<int64_t>& sizes);
// The factor that brings that norm down to max_norm (1 when it is below, or max_norm <= 0).
inline double clip_scale(double norm, double max_norm) {
  return max_norm > 0 && norm > max_norm ? max_norm / norm : 1.0;
}

// The update of one step, shared by AdamW and ZeroAdamW so that the formula
// exists once and both give bitwise the same parameters for the same gradients.
// The step's constants are rounded to f32 once, here, not per element.
struct AdamWStepConstants {
  float b1, b2, lr_over_c1, inv_c2, eps, grad_scale, decay;  // decay: 1 - lr * weight_decay
};
AdamWStepConstants adamw_step_constants(const AdamWConfig& cfg, int64_t step, double lr, double grad_scale);
// n consecutive elements of one parameter, in place; `decay` whether that
// parameter gets weight decay.
void adamw_update(const AdamWStepConstants& k, bool decay, float* w, const float* g, float* m, float* v, int64_t n);

class AdamW {
 public:
  AdamW(const std::vector<int64_t>& sizes, const std::vector<bool>& decay, AdamWConfig cfg = {});
  // One update with learning rate lr; call with step = 1, 2, ... Gradients
  // are multiplied by grad_scale first (global-norm clipping, see below).
  void step(int64_t step, double lr, float* const* params, const float* const* grads, double grad_scale = 1.0);

  // The moments of parameter i (numel floats each), for checkpoints
  // (runtime/checkpoint.h). Callers may overwrite values, not resize.
  size_t num_params() const { return m_.size(); }
  std::vector<float>& m(size_t i) { return m_.at(i); }
  std::vector<float>& v(size_t i) { return v_.at(i); }
  const std::vector<float>& m(size_t i) const { return m_.at(i); }
  const std::vector<float>& v(size_t i) const { return v_.at(i); }

 private:
  AdamWConfig cfg_;
  std::vector<bool> decay_;
  std::vector<std::vector<float>> m_, v_;
};

}  // namespace halyard::runtime
