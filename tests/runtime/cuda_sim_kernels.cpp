// The collectives' CUDA kernels (runtime/collectives_cuda.cu), emulated
// (tests/runtime/cuda_emulation.h), registered with the simulated driver
// (tests/cuda_sim.h) under their names, so that collectives_cuda.cpp's
// launches run them. A translation unit of its own: the emulator's CUDA
// names must not meet the CUDA headers.
#include "tests/runtime/cuda_emulation.h"

#include "runtime/collectives_cuda.cu"

#include "tests/cuda_sim.h"

namespace halyard::testing {

void register_emulated_collectives_kernels() {
  register_simulated_kernel("halyard_round_bf16", sizeof(RoundArgs), [](unsigned grid, unsigned block, const void* a) {
    cuda_emulation::launch(halyard_round_bf16, grid, 1, 1, block, *static_cast<const RoundArgs*>(a));
  });
  register_simulated_kernel("halyard_sum_bf16", sizeof(SumArgs), [](unsigned grid, unsigned block, const void* a) {
    cuda_emulation::launch(halyard_sum_bf16, grid, 1, 1, block, *static_cast<const SumArgs*>(a));
  });
}

}  // namespace halyard::testing
