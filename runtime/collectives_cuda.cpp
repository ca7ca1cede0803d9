// A collective's plan in CUDA device memory (collectives.h): the copies and
// sums of its rows queued on the runtime's compute stream, where the
// kernels that wrote its input and will read its output run, so no host
// wait orders them; the transfer is the communicator's (NCCL), which waits
// for the compute stream by an event, and a transfer started in the
// background is joined to the compute stream by another (join), so the
// host waits only in settle().
#include <algorithm>
#include <climits>
#include <string>
#include <vector>

#include "runtime/collectives.h"
#include "runtime/collectives_cuda_args.h"
#include "runtime/cuda_context.h"
#include "runtime/cuda_driver.h"
#include "runtime/error.h"
#include "runtime/gemm.h"

#ifdef HALYARD_COLLECTIVES_FATBIN
extern "C" const unsigned char halyard_collectives_fatbin[];
#endif

namespace halyard::runtime {
namespace {

// The kernels of collectives_cuda.cu, loaded once into the runtime's context.
struct Kernels {
  void* round = nullptr;
  void* sum = nullptr;
  std::string error;
};

const Kernels& kernels() {
  static const Kernels k = [] {
    Kernels out;
#ifndef HALYARD_COLLECTIVES_FATBIN
    out.error = "this runtime was built without nvcc, so it has no CUDA kernels for the collectives (rebuild where "
                "the CUDA toolkit is installed)";
#else
    const CudaKernels loaded =
        load_cuda_kernels(halyard_collectives_fatbin, {"halyard_round_bf16", "halyard_sum_bf16"}, "the collectives' CUDA kernels");
    out.round = loaded.functions[0], out.sum = loaded.functions[1], out.error = loaded.error;
#endif
    return out;
  }();
  return k;
}

// One thread per element of `n`, on `stream`.
template <class Args>
void launch(void* kernel, Args args, int64_t n, void* stream, const char* what) {
  const int64_t blocks = (n + collectives_cuda::kThreads - 1) / collectives_cuda::kThreads;
  if (blocks > INT32_MAX) throw Error(std::string("error: ") + what + ": too many elements for one launch.");
  void* params[] = {&args};
  RuntimeContextScope scope;
  if (int rc = cuda_driver().launch_kernel(kernel, static_cast<unsigned>(blocks), 1, 1, collectives_cuda::kThreads, 1,
                                           1, 0, stream, params, nullptr))
    throw Error(std::string("error: ") + what + ": cuLaunchKernel failed: " + cuda_driver().text(rc));
}

class CudaCollectiveMemory final : public CollectiveMemory {
 public:
  explicit CudaCollectiveMemory(void* stream) : stream_(stream) {}
  ~CudaCollectiveMemory() override {
    const CudaDriver& d = cuda_driver();
    try {
      settle();
    } catch (const Error&) {  // (a failed transfer: its communicator is aborted, the stream can finish)
    }
    if (slots_.empty() || d.ctx_push(runtime_cuda_context().context) != 0) return;
    d.stream_synchronize(stream_);  // (a copy may still read them)
    for (const Slot& s : slots_)
      if (s.address) d.mem_free(s.address);
    void* popped = nullptr;
    d.ctx_pop(&popped);
  }

  void* staging(int64_t bytes, int slot) override {
    if (slots_.size() <= static_cast<size_t>(slot)) slots_.resize(static_cast<size_t>(slot) + 1);
    Slot& s = slots_[static_cast<size_t>(slot)];
    if (bytes <= s.bytes) return address(s.address);
    RuntimeContextScope scope;
    const CudaDriver& d = cuda_driver();
    if (s.address) {
      settle();  // (the stream may wait on a transfer: a dead peer must not hang the synchronize)
      check(d.stream_synchronize(stream_), "cuStreamSynchronize");
      check(d.mem_free(s.address), "cuMemFree");
      s = Slot{};
    }
    if (int rc = d.mem_alloc(&s.address, static_cast<size_t>(bytes)))
      throw Error("error: allocating " + std::to_string(bytes) + " bytes of device memory to stage a collective failed: " +
                  d.text(rc) + "\nfix: a schedule that needs less device memory (halyard-plan shows it).");
    s.bytes = bytes;
    return address(s.address);
  }

  void join(std::unique_ptr<Exchange> transfer) override {
    if (!transfer->join(stream_)) {
      transfer->wait();
      return;
    }
    joined_.push_back(std::move(transfer));
  }

  void settle() override {
    // (Each in order, so the first failure is the one reported; the rest
    // are aborted with their communicator.)
    std::vector<std::unique_ptr<Exchange>> joined;
    joined.swap(joined_);
    for (auto& t : joined) t->wait();
  }

