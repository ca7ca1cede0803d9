// The collectives of a generated step program, performed between kernels.
//
// Layouts are the DSL's (row-major, batch outermost). With P ranks and B
// batch rows, rank r holds tokens [r*S/P, (r+1)*S/P) of each row:
//
//   seq_to_heads: x[B, S/P, H, d] -> y[B, S, Hr, d]. Rank r receives every
//     rank's tokens for its heads: [r*H/P, (r+1)*H/P) when P divides H; when H
//     divides P (kv heads fewer than ranks) the single head r*H/P, which P/H
//     ranks then hold as replicas.
//   heads_to_seq: the transpose: y[B, S, Hr, d] -> x[B, S/P, H, d]; replicas
//     of one head are summed (in rank order, so every run adds alike).
//   gather_seq: i32 p[B, S/P] -> [B, S].
//   all_reduce: the sum over ranks, in place of a copy.
//
// Each is planned once, as data (plan_collective): runs of rows copied into
// a staging area, one transfer over the ranks, and runs copied (or summed)
// out of it. The plan depends on the shapes and the number of ranks only,
// so every memory runs the same one: the host's (memcpy and a Communicator
// on host memory), or a GPU's (a CUDA model with an NCCL communicator:
// copies and sums on its compute stream, the transfer on device buffers;
// runtime/collectives_cuda.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/comm.h"
#include "runtime/step_program.h"

namespace halyard::runtime {

// Where a run of rows is read or written: the call's input, its output, or
// the staging area (the blocks sent, then the blocks received).
enum class Area : uint8_t { In, Out, Staging };

// `count` runs of `width` elements: run i from src_offset + i * src_pitch of
// `src` to dst_offset + i * dst_pitch of `dst` (elements), copied, or added
// to what `dst` holds (f32 only: replicated heads).
struct Rows {
  Area src, dst;
  int64_t src_offset, src_pitch, dst_offset, dst_pitch, width, count;
  bool add = false;
};

// The transfer: an all-to-all of equal blocks of `count` elements, an
// all-gather of `count` elements from each rank, or a sum over the ranks of
// `count` elements in place (`to` at to_offset; from == to).
enum class Transfer : uint8_t { AllToAll, AllGather, AllReduce };

struct CollectivePlan {
  CommType type = CommType::F32;
  int64_t staging = 0;       // elements of the staging area
  std::vector<Rows> pack;    // before the transfer
  Transfer transfer = Transfer::AllReduce;
  Area from = Area::In, to = Area::Out;
  int64_t from_offset = 0, to_offset = 0, count = 0;
  int64_t zero_out = 0;      // elements of `out` made zeros before the unpack's sums
  std::vector<Rows> unpack;  // after it
};

// The plan of a collective from `in` to `out` over `ranks` ranks; throws
// Error when the buffers do not fit (a library generated for another mesh).
// `backend` names the communicator in that error.
CollectivePlan plan_collective(CallKind kind, const BufferSpec& in, const BufferSpec& out, int ranks,
                               const char* backend);

// The memory a plan runs in. Pointers are into that memory (host pointers,
// or device addresses); offsets and sizes in the plan are elements of
// elem_bytes each.
class CollectiveMemory {
 public:
  virtual ~CollectiveMemory() = default;
  // At least `bytes`, kept for the next call. Collectives in flight together
  // (started, not yet finished) each stage in a slot of their own.
  virtual void* staging(int64_t bytes, int slot = 0) = 0;
  virtual void rows(const Rows& r, const void* src, void* dst, int64_t elem_bytes) = 0;  // src, dst: the areas' starts
  virtual void zero(void* dst, int64_t bytes) = 0;
  // The stream its copies and sums are queued on (nullptr: done when the
  // call returns, as on the host).
  virtual void* stream() const { return nullptr; }
  // Orders the copies queued from now on after `transfer`'s end. On a
  // device stream by an event, the host not waiting (Exchange::join); the
  // transfer is kept until settle(). Elsewhere by waiting for it now.
  virtual void join(std::unique_ptr<Exchange> transfer) { transfer->wait(); }
  // Waits for every transfer joined so far, each with its communicator's
  // timeout: call it before the host waits for stream() (a copy home, a
  // synchronize), so that a dead peer is that timeout's error, not a hang.
  virtual void settle() {}
};

// Throws Error, naming the fix, when `comm` moves device memory but its
// calls are not ordered after `memory`'s stream: the transfer could read
// rows the copies before it have not written yet (a silently wrong sum, not
// a crash). run_plan and the bf16 sums on the device call it.
void check_ordered(const Communicator* comm, const CollectiveMemory& memory);

// Host memory: memcpy, plain sums, a staging vector.
class HostCollectiveMemory final : public CollectiveMemory {
 public:
  void* staging(int64_t bytes, int slot = 0) override;
  void rows(const Rows& r, const void* src, void* dst, int64_t elem_bytes) override;
  void zero(void* dst, int64_t bytes) override;

