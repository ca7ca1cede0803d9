// The CUDA driver API, opened at run time (dlopen of libcuda.so.1) so that
// nothing linking the runtime needs CUDA to start. Internal to the runtime:
// cuda_probe.h and cuda_context.h are its public faces.
#pragma once

#include <string>

namespace halyard::runtime {

// The entry points used, by their stable symbols (_v2 where CUDA renamed
// them); handles are void* so that no CUDA header is needed.
struct CudaDriver {
  using CUresult = int;
  CUresult (*device_count)(int*) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*device_name)(char*, int, int) = nullptr;
  CUresult (*primary_retain)(void**, int) = nullptr;
  CUresult (*primary_release)(int) = nullptr;
  CUresult (*ctx_get_current)(void**) = nullptr;
  CUresult (*ctx_get_device)(int*) = nullptr;
  CUresult (*ctx_push)(void*) = nullptr;
  CUresult (*ctx_pop)(void**) = nullptr;
  CUresult (*mem_info)(size_t*, size_t*) = nullptr;
  CUresult (*stream_create)(void**, unsigned) = nullptr;
  CUresult (*mem_host_register)(void*, size_t, unsigned) = nullptr;
  CUresult (*mem_host_unregister)(void*) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  // Events and asynchronous copies (CudaCopyStream); CUdeviceptr is 64-bit.
  CUresult (*event_create)(void**, unsigned) = nullptr;
  CUresult (*event_destroy)(void*) = nullptr;
  CUresult (*event_record)(void*, void*) = nullptr;
  CUresult (*stream_wait_event)(void*, void*, unsigned) = nullptr;
  CUresult (*stream_synchronize)(void*) = nullptr;
  CUresult (*memcpy_dtoh_async)(void*, unsigned long long, size_t, void*) = nullptr;
  CUresult (*memcpy_htod_async)(unsigned long long, const void*, size_t, void*) = nullptr;
  // Device memory of the runtime's own (a collective's staging), and copies
  // of strided rows within device memory (a collective's packing).
  CUresult (*mem_alloc)(unsigned long long*, size_t) = nullptr;
  CUresult (*mem_free)(unsigned long long) = nullptr;
  CUresult (*memcpy_2d_async)(const void*, void*) = nullptr;  // (const CUDA_MEMCPY2D*, CUstream)
  CUresult (*memset_d8_async)(unsigned long long, unsigned char, size_t, void*) = nullptr;
  // (CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2: kCuMemoryTypeDevice for device memory; an error for plain host memory.)
  CUresult (*pointer_get_attribute)(void*, int, unsigned long long) = nullptr;
  // The runtime's own kernels (attention_cuda.cpp): a fatbin loaded into the
  // current context, and launches with their arguments as kernelParams.
  CUresult (*module_load_data)(void**, const void*) = nullptr;
  CUresult (*module_get_function)(void**, void*, const char*) = nullptr;
  CUresult (*launch_kernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                            void**) = nullptr;

  // Empty once the driver is loaded and cuInit succeeded; otherwise one
  // line saying why not: no libcuda.so.1, an entry point missing, or cuInit's
  // error (no device, driver too old).
  std::string why_unusable;
  bool usable() const { return why_unusable.empty(); }
  std::string text(CUresult rc) const;  // the driver's name for an error
};

// CUDA_MEMCPY2D of cuda.h, field for field (the runtime is built without
// the CUDA headers; tests/runtime/test_nccl_single_rank.cpp checks the
// layout against them where they exist).
struct CudaMemcpy2D {
  size_t src_x_bytes = 0, src_y = 0;
  int src_memory_type = 0;  // CU_MEMORYTYPE_DEVICE = 2
  const void* src_host = nullptr;
  unsigned long long src_device = 0;
  void* src_array = nullptr;
  size_t src_pitch = 0;
  size_t dst_x_bytes = 0, dst_y = 0;
  int dst_memory_type = 0;
  void* dst_host = nullptr;
  unsigned long long dst_device = 0;
  void* dst_array = nullptr;
  size_t dst_pitch = 0;
  size_t width_bytes = 0, height = 0;
};
inline constexpr int kCuMemoryTypeDevice = 2;

// Loaded and initialized on first use (thread-safe); never throws.
const CudaDriver& cuda_driver();

}  // namespace halyard::runtime