  void rows(const Rows& r, const void* src, void* dst, int64_t esize) override {
    const auto s = reinterpret_cast<unsigned long long>(src) + static_cast<unsigned long long>(r.src_offset * esize);
    const auto t = reinterpret_cast<unsigned long long>(dst) + static_cast<unsigned long long>(r.dst_offset * esize);
    if (r.add) {
      const std::string why = gemm::add_rows_on_device(address_of<float>(t), r.dst_pitch, address_of<const float>(s),
                                                       r.src_pitch, r.width, r.count, stream_);
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
      check(cuda_driver().memcpy_2d_async(&c, stream_), "cuMemcpy2DAsync");
    }
  }

  void* stream() const override { return stream_; }

  void zero(void* dst, int64_t bytes) override {
    RuntimeContextScope scope;
    check(cuda_driver().memset_d8_async(reinterpret_cast<unsigned long long>(dst), 0, static_cast<size_t>(bytes),
                                        stream_),
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

  void* stream_;
  struct Slot {
    unsigned long long address = 0;
    int64_t bytes = 0;
  };
  std::vector<Slot> slots_;
  std::vector<std::unique_ptr<Exchange>> joined_;  // joined to the stream, not yet waited for
};

}  // namespace

namespace {

// A sum over ranks moved in bf16, up to each rank's f32 sums of its part:
// `round` (its output set here) rounds the summands into P rows of `wide`
// (even: the all-to-all moves 32-bit words), the rows go to their ranks, and
// each element's P summands are summed in rank order. Returns the sums
// (`wide` floats in `memory`'s staging, then `extra` floats of it free).
float* sums_from_bf16(collectives_cuda::RoundArgs round, int64_t wide, int64_t extra, Communicator& comm,
                      CollectiveMemory& memory) {
  const Kernels& k = kernels();
  if (!k.error.empty()) throw Error("error: summing gradients from bf16 on the device: " + k.error);
  const int64_t P = comm.size();
  auto* sent = static_cast<uint16_t*>(memory.staging(P * wide * 2 * 2 + (wide + extra) * 4));
  uint16_t* received = sent + P * wide;
  auto* sums = reinterpret_cast<float*>(received + P * wide);
  round.out = sent;
  launch(k.round, round, P * wide, memory.stream(), "rounding to bf16");
  const std::vector<int64_t> words(static_cast<size_t>(P), wide / 2);
  comm.all_to_all_v(reinterpret_cast<const int32_t*>(sent), words.data(), reinterpret_cast<int32_t*>(received),
                    words.data());
  launch(k.sum, collectives_cuda::SumArgs{received, sums, wide, static_cast<int>(P)}, wide, memory.stream(),
         "summing bf16 in f32");
  return sums;
}

}  // namespace

void all_reduce_sum_bf16_on_device(float* data, int64_t n, Communicator& comm, CollectiveMemory& memory) {
  check_ordered(&comm, memory);
  constexpr int64_t kChunk = int64_t{1} << 24;
  const int64_t P = comm.size();
  for (int64_t at = 0; at < n; at += kChunk) {
    // Each rank sums a block of the chunk, the last blocks padded with zeros.
    const int64_t c = std::min(kChunk, n - at), block = ((c + P - 1) / P + 1) / 2 * 2;
    float* sums = sums_from_bf16({data + at, nullptr, 1, c, c, P * block}, block, P * block, comm, memory);
    float* all = sums + block;
    comm.all_gather(sums, block, all);
    memory.rows({Area::Staging, Area::Out, 0, c, 0, c, c, 1}, all, data + at, 4);
  }
}

void reduce_scatter_sum_bf16_on_device(const float* send, float* recv, int64_t n_per_rank, Communicator& comm,
                                       CollectiveMemory& memory) {
  check_ordered(&comm, memory);
  const int64_t P = comm.size(), q = n_per_rank;
  // Chunks of each rank's block: the same columns of all P blocks at once.
  const int64_t columns = std::max<int64_t>(2, (int64_t{1} << 24) / P);
  for (int64_t at = 0; at < q; at += columns) {
    const int64_t w = std::min(columns, q - at), wide = w + w % 2;
    float* sums = sums_from_bf16({send + at, nullptr, P, w, q, wide}, wide, 0, comm, memory);
    memory.rows({Area::Staging, Area::Out, 0, w, 0, w, w, 1}, sums, recv + at, 4);
  }
}

std::unique_ptr<CollectiveMemory> make_cuda_collective_memory(void* stream) {
  const RuntimeCudaContext& c = runtime_cuda_context();
  if (!c.context) throw Error("error: a collective on the device needs a CUDA context: " + c.error);
  return std::make_unique<CudaCollectiveMemory>(stream ? stream : c.stream);
}

}  // namespace halyard::runtime
