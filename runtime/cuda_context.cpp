#include "runtime/cuda_context.h"

#include <HalideRuntime.h>
#include <HalideRuntimeCuda.h>

#include <atomic>
#include <mutex>

#include "runtime/cuda_driver.h"
#include "runtime/error.h"

// Present only where a CUDA-target library brought Halide's CUDA runtime in:
// weak, so that CPU-only programs link without it.
#pragma weak halide_set_cuda_acquire_context
#pragma weak halide_set_cuda_release_context
#pragma weak halide_set_cuda_get_stream

namespace halyard::runtime {
namespace {

RuntimeCudaContext make_context() {
  RuntimeCudaContext c;
  const CudaDriver& d = cuda_driver();
  if (!d.usable()) {
    c.error = d.why_unusable;
    return c;
  }
  void* current = nullptr;
  int device = 0;
  if (d.ctx_get_current(&current) != 0 || current == nullptr || d.ctx_get_device(&device) != 0) device = 0;
  int dev = 0;
  void* ctx = nullptr;
  if (int rc = d.device_get(&dev, device); rc != 0) {
    c.error = "no CUDA device " + std::to_string(device) + " (cuDeviceGet: " + d.text(rc) + ")";
    return c;
  }
  if (int rc = d.primary_retain(&ctx, dev); rc != 0) {
    c.error = "CUDA device " + std::to_string(device) + " refused its primary context (" + d.text(rc) + ")";
    return c;
  }
  if (int rc = d.ctx_push(ctx); rc != 0) {
    c.error = "cuCtxPushCurrent failed: " + d.text(rc);
    return c;
  }
  void* stream = nullptr;
  const int rc = d.stream_create(&stream, 0);  // 0: blocking (see the header)
  void* popped = nullptr;
  d.ctx_pop(&popped);
  if (rc != 0) {
    c.error = "cuStreamCreate on CUDA device " + std::to_string(device) + " failed: " + d.text(rc);
    return c;
  }
  c.context = ctx;
  c.stream = stream;
  c.device = device;
  return c;
}

// Halide's hooks. An error is reported through halide_error (which Halide
// prints, and the Model's "kernel ... failed" error points to).
int acquire(void* user_context, void** ctx, bool create) {
  static std::atomic<bool> asked{false};  // release asks without create: nothing to release before
  if (!create && !asked) {
    *ctx = nullptr;
    return 0;
  }
  asked = true;
  const RuntimeCudaContext& c = runtime_cuda_context();
  if (!c.context) {
    halide_error(user_context, ("Halyard: no CUDA context for Halide's kernels: " + c.error + "\n").c_str());
    return halide_error_code_generic_error;
  }
  *ctx = c.context;
  return 0;
}

int release(void*) { return 0; }

int get_stream(void*, void*, void** stream) {
  *stream = runtime_cuda_context().stream;
  return 0;
}

}  // namespace

const RuntimeCudaContext& runtime_cuda_context() {
  static const RuntimeCudaContext context = make_context();
  return context;
}

PinnedHost::PinnedHost(void* p, size_t bytes) : p_(p), bytes_(bytes) {
  const RuntimeCudaContext& c = runtime_cuda_context();
  if (!c.context) {
    error_ = c.error;
    return;
  }
  const CudaDriver& d = cuda_driver();
  if (int rc = d.ctx_push(c.context); rc != 0) {
    error_ = "cuCtxPushCurrent failed: " + d.text(rc);
    return;
  }
  constexpr unsigned kPortable = 0x01;  // CU_MEMHOSTREGISTER_PORTABLE
  const int rc = d.mem_host_register(p, bytes, kPortable);
  void* popped = nullptr;
  d.ctx_pop(&popped);
  if (rc != 0) error_ = "cuMemHostRegister of " + std::to_string(bytes) + " bytes failed: " + d.text(rc);
  pinned_ = rc == 0;
}

PinnedHost::~PinnedHost() {
  if (!pinned_) return;
  const CudaDriver& d = cuda_driver();
  if (d.ctx_push(runtime_cuda_context().context) != 0) return;
  d.mem_host_unregister(p_);
  void* popped = nullptr;
  d.ctx_pop(&popped);
}

void use_runtime_cuda_context() {
  static std::once_flag installed;
  if (!halide_set_cuda_acquire_context || !halide_set_cuda_release_context || !halide_set_cuda_get_stream)
    throw Error("error: a CUDA-target model runs in a program without Halide's CUDA runtime\n"
                "fix: link the model's library as halyard_add_model makes it (it links "
                "halyard_halide_runtime_<target>).");
  std::call_once(installed, [] {
    halide_set_cuda_acquire_context(&acquire);
    halide_set_cuda_release_context(&release);
    halide_set_cuda_get_stream(&get_stream);
    // Device buffers freed at the end of a step (and Halide's temporaries)
    // go to Halide's pool and serve the next step, instead of a cuMemFree
    // and a cuMemAlloc per buffer per step.
    halide_reuse_device_allocations(nullptr, true);
  });
}

}  // namespace halyard::runtime
