#include "runtime/cuda_probe.h"

#include <algorithm>
#include <chrono>

#include "runtime/cuda_driver.h"

namespace halyard::runtime {

CudaProbe::CudaProbe(int device) : device_(device) {
  const CudaDriver& d = cuda_driver();
  if (!d.usable()) {
    why_ = d.why_unusable;
    return;
  }
  int n = 0;
  if (d.device_count(&n) != 0 || n <= device) {
    why_ = "no CUDA device " + std::to_string(device) + " (" + std::to_string(n) + " found)";
    return;
  }
  int dev = 0;
  char name[256] = {};
  void* ctx = nullptr;
  if (d.device_get(&dev, device) != 0 || d.primary_retain(&ctx, dev) != 0) {
    why_ = "CUDA device " + std::to_string(device) + " refused a context";
    return;
  }
  d.device_name(name, sizeof name, dev);
  name_ = name;
  device_ = dev;
  ctx_ = ctx;
  size_t free = 0, total = 0;
  if (d.ctx_push(ctx_) == 0) {
    if (d.mem_info(&free, &total) == 0) total_ = static_cast<int64_t>(total);
    void* popped = nullptr;
    d.ctx_pop(&popped);
  }
}

CudaProbe::~CudaProbe() {
  if (sampler_.joinable()) stop_sampling();
  if (ctx_) cuda_driver().primary_release(device_);
}

int64_t CudaProbe::memory_used_bytes() const {
  if (!ctx_) return -1;
  const CudaDriver& d = cuda_driver();
  if (d.ctx_push(ctx_) != 0) return -1;
  size_t free = 0, total = 0;
  const bool ok = d.mem_info(&free, &total) == 0;
  void* popped = nullptr;
  d.ctx_pop(&popped);
  return ok ? static_cast<int64_t>(total - free) : -1;
}

void CudaProbe::start_sampling(int period_us) {
  if (sampler_.joinable()) stop_sampling();
  peak_ = memory_used_bytes();
  sampling_ = true;
  sampler_ = std::thread([this, period_us] {
    while (sampling_) {
      const int64_t now = memory_used_bytes();
      int64_t seen = peak_;
      while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
      }
      std::this_thread::sleep_for(std::chrono::microseconds(period_us));
    }
  });
}

int64_t CudaProbe::stop_sampling() {
  sampling_ = false;
  if (sampler_.joinable()) sampler_.join();
  return std::max<int64_t>(peak_, memory_used_bytes());
}

}  // namespace halyard::runtime
