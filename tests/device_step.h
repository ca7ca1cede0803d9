// What the device-step tests share: test_cuda (on a GPU) and test_gpu_path
// (the same device path on OpenCL, run by PoCL on the CPU).
#pragma once

#include <algorithm>
#include <cstdint>
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
    n += k != runtime::CallKind::Kernel && k != runtime::CallKind::Wait && k != runtime::CallKind::AllReduceGrads &&
         k != runtime::CallKind::Offload && k != runtime::CallKind::Reload;
  }
  return n;
}

// The device memory a GPU step's executor holds: one block each for the
// parameters, the gradients, the four token slots and the arena (each
// rounded to the runtime's 128-byte alignment).
inline int64_t device_blocks_bytes(const runtime::Model& m) {
  auto round = [](int64_t n) { return (n + 127) / 128 * 128; };
  return 2 * 4 * m.flat_size() + 4 * round(4 * m.tokens()) + round(m.arena_bytes());
}
// The host side of those blocks, which a CUDA step pins (the arena as the
// plan sized it, unrounded; a model that offloads nothing).
inline int64_t pinned_blocks_bytes(const runtime::Model& m) {
  return device_blocks_bytes(m) - ((m.arena_bytes() + 127) / 128 * 128 - m.arena_bytes());
}

// The arena buffers of a program added up, as if none shared its bytes.
inline int64_t arena_buffers_bytes(const runtime::ProgramSpec& p) {
  int64_t total = 0;
  for (int b = 0; b < p.num_buffers; ++b)
    if (p.buffers[b].storage == runtime::Storage::Arena) total += runtime::buffer_bytes(p.buffers[b], 0);
  return total;
}

// A program's views: the tiles of sequence tiling, reading rows of other buffers.
inline int views(const runtime::ProgramSpec& p) {
  int n = 0;
  for (int b = 0; b < p.num_buffers; ++b) n += p.buffers[b].storage == runtime::Storage::View;
  return n;
}

// The views (tiles' rows) of a program that an OpenCL device cannot alias
// because their first row starts off the 128-byte alignment of a
// sub-buffer's origin (CL_DEVICE_MEM_BASE_ADDR_ALIGN on PoCL): each is
// read through a copy of its own (runtime/device_memory.h).
inline int unaligned_views(const runtime::ProgramSpec& p) {
  int n = 0;
  for (int b = 0; b < p.num_buffers; ++b) {
    const runtime::BufferSpec& s = p.buffers[b];
    if (s.storage == runtime::Storage::View) n += s.offset * runtime::buffer_bytes(s, s.dim + 1) % 128 != 0;
  }
  return n;
}

}  // namespace halyard::testing
