// The CUDA driver as seen from the host, loaded at run time (dlopen of
// libcuda.so.1), so that nothing linking the runtime needs CUDA to start:
//
//   CudaProbe gpu;                       // never throws
//   if (!gpu.present()) puts(gpu.why_absent().c_str());
//   int64_t used = gpu.memory_used_bytes();   // every process's, device 0
//
// Memory figures are the device's (total - free from cuMemGetInfo): what
// every context on the GPU holds, Halide's own context included. They are
// read through the device's primary context, which the probe retains (it
// costs a few hundred MiB of device memory the first time on a device that
// had none, so take a baseline after constructing the probe).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

namespace halyard::runtime {

class CudaProbe {
 public:
  explicit CudaProbe(int device = 0);
  ~CudaProbe();
  CudaProbe(const CudaProbe&) = delete;
  CudaProbe& operator=(const CudaProbe&) = delete;

  bool present() const { return ctx_ != nullptr; }
  // The device's primary context (CUcontext): the one cudart, cuBLAS, NCCL
  // and, through cuda_context.h, every Halide kernel of this process use.
  void* primary_context() const { return ctx_; }
  // One line: no libcuda.so.1, cuInit failed (the driver's reason), no device.
  const std::string& why_absent() const { return why_; }
  const std::string& name() const { return name_; }  // "NVIDIA H200"
  int64_t memory_total_bytes() const { return total_; }
  // -1 when absent or when the driver refuses.
  int64_t memory_used_bytes() const;

  // The most memory in use seen by a thread that samples every `period_us`
  // between start_sampling() and stop_sampling() (which returns it): a step's
  // peak, to within what lives shorter than a period.
  void start_sampling(int period_us = 500);
  int64_t stop_sampling();

 private:
  void* ctx_ = nullptr;
  int device_ = 0;
  int64_t total_ = 0;
  std::string why_, name_;
  std::atomic<bool> sampling_{false};
  std::atomic<int64_t> peak_{0};
  std::thread sampler_;
};

}  // namespace halyard::runtime
