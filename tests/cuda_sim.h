// The simulated CUDA runtime, driver, cuBLAS and NCCL of
// tests/runtime/cuda_sim.cpp (built as tests' libcuda.so.1, with
// libcublas.so.13 beside it naming the same file): what a test linked with
// it may set.
#pragma once

#include <cstddef>

namespace halyard::testing {

// How many CUDA devices cudaGetDeviceCount and cuDeviceGetCount report (4
// until set).
void set_simulated_devices(int n);

// While on, every address counts as device memory of the calling thread's
// device (for tests whose buffers are host vectors).
void treat_host_memory_as_device(bool on);

// A kernel of the runtime's fatbins run by the emulator
// (tests/runtime/cuda_emulation.h): cuModuleGetFunction finds it by name,
// and cuLaunchKernel copies its one argument (a struct of arg_bytes) and
// runs it on the stream with a 1-D grid and block.
using SimulatedKernel = void (*)(unsigned grid_x, unsigned block_x, const void* args);
void register_simulated_kernel(const char* name, size_t arg_bytes, SimulatedKernel kernel);

}  // namespace halyard::testing
