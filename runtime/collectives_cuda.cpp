// A collective's plan in CUDA device memory (collectives.h): the copies and
// sums of its rows queued on the runtime's compute stream, where the
// kernels that wrote its input and will read its output run, so no host
// wait orders them; the transfer is the communicator's (NCCL), which waits
// for the compute stream by an event.
#include <algorithm>
#include <string>

#include "runtime/collectives.h"
#include "runtime/cuda_context.h"
#include "runtime/cuda_driver.h"
#include "runtime/error.h"
#include "runtime/gemm.h"

namespace halyard::runtime {
namespace {

class CudaCollectiveMemory final : public CollectiveMemory {
 public:
  ~CudaCollectiveMemory() override {
    if (!staging_) return;
    const CudaDriver& d = cuda_driver();
    if (d.ctx_push(runtime_cuda_context().context) != 0) return;
    d.stream_synchronize(runtime_cuda_context().stream);  // (a copy may still read it)
    d.mem_free(staging_);
    void* popped = nullptr;
    d.ctx_pop(&popped);
  }

  void* staging(int64_t bytes) override {
    if (bytes <= staging_bytes_) return address(staging_);
    RuntimeContextScope scope;
    const CudaDriver& d = cuda_driver();
    if (staging_) {
      check(d.stream_synchronize(runtime_cuda_context().stream), "cuStreamSynchronize");
      check(d.mem_free(staging_), "cuMemFree");
      staging_ = 0, staging_bytes_ = 0;
    }
    if (int rc = d.mem_alloc(&staging_, static_cast<size_t>(bytes)))
      throw Error("error: allocating " + std::to_string(bytes) + " bytes of device memory to stage a collective failed: " +
                  d.text(rc) + "\nfix: a schedule that needs less device memory (halyard-plan shows it).");
    staging_bytes_ = bytes;
    return address(staging_);
  }

  void rows(const Rows& r, const void* src, void* dst, int64_t esize) override {
    const auto s = reinterpret_cast<unsigned long long>(src) + static_cast<unsigned long long>(r.src_offset * esize);
    const auto t = reinterpret_cast<unsigned long long>(dst) + static_cast<unsigned long long>(r.dst_offset * esize);
    if (r.add) {
      const std::string why = gemm::add_rows_on_device(address_of<float>(t), r.dst_pitch, address_of<const float>(s),
                                                       r.src_pitch, r.width, r.count);
      if (!why.empty()) throw Error("error: summing the replicas of a collective on the device failed: " + why);
      return;
    }
    // The driver takes pitches below 2^31 bytes: runs further apart (a
    // batch row of a long sequence) are copied one by one.
    constexpr int64_t kMaxPitch = (int64_t{1} << 31) - 1;
    const bool far = r.count > 1 && std::max(r.src_pitch, r.dst_pitch) * esize > kMaxPitch;
    RuntimeContextScope scope;
    for (int64_t i = 0; i < (far ? r.count : 1); ++i) {
      CudaMemcpy2D c;
      c.src_memory_type = c.dst_memory_type = kCuMemoryTypeDevice;
      c.src_device = s + static_cast<unsigned long long>(i * r.src_pitch * esize);
      c.dst_device = t + static_cast<unsigned long long>(i * r.dst_pitch * esize);
      c.width_bytes = static_cast<size_t>(r.width * esize);
      c.height = static_cast<size_t>(far ? 1 : r.count);
      // (A single run's pitches are never stepped; the driver still wants
      // them at least its width.)
      c.src_pitch = c.height > 1 ? static_cast<size_t>(r.src_pitch * esize) : c.width_bytes;
      c.dst_pitch = c.height > 1 ? static_cast<size_t>(r.dst_pitch * esize) : c.width_bytes;
      check(cuda_driver().memcpy_2d_async(&c, runtime_cuda_context().stream), "cuMemcpy2DAsync");
    }
  }

  void zero(void* dst, int64_t bytes) override {
    RuntimeContextScope scope;
    check(cuda_driver().memset_d8_async(reinterpret_cast<unsigned long long>(dst), 0, static_cast<size_t>(bytes),
                                        runtime_cuda_context().stream),
          "cuMemsetD8Async");
  }

 private:
  template <typename T>
  static T* address_of(unsigned long long a) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(a));
  }
  static void* address(unsigned long long a) { return address_of<void>(a); }

  static void check(int rc, const char* what) {
    if (rc != 0)
      throw Error(std::string("error: ") + what + " of a collective on the device failed: " + cuda_driver().text(rc));
  }

  unsigned long long staging_ = 0;
  int64_t staging_bytes_ = 0;
};

}  // namespace

std::unique_ptr<CollectiveMemory> make_cuda_collective_memory() {
  const RuntimeCudaContext& c = runtime_cuda_context();
  if (!c.context) throw Error("error: a collective on the device needs a CUDA context: " + c.error);
  return std::make_unique<CudaCollectiveMemory>();
}

}  // namespace halyard::runtime
