// A generated model, ready to train: parameters, gradients, the activation
// arena, and the executor of its step programs.
//
//   halyard::runtime::Model m(halyard_models::tiny_llama());
//   m.init_params(0);
//   double loss = m.train_step(ids, labels, positions);  // fills m.grad(i)
//
// Tokens are [batch, seq] int32 arrays of the sizes the library was built
// for. Bad input (an id outside the vocabulary, a label that is neither a
// token nor the ignore index, a negative position) throws runtime::Error
// naming the position; a failing kernel throws naming the kernel and node.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "runtime/step_program.h"

namespace halyard::runtime {

// Tunes glibc so that memory freed by kernels stays in the heap (see model.cpp).
// Model does this itself; programs that call kernels directly (benchmarks) call it.
void keep_freed_memory();

class Model {
 public:
  explicit Model(const ModelSpec& spec);

  const ModelSpec& spec() const { return spec_; }
  int num_params() const { return spec_.num_params; }
  const ParamSpec& param_spec(int i) const { return spec_.params[i]; }
  int param_index(const std::string& name) const;  // throws listing names
  float* param(int i) { return reinterpret_cast<float*>(params_.get() + offsets_[static_cast<size_t>(i)]); }
  const float* param(int i) const { return reinterpret_cast<const float*>(params_.get() + offsets_[static_cast<size_t>(i)]); }
  const float* grad(int i) const { return reinterpret_cast<const float*>(grads_.get() + offsets_[static_cast<size_t>(i)]); }

  // Hugging Face's init: N(0, 0.02) for matrices and embeddings, 1 for norms.
  void init_params(uint64_t seed);

  // Forward + backward: returns the loss and fills every gradient.
  double train_step(const int32_t* input_ids, const int32_t* labels, const int32_t* position_ids);
  // Forward only (a smaller arena): returns the loss.
  double forward_loss(const int32_t* input_ids, const int32_t* labels, const int32_t* position_ids);

  int64_t tokens() const { return spec_.batch * spec_.seq; }
  int64_t arena_bytes() const { return arena_bytes_; }
  // Per-kernel wall time of the last step, when HALYARD_PROFILE is set.
  std::string profile() const { return profile_; }

  // Halide's worker threads (the pool is global to the process).
  static void set_num_threads(int n);

 private:
  double run(const ProgramSpec& p, const int32_t* const inputs[3]);
  void validate(const int32_t* ids, const int32_t* labels, const int32_t* positions) const;

  // Halide's kernels may use aligned vector loads: every buffer they see
  // starts on a 128-byte boundary (Halide's own allocation alignment).
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  using Block = std::unique_ptr<uint8_t[], Free>;
  static Block allocate(int64_t bytes);

  const ModelSpec& spec_;
  std::vector<int64_t> offsets_;  // of each parameter in params_ and grads_
  Block params_, grads_, tokens_, arena_;
  int64_t arena_bytes_ = 0;
  std::string profile_;
};

}  // namespace halyard::runtime
