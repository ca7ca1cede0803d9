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
  void* comm = nullptr;
  int rc = d.stream_create(&stream, 0);  // 0: blocking (see the header)
  // Non-blocking: the copies on it must not wait for the legacy default stream.
  constexpr unsigned kNonBlocking = 0x1;  // CU_STREAM_NON_BLOCKING
  if (rc == 0) rc = d.stream_create(&comm, kNonBlocking);
  void* popped = nullptr;
  d.ctx_pop(&popped);
  if (rc != 0) {
    c.error = "cuStreamCreate on CUDA device " + std::to_string(device) + " failed: " + d.text(rc);
    return c;
  }
  c.context = ctx;
  c.stream = stream;
  c.comm_stream = comm;
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

CudaCopyStream::CudaCopyStream() {
  const RuntimeCudaContext& c = runtime_cuda_context();
  if (!c.context || !c.comm_stream) error_ = c.error.empty() ? "no communication stream" : c.error;
}

CudaCopyStream::~CudaCopyStream() {
  if (!error_.empty()) return;
  const CudaDriver& d = cuda_driver();
  if (d.ctx_push(runtime_cuda_context().context) != 0) return;
  d.stream_synchronize(runtime_cuda_context().comm_stream);
  for (void* e : events_) d.event_destroy(e);
  void* popped = nullptr;
  d.ctx_pop(&popped);
}

void CudaCopyStream::check(int rc, const char* what) {
  if (rc != 0) throw Error(std::string("error: ") + what + " on the communication stream failed: " + cuda_driver().text(rc));
}

void* CudaCopyStream::event() {
  if (used_ == events_.size()) {
    void* e = nullptr;
    constexpr unsigned kDisableTiming = 0x2;  // CU_EVENT_DISABLE_TIMING: ordering only, cheaper
    check(cuda_driver().event_create(&e, kDisableTiming), "cuEventCreate");
    events_.push_back(e);
  }
  return events_[used_++];
}

CudaKernels load_cuda_kernels(const unsigned char* fatbin, const std::vector<std::string>& names, const char* what) {
  CudaKernels out;
  out.functions.assign(names.size(), nullptr);
  const RuntimeCudaContext& ctx = runtime_cuda_context();
  if (!ctx.context) {
    out.error = ctx.error;
    return out;
  }
  const CudaDriver& drv = cuda_driver();
  if (int rc = drv.ctx_push(ctx.context)) {
    out.error = std::string("loading ") + what + " failed: cuCtxPushCurrent: " + drv.text(rc);
    return out;
  }
  void* module = nullptr;
  int rc = drv.module_load_data(&module, fatbin);
  for (size_t i = 0; i < names.size() && rc == 0; ++i) rc = drv.module_get_function(&out.functions[i], module, names[i].c_str());
  void* popped = nullptr;
  drv.ctx_pop(&popped);
  if (rc != 0) out.error = std::string("loading ") + what + " failed: " + drv.text(rc);
  return out;
}

RuntimeContextScope::RuntimeContextScope() {
  if (int rc = cuda_driver().ctx_push(runtime_cuda_context().context))
    throw Error("error: cuCtxPushCurrent failed: " + cuda_driver().text(rc));
}

RuntimeContextScope::~RuntimeContextScope() {
  void* popped = nullptr;
  cuda_driver().ctx_pop(&popped);
}

int CudaCopyStream::copy(void* host, uint64_t device, size_t bytes, bool to_host) {
  const CudaDriver& d = cuda_driver();
  const RuntimeCudaContext& c = runtime_cuda_context();
  RuntimeContextScope scope;
  void* ready = event();
  check(d.event_record(ready, c.stream), "cuEventRecord");
  check(d.stream_wait_event(c.comm_stream, ready, 0), "cuStreamWaitEvent");
  if (to_host) check(d.memcpy_dtoh_async(host, device, bytes, c.comm_stream), "cuMemcpyDtoHAsync");
  else check(d.memcpy_htod_async(device, host, bytes, c.comm_stream), "cuMemcpyHtoDAsync");
  void* done = event();
  check(d.event_record(done, c.comm_stream), "cuEventRecord");
  done_.push_back(done);
  return static_cast<int>(done_.size()) - 1;
}

int CudaCopyStream::copy_to_host(void* host, uint64_t device, size_t bytes) { return copy(host, device, bytes, true); }

int CudaCopyStream::copy_to_device(uint64_t device, const void* host, size_t bytes) {
  return copy(const_cast<void*>(host), device, bytes, false);  // (only read)
}

void CudaCopyStream::compute_waits(int ticket) {
  RuntimeContextScope scope;
  check(cuda_driver().stream_wait_event(runtime_cuda_context().stream, done_.at(static_cast<size_t>(ticket)), 0),
        "cuStreamWaitEvent");
}

void CudaCopyStream::reset() {
  RuntimeContextScope scope;
  check(cuda_driver().stream_synchronize(runtime_cuda_context().comm_stream), "cuStreamSynchronize");
  done_.clear();
  used_ = 0;
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
