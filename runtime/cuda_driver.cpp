#include "runtime/cuda_driver.h"

#include <dlfcn.h>

#include <type_traits>

namespace halyard::runtime {

std::string CudaDriver::text(CUresult rc) const {
  const char* s = nullptr;
  if (error_string && error_string(rc, &s) == 0 && s) return s;
  return "CUDA driver error " + std::to_string(rc);
}

namespace {

CudaDriver load() {
  CudaDriver d;
  void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (!lib) {
    d.why_unusable = "no CUDA driver (libcuda.so.1 not found)";
    return d;
  }
  bool ok = true;
  auto get = [&](auto& f, const char* name) {
    f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(lib, name));
    ok = ok && f != nullptr;
  };
  CudaDriver::CUresult (*init)(unsigned) = nullptr;
  get(init, "cuInit");
  get(d.device_count, "cuDeviceGetCount");
  get(d.device_get, "cuDeviceGet");
  get(d.device_name, "cuDeviceGetName");
  get(d.primary_retain, "cuDevicePrimaryCtxRetain");
  get(d.primary_release, "cuDevicePrimaryCtxRelease_v2");
  get(d.ctx_get_current, "cuCtxGetCurrent");
  get(d.ctx_get_device, "cuCtxGetDevice");
  get(d.ctx_push, "cuCtxPushCurrent_v2");
  get(d.ctx_pop, "cuCtxPopCurrent_v2");
  get(d.mem_info, "cuMemGetInfo_v2");
  get(d.stream_create, "cuStreamCreate");
  get(d.mem_host_register, "cuMemHostRegister_v2");
  get(d.mem_host_unregister, "cuMemHostUnregister");
  get(d.error_string, "cuGetErrorString");
  get(d.event_create, "cuEventCreate");
  get(d.event_destroy, "cuEventDestroy_v2");
  get(d.event_record, "cuEventRecord");
  get(d.stream_wait_event, "cuStreamWaitEvent");
  get(d.stream_synchronize, "cuStreamSynchronize");
  get(d.memcpy_dtoh_async, "cuMemcpyDtoHAsync_v2");
  get(d.memcpy_htod_async, "cuMemcpyHtoDAsync_v2");
  get(d.mem_alloc, "cuMemAlloc_v2");
  get(d.mem_free, "cuMemFree_v2");
  get(d.memcpy_2d_async, "cuMemcpy2DAsync_v2");
  get(d.memset_d8_async, "cuMemsetD8Async");
  get(d.pointer_get_attribute, "cuPointerGetAttribute");
  get(d.module_load_data, "cuModuleLoadData");
  get(d.module_get_function, "cuModuleGetFunction");
  get(d.launch_kernel, "cuLaunchKernel");
  if (!ok) {
    d.why_unusable = "libcuda.so.1 lacks a driver entry point (driver too old?)";
    return d;
  }
  if (const int rc = init(0); rc != 0) d.why_unusable = "no CUDA device (cuInit: " + d.text(rc) + ")";
  return d;
}

}  // namespace

const CudaDriver& cuda_driver() {
  static const CudaDriver driver = load();
  return driver;
}

}  // namespace halyard::runtime
