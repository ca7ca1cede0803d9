// Device memory for the NCCL tests (test_comm_nccl, test_nccl_single_rank):
// n elements on the current CUDA device, filled from and read back to the
// host; a failing CUDA call throws std::runtime_error naming it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace halyard::testing {

inline void cuda_ok(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess) throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorString(rc));
}

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    cuda_ok(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  }
  explicit DeviceBuffer(const std::vector<T>& values) : DeviceBuffer(values.size()) {
    cuda_ok(cudaMemcpy(p_, values.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() { return static_cast<T*>(p_); }
  std::vector<T> host() const {
    std::vector<T> out(n_);
    cuda_ok(cudaMemcpy(out.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return out;
  }

 private:
  void* p_ = nullptr;
  size_t n_;
};

}  // namespace halyard::testing