 private:
  std::vector<std::vector<float>> staging_;  // by slot
};

// Runs `plan` from `in` to `out` (in `memory`) over `comm`, whose buffers
// must be of that memory; without one (a single rank) the transfer is a copy.
void run_plan(CollectivePlan plan, const void* in, void* out, Communicator* comm, CollectiveMemory& memory);

// run_plan in two halves, for a transfer that runs while the caller goes
// on. start_plan queues the copies before the transfer and starts it (an
// all-to-all in the background where `comm` can: over NCCL, on its
// stream; every other transfer finishes inside start_plan). finish_plan
// joins it (CollectiveMemory::join: on a device, the host does not wait)
// and queues the copies after it. In between, `in` may be overwritten once
// the memory's stream has passed the start, `out` must not be touched, and
// the plan's staging slot is its own; every rank starts and finishes its
// plans in the same order as its other calls.
struct StartedPlan {
  CollectivePlan plan;
  void* out = nullptr;
  char* staging = nullptr;
  std::unique_ptr<Exchange> transfer;  // null: already done
};
StartedPlan start_plan(CollectivePlan plan, const void* in, void* out, Communicator* comm, CollectiveMemory& memory,
                       int slot = 0);
void finish_plan(StartedPlan& started, CollectiveMemory& memory);

// plan_collective and run_plan.
void run_collective(CallKind kind, const BufferSpec& in, const void* in_data, const BufferSpec& out, void* out_data,
                    Communicator& comm, CollectiveMemory& memory);

// The runtime's CUDA memory (runtime/cuda_context.h): copies and zeros on
// the compute stream (cuMemcpy2DAsync, cuMemsetD8Async), sums through
// cuBLAS on it (runtime/gemm.h), a staging allocation grown as needed and
// kept. Methods throw Error naming the driver's error. `stream`: a CUstream
// of the runtime's context to queue on instead (tests: a rank's own, as
// each process has its own on GPUs).
std::unique_ptr<CollectiveMemory> make_cuda_collective_memory(void* stream = nullptr);

// Communicator::all_reduce_sum_bf16 on the runtime's CUDA device memory
// over a communicator of device memory (NCCL), with the same bits: each
// rank's values rounded to bf16 (a kernel of collectives_cuda.cu), moved by
// an all-to-all, summed in f32 in rank order (another), the sums
// all-gathered. In chunks of 2^24 elements, staged in `memory` (one made by
// make_cuda_collective_memory).
void all_reduce_sum_bf16_on_device(float* data, int64_t n, Communicator& comm, CollectiveMemory& memory);
// Communicator::reduce_scatter_sum_bf16 likewise (ZeRO-1's on the device),
// in chunks of the same columns of every rank's block.
void reduce_scatter_sum_bf16_on_device(const float* send, float* recv, int64_t n_per_rank, Communicator& comm,
                                       CollectiveMemory& memory);

}  // namespace halyard::runtime
