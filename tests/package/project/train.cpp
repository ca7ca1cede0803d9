// A user's training loop over the generated library: AdamW on a repeating
// token pattern for --steps steps (2 by default), printing the loss.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "runtime/adamw.h"
#include "runtime/model.h"
#include "tiny_lm.h"

int main(int argc, char** argv) {
  const int steps = argc > 2 && std::string(argv[1]) == "--steps" ? std::atoi(argv[2]) : 2;
  halyard::runtime::Model m(halyard_models::tiny_lm());
  m.init_params(0);
  const auto& spec = halyard_models::tiny_lm();
  std::vector<int64_t> sizes;
  std::vector<bool> decay;
  std::vector<float*> params;
  std::vector<const float*> grads;
  for (int i = 0; i < m.num_params(); ++i) {
    sizes.push_back(m.param_spec(i).numel);
    decay.push_back(m.param_spec(i).rank > 1);
    params.push_back(m.param(i));
    grads.push_back(m.grad(i));
  }
  halyard::runtime::AdamW opt(sizes, decay);
  const int64_t n = spec.batch * spec.seq;
  std::vector<int32_t> ids(n), labels(n), pos(n);
  double first = 0, last = 0;
  for (int step = 1; step <= steps; ++step) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = i % spec.seq;
      ids[i] = static_cast<int32_t>((3 * t + i / spec.seq) % spec.vocab);
      labels[i] = static_cast<int32_t>((3 * (t + 1) + i / spec.seq) % spec.vocab);
      pos[i] = static_cast<int32_t>(t);
    }
    last = m.train_step(ids.data(), labels.data(), pos.data());
    if (step == 1) first = last;
    opt.step(step, 1e-2, params.data(), grads.data());
    std::printf("step %d loss %.4f\n", step, last);
  }
  if (!std::isfinite(last) || !(last < first)) {
    std::printf("FAIL: the loss did not fall (%.4f -> %.4f)\n", first, last);
    return 1;
  }
  std::printf("trained %d steps of %s: loss %.4f -> %.4f\n", steps, spec.name, first, last);
  return 0;
}
