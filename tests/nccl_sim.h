// The simulated CUDA runtime and NCCL of tests/runtime/nccl_sim.cpp: what a
// test linked with it (instead of libcudart and libnccl) may set.
#pragma once

namespace halyard::testing {

// How many CUDA devices cudaGetDeviceCount reports (4 until set).
void set_simulated_devices(int n);

}  // namespace halyard::testing
