// The CUDA context and stream every Halide kernel of this process runs in.
//
// Halide's CUDA runtime makes a context of its own by default (cuCtxCreate),
// and memory of one context is not usable from another: cuBLAS, cuDNN, NCCL
// and the CUDA runtime API all work in the device's primary context. So a
// Model of a CUDA target calls use_runtime_cuda_context(), which hands
// Halide the primary context of this thread's device (the one whose context
// is current when the first kernel runs, e.g. after make_nccl_communicator's
// cudaSetDevice; device 0 when none is) and one compute stream made in it
// (and a communication stream beside it: CudaCopyStream).
// The stream is a blocking one: Halide's copies between host and device are
// synchronous calls on the legacy default stream, which then wait for the
// kernels queued before them. It also turns on Halide's reuse of device
// allocations, so that the buffers of one step serve the next.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace halyard::runtime {

// Installs the hooks in Halide's CUDA runtime (once; later calls do
// nothing). Throws Error when this program has no Halide CUDA runtime
// linked (no CUDA-target library), which is a build mistake.
void use_runtime_cuda_context();

struct RuntimeCudaContext {
  void* context = nullptr;  // CUcontext: the device's primary context
  void* stream = nullptr;   // CUstream: where Halide launches kernels
  void* comm_stream = nullptr;  // CUstream: copies that run beside the kernels (CudaCopyStream)
  int device = -1;
  std::string error;        // why there is none (no driver, no device), or empty
};
// What the hooks handed (or would hand) Halide; made on first call.
const RuntimeCudaContext& runtime_cuda_context();

// The runtime's context current on this thread for a scope's driver calls
// (throws Error when the driver refuses).
struct RuntimeContextScope {
  RuntimeContextScope();
  ~RuntimeContextScope();
  RuntimeContextScope(const RuntimeContextScope&) = delete;
  RuntimeContextScope& operator=(const RuntimeContextScope&) = delete;
};

// The kernels `names` of a fatbin the runtime embeds (cuda_fatbin.cpp.in),
// loaded into the runtime's context: functions[i] is names[i]'s, or
// nullptr; `error` says why they are missing (no context, the driver's
// refusal), empty when all are there.
struct CudaKernels {
  std::vector<void*> functions;
  std::string error;
};
CudaKernels load_cuda_kernels(const unsigned char* fatbin, const std::vector<std::string>& names, const char* what);

// Host memory page-locked for every CUDA context (cuMemHostRegister,
// portable) while the object lives. Halide's copies between pageable memory
// and the device go through a staging buffer of the driver, at about half
// the link's rate, and no copy from pageable memory can run asynchronously;
// a pinned range is copied by the GPU's DMA engines directly.
class PinnedHost {
 public:
  // Pins [p, p + bytes) in the runtime's context; error() says why not (no
  // device, the driver refused: RLIMIT_MEMLOCK, unsupported system).
  PinnedHost(void* p, size_t bytes);
  ~PinnedHost();
  PinnedHost(const PinnedHost&) = delete;
  PinnedHost& operator=(const PinnedHost&) = delete;
  size_t bytes() const { return pinned_ ? bytes_ : 0; }
  const std::string& error() const { return error_; }

 private:
  void* p_;
  size_t bytes_;
  bool pinned_ = false;
  std::string error_;
};

// Copies between device and pinned host memory on the runtime's
// communication stream, beside the kernels of its compute stream, ordered
// against them by events: a copy starts after everything queued on the
// compute stream before it, and the compute stream waits for it where the
// caller says (runtime/offload_windows.h gives where). Methods throw Error
// naming the driver's error. Tickets count from 0 after each reset().
class CudaCopyStream {
 public:
  CudaCopyStream();  // error() says why it cannot run (then use synchronous copies)
  ~CudaCopyStream();
  CudaCopyStream(const CudaCopyStream&) = delete;
  CudaCopyStream& operator=(const CudaCopyStream&) = delete;
  const std::string& error() const { return error_; }

  int copy_to_host(void* host, uint64_t device, size_t bytes);
  int copy_to_device(uint64_t device, const void* host, size_t bytes);
  void compute_waits(int ticket);  // work queued on the compute stream from here on runs after the copy
  void reset();                    // the host waits for every copy queued; tickets count from 0 again

 private:
  int copy(void* host, uint64_t device, size_t bytes, bool to_host);
  void* event();  // the pool's next event (reused step to step)
  void check(int rc, const char* what);
  std::vector<void*> events_;  // reused step to step
  size_t used_ = 0;
  std::vector<void*> done_;  // by ticket: recorded on the communication stream after the copy
  std::string error_;
};

}  // namespace halyard::runtime
