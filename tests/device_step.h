// What the device-step tests share: test_cuda (on a GPU) and test_gpu_path
// (the same device path on OpenCL, run by PoCL on the CPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "runtime/model.h"
#include "runtime/safetensors.h"

namespace halyard::testing {

// A fixture's parameters (tests/fixtures/make_llama_fixture.py) into the model.
inline void load_params(runtime::Model& m, const runtime::Safetensors& st) {
  for (int i = 0; i < m.num_params(); ++i) {
    const std::vector<float> w = st.to_f32(m.param_spec(i).name);
    std::copy(w.begin(), w.end(), m.param(i));
  }
}

// The largest difference from `want`, relative to its largest magnitude.
inline double rel_diff(const float* got, const std::vector<double>& want) {
  double diff = 0, scale = 1e-30;
  for (size_t k = 0; k < want.size(); ++k) {
    diff = std::max(diff, std::abs(got[k] - want[k]));
    scale = std::max(scale, std::abs(want[k]));
  }
  return diff / scale;
}

// The calls of a program that copy a buffer home on a GPU step besides the
// loss and the gradients: its collectives (one rank's token count included).
inline int collectives(const runtime::ProgramSpec& p) {
  int n = 0;
  for (int c = 0; c < p.num_calls; ++c) {
    const runtime::CallKind k = p.calls[c].kind;
    n += k != runtime::CallKind::Kernel && k != runtime::CallKind::Wait && k != runtime::CallKind::AllReduceGrads;
  }
  return n;
}

}  // namespace halyard::testing
