// The NCCL communicator: one rank, one GPU, device buffers (see
// make_nccl_communicator in comm.h for what differs from the MPI backend).
// This file needs no MPI: the bootstrap over MPI_COMM_WORLD lives in
// comm_nccl_mpi.cpp, and make_nccl_single_rank() here makes a group of one
// for GPU nodes that have no MPI (scripts/gpu_check.sh).
//
// The NCCL communicator is non-blocking, so no NCCL call can wait on a peer:
// a call that would returns ncclInProgress, and ncclCommGetAsyncError is polled
// until the work is on the stream. Completion is then a cudaEvent polled with
// cudaEventQuery. At the deadline, or on any NCCL or CUDA error, the
// communicator is aborted (ncclCommAbort ends kernels stuck on a dead peer) and
// every later call throws, quoting the first failure.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm.h"
#include "runtime/comm_nccl_open.h"
#include "runtime/error.h"

namespace halyard::runtime {
namespace {

using nccl_detail::deadline_after;
using nccl_detail::poll_until;

ncclDataType_t nccl_type(CommType t) {
  switch (t) {
    case CommType::F32: return ncclFloat32;
    case CommType::I32: return ncclInt32;
    case CommType::F64: return ncclFloat64;
    case CommType::I64: return ncclInt64;
    case CommType::BF16: return ncclBfloat16;  // moved, never summed
  }
  return ncclFloat32;
}

// Switches this thread to `device` and back: the caller's current device is
// its own business, but the stream and buffers of a call live on ours.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    set_ = previous_ == device ? cudaSuccess : cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0 && set_ == cudaSuccess) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t result() const { return set_; }

 private:
  int previous_ = -1;
  cudaError_t set_ = cudaSuccess;
};

class NcclCommunicator final : public Communicator {
 public:
  // Only checks the timeout (the base class words that error); open() does the
  // rest. `on_failure` runs before any error is thrown (the MPI bootstrap
  // marks the process so that it does not finalize MPI with a dead peer).
  NcclCommunicator(int rank, int size, double timeout_s, std::function<void()> on_failure)
      : Communicator(rank, size, timeout_s), on_failure_(std::move(on_failure)) {
    if (!on_failure_) on_failure_ = [] {};
  }

  ~NcclCommunicator() override {
    if (device_ < 0) return;
    DeviceScope on(device_);
    if (comm_ != nullptr) {
      // Finalize waits for the peers to quiesce; a peer that never does costs
      // one timeout, then the communicator is aborted rather than leaked.
      const ncclResult_t rc = ncclCommFinalize(comm_);
      ncclResult_t state = rc;
      if (rc == ncclInProgress)
        poll_until(deadline_after(timeout_s()), [&] {
          if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
          return state != ncclInProgress;
        });
      if (state == ncclSuccess)
        ncclCommDestroy(comm_);
      else
        ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (scratch_ != nullptr) cudaFree(scratch_);
  }

  const char* backend() const override { return "NCCL"; }
  bool moves_device_memory() const override { return true; }

  void use_streams(void* stream, void* after) override {
    run_on_ = static_cast<cudaStream_t>(stream);
    after_ = static_cast<cudaStream_t>(after);
  }
  void* runs_after() const override { return after_; }

  // Makes the stream, the events and the scratch buffer on `device`.
  void prepare(int device, const std::string& who) {
    device_ = device;
    auto cuda = [&](cudaError_t rc, const char* call) {
      if (rc == cudaSuccess) return;
      on_failure_();
      throw Error("error: " + who + ": " + call + " on CUDA device " + std::to_string(device_) +
                  " failed: " + cudaGetErrorString(rc));
    };
    DeviceScope on(device_);
    cuda(on.result(), "cudaSetDevice");
    // Non-blocking: the caller's work on the legacy default stream must not
    // serialize with ours.
    cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    cuda(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    cuda(cudaMalloc(&scratch_, kMinScratch), "cudaMalloc");
    scratch_bytes_ = kMinScratch;
  }

  // Makes the stream, the event, the scratch buffer and the NCCL communicator
  // on `device`; every rank passes the same id.
  void open(int device, const ncclUniqueId& id) {
    const std::string who = "make_nccl_communicator on rank " + std::to_string(rank()) + " of " +
                            std::to_string(size());
    prepare(device, who);
    DeviceScope on(device_);

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t made = nullptr;
    ncclResult_t state = ncclCommInitRankConfig(&made, size(), id, rank(), &config);
    // Only a call that started leaves a handle worth asking (or aborting).
    if (state == ncclSuccess || state == ncclInProgress) {
      comm_ = made;
      const bool finished = poll_until(deadline_after(timeout_s()), [&] {
        ncclResult_t query = ncclCommGetAsyncError(comm_, &state);
        if (query != ncclSuccess) state = query;
        return state != ncclInProgress;
      });
      if (!finished) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        on_failure_();
        throw Error("error: " + who + " timed out after " + seconds_string(timeout_s()) +
                    " s waiting for a peer (dead or stuck?) in ncclCommInitRankConfig\n"
                    "every rank must make its communicators in the same order; NCCL_DEBUG=INFO shows how far "
                    "the ranks got.");
      }
    }
    if (state != ncclSuccess) {
      const std::string detail = comm_ != nullptr ? last_error() : "";
      if (comm_ != nullptr) ncclCommAbort(comm_);
      comm_ = nullptr;
      on_failure_();
      throw Error("error: " + who + ": ncclCommInitRankConfig on CUDA device " + std::to_string(device_) +
                  " failed: " + ncclGetErrorString(state) + detail +
                  (state == ncclInvalidUsage ? "\nNCCL needs one GPU per rank; fix: run at most as many ranks per "
                                               "node as it has GPUs."
                                             : ""));
    }
  }

 protected:
  void do_all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                       CommType type) override {
    const CommOp op = CommOp::AllToAllV;
    throw_if_broken(op);
    check_own_block(op, send_counts, recv_counts);
    OnDevice on(*this, op);
    queue_all_to_all(op, send, send_counts, recv, recv_counts, type);
    wait(op, "ncclGroupEnd");
  }

  // Queued now; the Exchange waits for it, or orders a stream after it.
  std::unique_ptr<Exchange> do_start_all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                                                  const int64_t* recv_counts, CommType type) override {
    const CommOp op = CommOp::AllToAllV;
    throw_if_broken(op);
    check_own_block(op, send_counts, recv_counts);
    OnDevice on(*this, op);
    int64_t elements = 0;
    for (int p = 0; p < size(); ++p) elements += send_counts[p];
    queue_all_to_all(op, send, send_counts, recv, recv_counts, type);
    return in_background(op, "ncclGroupEnd",
                         "the all-to-all of " + std::to_string(elements) + " " + comm_type_name(type) +
                             " started in the background did not finish.");
  }

  void do_all_reduce_sum(void* data, int64_t n, CommType type) override {
    const CommOp op = CommOp::AllReduceSum;
    throw_if_broken(op);
    if (n == 0) return;
    const bool on_host = !is_device_buffer(op, "data", data);
    OnDevice on(*this, op);
    const size_t bytes = static_cast<size_t>(n * comm_type_size(type));
    void* buffer = data;
    if (on_host) {  // the scalar overloads, and callers that summed on the CPU
      reserve_scratch(op, bytes);
      buffer = scratch_;
      check_cuda(cudaMemcpyAsync(buffer, data, bytes, cudaMemcpyHostToDevice, stream()), op, "cudaMemcpyAsync");
    }
    check_nccl(ncclAllReduce(buffer, buffer, static_cast<size_t>(n), nccl_type(type), ncclSum, comm_, stream()), op,
               "ncclAllReduce");
    wait(op, "ncclAllReduce");
    // Only now, with the stream idle: a copy queued behind a collective that
    // never ends would block the host in cudaMemcpy, past any timeout.
    if (on_host) check_cuda(cudaMemcpy(data, buffer, bytes, cudaMemcpyDeviceToHost), op, "cudaMemcpy");
  }

  void do_all_gather(const void* send, int64_t n, void* recv, CommType type) override {
    const CommOp op = CommOp::AllGather;
    throw_if_broken(op);
    if (n == 0) return;
    // Host buffers on both sides are staged through the GPU (split() gathers
    // the world ranks of its group so); one of each is a mistake.
    const bool on_host = !is_device_buffer(op, "send", send) && !is_device_buffer(op, "recv", recv);
    if (!on_host) {
      check_device_buffer(op, "send", send);
      check_device_buffer(op, "recv", recv);
    }
    OnDevice on(*this, op);
    const size_t bytes = static_cast<size_t>(n * comm_type_size(type));
    const void* from = send;
    void* to = recv;
    if (on_host) {
      reserve_scratch(op, bytes * static_cast<size_t>(size() + 1));
      from = scratch_;
      to = static_cast<char*>(scratch_) + bytes;
      check_cuda(cudaMemcpyAsync(scratch_, send, bytes, cudaMemcpyHostToDevice, stream()), op, "cudaMemcpyAsync");
    }
    check_nccl(ncclAllGather(from, to, static_cast<size_t>(n), nccl_type(type), comm_, stream()), op,
               "ncclAllGather");
    wait(op, "ncclAllGather");
    if (on_host) check_cuda(cudaMemcpy(recv, to, bytes * static_cast<size_t>(size()), cudaMemcpyDeviceToHost), op, "cudaMemcpy");
  }

  void do_reduce_scatter_sum(const void* send, void* recv, int64_t n_per_rank, CommType type) override {
    const CommOp op = CommOp::ReduceScatterSum;
    throw_if_broken(op);
    if (n_per_rank == 0) return;
    check_device_buffer(op, "send", send);
    check_device_buffer(op, "recv", recv);
    OnDevice on(*this, op);
    check_nccl(ncclReduceScatter(send, recv, static_cast<size_t>(n_per_rank), nccl_type(type), ncclSum, comm_,
                                 stream()),
               op, "ncclReduceScatter");
    wait(op, "ncclReduceScatter");
  }

  // The tag was checked for range by the base class; NCCL matches by order.
  void do_send(const void* data, int64_t n, int peer, int tag, CommType type) override {
    const CommOp op = CommOp::Send;
    throw_if_broken(op);
    if (n == 0) return;
    check_device_buffer(op, "data", data);
    OnDevice on(*this, op);
    check_nccl(ncclSend(data, static_cast<size_t>(n), nccl_type(type), peer, comm_, stream()), op, "ncclSend");
    wait(op, "ncclSend",
         "rank " + std::to_string(peer) + " did not receive the message (" + std::to_string(n) + " " +
             comm_type_name(type) + ", tag " + std::to_string(tag) +
             "); NCCL sends complete only when the peer receives, so a pair that both send first waits forever.");
  }

  void do_recv(void* data, int64_t n, int peer, int tag, CommType type) override {
    const CommOp op = CommOp::Recv;
    throw_if_broken(op);
    if (n == 0) return;
    check_device_buffer(op, "data", data);
    OnDevice on(*this, op);
    check_nccl(ncclRecv(data, static_cast<size_t>(n), nccl_type(type), peer, comm_, stream()), op, "ncclRecv");
    wait(op, "ncclRecv",
         "no message (" + std::to_string(n) + " " + comm_type_name(type) + ", tag " + std::to_string(tag) +
             ") came from rank " + std::to_string(peer) + ".");
  }

  // Ring attention's pass: one send and one receive in one NCCL group (no
  // order can deadlock), queued now; wait() waits for them, with the timeout.
  std::unique_ptr<Exchange> do_start_exchange(const void* send, void* recv, int64_t n, int to, int from, int tag,
                                              CommType type) override {
    const CommOp op = CommOp::Send;
    throw_if_broken(op);
    if (n == 0) return std::make_unique<Done>();
    check_device_buffer(op, "send", send);
    check_device_buffer(op, "recv", recv);
    OnDevice on(*this, op);
    check_nccl(ncclGroupStart(), op, "ncclGroupStart");
    check_nccl(ncclSend(send, static_cast<size_t>(n), nccl_type(type), to, comm_, stream()), op, "ncclSend");
    check_nccl(ncclRecv(recv, static_cast<size_t>(n), nccl_type(type), from, comm_, stream()), op, "ncclRecv");
    check_nccl(ncclGroupEnd(), op, "ncclGroupEnd");
    const std::string detail = "the pass of " + std::to_string(n) + " " + comm_type_name(type) + " (tag " +
                               std::to_string(tag) + ") to rank " + std::to_string(to) + " and from rank " +
                               std::to_string(from) + " did not finish.";
    return in_background(op, "ncclGroupEnd", detail);
  }

  // A sum queued now (a gradient bucket); wait() waits for it, with the timeout.
  std::unique_ptr<Exchange> do_start_all_reduce_sum(float* data, int64_t n) override {
    const CommOp op = CommOp::AllReduceSum;
    throw_if_broken(op);
    if (n == 0) return std::make_unique<Done>();
    check_device_buffer(op, "data", data);
    OnDevice on(*this, op);
    check_nccl(ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat32, ncclSum, comm_, stream()), op,
               "ncclAllReduce");
    const std::string detail = "the sum of " + std::to_string(n) + " f32 in the background did not finish.";
    return in_background(op, "ncclAllReduce", detail);
  }

  // ncclCommSplit: the group shares this one's device and streams (an sp
  // group of a dp x sp mesh). Every rank of this communicator calls it.
  std::unique_ptr<Communicator> do_split(int color, int key) override {
    const CommOp op = CommOp::Barrier;  // (how errors name this communicator's state)
    throw_if_broken(op);
    const std::string who = "split on rank " + std::to_string(rank()) + " of " + std::to_string(size()) + " (NCCL)";
    DeviceScope on(device_);
    check_cuda(on.result(), op, "cudaSetDevice");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t made = nullptr;
    ncclResult_t state = ncclCommSplit(comm_, color, key, &made, &config);
    if (state == ncclInProgress || state == ncclSuccess) {
      ncclComm_t asked = made != nullptr ? made : comm_;
      const bool finished = poll_until(deadline_after(timeout_s()), [&] {
        const ncclResult_t query = ncclCommGetAsyncError(asked, &state);
        if (query != ncclSuccess) state = query;
        return state != ncclInProgress;
      });
      if (!finished) {
        if (made != nullptr) ncclCommAbort(made);
        fail(timeout_message(op, {}, "ncclCommSplit was still in progress; every rank must split in the same order."),
             who + " timed out");
      }
    }
    if (state != ncclSuccess) {
      if (made != nullptr) ncclCommAbort(made);
      fail("error: " + who + ": ncclCommSplit failed: " + ncclGetErrorString(state) + last_error(),
           who + ": ncclCommSplit failed");
    }
    int sub_rank = 0, sub_size = 1;
    ncclCommUserRank(made, &sub_rank);
    ncclCommCount(made, &sub_size);
    auto sub = std::make_unique<NcclCommunicator>(sub_rank, sub_size, timeout_s(), on_failure_);
    sub->comm_ = made;  // (its destructor finalizes it, after any failure below)
    sub->prepare(device_, who);
    sub->use_streams(run_on_, after_);
    return sub;
  }

  void do_barrier() override {
    const CommOp op = CommOp::Barrier;
    throw_if_broken(op);
    OnDevice on(*this, op);
    check_nccl(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream()), op, "ncclAllReduce");
    wait(op, "ncclAllReduce");
  }

 private:
  static constexpr size_t kMinScratch = 256;

  class Done final : public Exchange {
   public:
    void wait() override {}
  };
  // Work queued in the background (a ring pass, a sum, an all-to-all),
  // waited for by wait(); `end` (owned) is recorded on the stream right
  // after it, for join() and wait().
  class Pass final : public Exchange {
   public:
    Pass(NcclCommunicator& comm, CommOp op, const char* call, std::string detail, cudaEvent_t end)
        : comm_(comm), op_(op), call_(call), detail_(std::move(detail)), end_(end) {}
    ~Pass() override { cudaEventDestroy(end_); }  // (a pending record still completes)
    void wait() override {
      if (waited_) return;
      waited_ = true;
      DeviceScope on(comm_.device_);
      comm_.check_cuda(on.result(), op_, "cudaSetDevice");
      comm_.wait_for(end_, op_, call_, detail_);
    }
    bool join(void* stream) override {
      if (waited_) return true;
      comm_.throw_if_broken(op_);
      DeviceScope on(comm_.device_);
      comm_.check_cuda(on.result(), op_, "cudaSetDevice");
      comm_.check_cuda(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), end_, 0), op_, "cudaStreamWaitEvent");
      return true;
    }

   private:
    NcclCommunicator& comm_;
    CommOp op_;
    const char* call_;
    std::string detail_;
    cudaEvent_t end_;
    bool waited_ = false;
  };

  void check_own_block(CommOp op, const int64_t* send_counts, const int64_t* recv_counts) const {
    const int me = rank();
    if (send_counts[me] != recv_counts[me])
      throw Error("error: " + where(op) + ": send_counts[" + std::to_string(me) + "] is " +
                  std::to_string(send_counts[me]) + " but recv_counts[" + std::to_string(me) + "] is " +
                  std::to_string(recv_counts[me]) +
                  "; the block a rank sends itself is the block it receives from itself, so they must be equal.");
  }

  // The all-to-all's copy of this rank's own block and its sends and
  // receives, queued on stream() (inside an OnDevice scope).
  void queue_all_to_all(CommOp op, const void* send, const int64_t* send_counts, void* recv,
                        const int64_t* recv_counts, CommType type) {
    check_device_buffer(op, "send", send);
    check_device_buffer(op, "recv", recv);
    const int me = rank();
    const int64_t esize = comm_type_size(type);
    auto send_at = [&](int64_t elements) { return static_cast<const char*>(send) + elements * esize; };
    auto recv_at = [&](int64_t elements) { return static_cast<char*>(recv) + elements * esize; };
    int64_t send_offset = 0, recv_offset = 0;
    for (int p = 0; p < me; ++p) send_offset += send_counts[p], recv_offset += recv_counts[p];
    if (send_counts[me] > 0)
      check_cuda(cudaMemcpyAsync(recv_at(recv_offset), send_at(send_offset),
                                 static_cast<size_t>(send_counts[me] * esize), cudaMemcpyDeviceToDevice, stream()),
                 op, "cudaMemcpyAsync");
    // Zero blocks are skipped on both sides alike: recv_counts[p] here is
    // send_counts[me] on p, so the pairs still match.
    check_nccl(ncclGroupStart(), op, "ncclGroupStart");
    send_offset = recv_offset = 0;
    for (int p = 0; p < size(); ++p) {
      if (p != me && send_counts[p] > 0)
        check_nccl(ncclSend(send_at(send_offset), static_cast<size_t>(send_counts[p]), nccl_type(type), p, comm_,
                            stream()),
                   op, "ncclSend");
      if (p != me && recv_counts[p] > 0)
        check_nccl(ncclRecv(recv_at(recv_offset), static_cast<size_t>(recv_counts[p]), nccl_type(type), p, comm_,
                            stream()),
                   op, "ncclRecv");
      send_offset += send_counts[p];
      recv_offset += recv_counts[p];
    }
    check_nccl(ncclGroupEnd(), op, "ncclGroupEnd");
  }

  void throw_if_broken(CommOp op) const {
    if (failure_.empty()) return;
    throw Error("error: " + where(op) + ": the communicator is broken by an earlier failure:\n  " + failure_ +
                "\na failed call cannot be undone; report it and exit (then restart from the last checkpoint).");
  }

  // NCCL's own account of the last error, as a line to append ("" if none).
  std::string last_error() const {
    const char* text = ncclGetLastError(comm_);
    return text != nullptr && *text != 0 ? std::string("\n  NCCL: ") + text : "";
  }

  [[noreturn]] void fail(const std::string& message, const std::string& summary) {
    failure_ = summary;
    on_failure_();
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    throw Error(message);
  }

  void check_nccl(ncclResult_t rc, CommOp op, const char* call) {
    last_result_ = rc;
    if (rc == ncclSuccess || rc == ncclInProgress) return;
    fail("error: " + where(op) + ": " + call + " failed: " + ncclGetErrorString(rc) + last_error() +
             "\na peer may have died, or the calls of the ranks disagree; this communicator cannot be used any more.",
         where(op) + ": " + call + " failed: " + ncclGetErrorString(rc));
  }

  void check_cuda(cudaError_t rc, CommOp op, const char* call) {
    if (rc == cudaSuccess) return;
    fail("error: " + where(op) + ": " + call + " on CUDA device " + std::to_string(device_) +
             " failed: " + cudaGetErrorString(rc) + "\nthis communicator cannot be used any more.",
         where(op) + ": " + call + " failed: " + cudaGetErrorString(rc));
  }

  // True for memory this rank's GPU can hand to NCCL; false for host memory.
  // Memory of another GPU is a user mistake and throws.
  bool is_device_buffer(CommOp op, const char* name, const void* p) const {
    if (p == nullptr) return true;  // only ever with zero elements (the base checked)
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
      cudaGetLastError();  // not sticky: an unknown pointer is host memory
      return false;
    }
    if (attributes.type == cudaMemoryTypeManaged) return true;
    if (attributes.type != cudaMemoryTypeDevice) return false;
    if (attributes.device == device_) return true;
    throw Error("error: " + where(op) + ": " + name + " is memory of CUDA device " +
                std::to_string(attributes.device) + ", but this rank's NCCL communicator runs on CUDA device " +
                std::to_string(device_) + ".\nfix: allocate the buffers after make_nccl_communicator(), which makes "
                "its device the current one.");
  }

  void check_device_buffer(CommOp op, const char* name, const void* p) const {
    if (is_device_buffer(op, name, p)) return;
    throw Error("error: " + where(op) + ": " + name +
                " is host memory, but the NCCL backend moves device memory.\nfix: pass a buffer from cudaMalloc "
                "(or cudaMallocManaged), or use make_mpi_communicator() for host buffers.");
  }

  void reserve_scratch(CommOp op, size_t bytes) {
    if (bytes <= scratch_bytes_) return;
    check_cuda(cudaFree(scratch_), op, "cudaFree");
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    check_cuda(cudaMalloc(&scratch_, bytes), op, "cudaMalloc");
    scratch_bytes_ = bytes;
  }

  // A call's scope: this communicator's device current, and the caller's
  // compute stream's work so far ordered before what the call queues.
  class OnDevice {
   public:
    OnDevice(NcclCommunicator& comm, CommOp op) : scope_(comm.device_) {
      comm.check_cuda(scope_.result(), op, "cudaSetDevice");
      comm.order_after_compute(op);
    }

   private:
    DeviceScope scope_;
  };

  // Work `call` just issued, finished by the returned Exchange's wait(). It
  // is queued first, before anything else touches the communicator (the
  // next call may follow at once).
  std::unique_ptr<Exchange> in_background(CommOp op, const char* call, std::string detail) {
    if (!enqueued(op, call, deadline_after(timeout_s()))) timed_out(op, call, false, detail);
    cudaEvent_t end = nullptr;
    check_cuda(cudaEventCreateWithFlags(&end, cudaEventDisableTiming), op, "cudaEventCreateWithFlags");
    if (cudaError_t rc = cudaEventRecord(end, stream()); rc != cudaSuccess) {
      cudaEventDestroy(end);
      check_cuda(rc, op, "cudaEventRecord");
    }
    return std::make_unique<Pass>(*this, op, call, std::move(detail), end);
  }

  // The stream calls run on: the caller's (use_streams), or our own.
  cudaStream_t stream() const { return run_on_ != nullptr ? run_on_ : stream_; }

  // The caller's compute stream's work so far happens before what is
  // queued next on stream().
  void order_after_compute(CommOp op) {
    if (after_ == nullptr) return;
    check_cuda(cudaEventRecord(ready_, after_), op, "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream(), ready_, 0), op, "cudaStreamWaitEvent");
  }

  // Waits until the work just issued by `call` is done on the GPU, at most
  // timeout_s() from now. `detail` explains a timeout of send or recv.
  void wait(CommOp op, const char* call, const std::string& detail = "") { wait_for(nullptr, op, call, detail); }

  // wait(), for the work before `event` (recorded when it was queued;
  // nullptr: all the stream's work so far).
  void wait_for(cudaEvent_t event, CommOp op, const char* call, const std::string& detail) {
    const auto deadline = deadline_after(timeout_s());
    ncclResult_t state = ncclSuccess;
    const bool queued = enqueued(op, call, deadline);
    if (queued) {
      if (event == nullptr) {
        check_cuda(cudaEventRecord(done_, stream()), op, "cudaEventRecord");
        event = done_;
      }
      if (poll_until(deadline, [&] {
            cudaError_t rc = cudaEventQuery(event);
            if (rc == cudaSuccess) return true;
            if (rc != cudaErrorNotReady) check_cuda(rc, op, "cudaEventQuery");
            // A peer's failure shows here while our kernel still waits on it.
            check_nccl(ncclCommGetAsyncError(comm_, &state), op, "ncclCommGetAsyncError");
            if (state != ncclSuccess && state != ncclInProgress) check_nccl(state, op, call);
            return false;
          }))
        return;
    }
    timed_out(op, call, queued, detail);
  }

  // Until NCCL has put the work just issued by `call` on the stream (it may
  // be waiting to connect to a peer): no CUDA or NCCL call may touch the
  // stream or the communicator before that. False at the deadline.
  bool enqueued(CommOp op, const char* call, nccl_detail::Clock::time_point deadline) {
    ncclResult_t state = last_result_;
    const bool queued = state == ncclSuccess || poll_until(deadline, [&] {
                          check_nccl(ncclCommGetAsyncError(comm_, &state), op, "ncclCommGetAsyncError");
                          return state != ncclInProgress;
                        });
    if (queued && state != ncclSuccess) check_nccl(state, op, call);
    return queued;
  }

  [[noreturn]] void timed_out(CommOp op, const char* call, bool queued, const std::string& detail) {
    const std::string why = std::string(call) + (queued ? " was still running on the GPU" : " was still in progress") +
                            "; the NCCL communicator was aborted (ncclCommAbort).";
    fail(timeout_message(op, {}, detail.empty() ? why : detail + "\n" + why),
         where(op) + " timed out after " + seconds_string(timeout_s()) + " s waiting for a peer");
  }

  int device_ = -1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  cudaEvent_t ready_ = nullptr;         // recorded on after_ before each call
  cudaStream_t run_on_ = nullptr;       // use_streams: the caller's stream, or ours
  cudaStream_t after_ = nullptr;        // use_streams: the caller's compute stream
  void* scratch_ = nullptr;  // device: barrier operand, staging of host all_reduce_sum
  size_t scratch_bytes_ = 0;
  ncclResult_t last_result_ = ncclSuccess;  // of the latest NCCL call
  std::string failure_;                     // the first failure, one line; empty while healthy
  std::function<void()> on_failure_;
};

}  // namespace

std::unique_ptr<Communicator> unopened_nccl_communicator(int rank, int size, double timeout_s,
                                                         std::function<void()> on_failure) {
  return std::make_unique<NcclCommunicator>(rank, size, timeout_s, std::move(on_failure));
}

void open_nccl(Communicator& comm, int device, const ncclUniqueId& id) {
  static_cast<NcclCommunicator&>(comm).open(device, id);
}

int count_cuda_devices(int rank, std::string& why) {
  int devices = 0;
  const cudaError_t rc = cudaGetDeviceCount(&devices);
  if (rc != cudaSuccess) {
    cudaGetLastError();  // not sticky: later calls must not see it
    devices = 0;
  }
  if (devices == 0)
    why = "error: NCCL communicator on rank " + std::to_string(rank) + ": no CUDA device (cudaGetDeviceCount: " +
          (rc != cudaSuccess ? std::string(cudaGetErrorString(rc)) : "0 devices") +
          "); fix: run on GPU nodes or use make_mpi_communicator()";
  return devices;
}

std::unique_ptr<Communicator> make_nccl_single_rank(double timeout_s) {
  const std::string who = "make_nccl_single_rank";
  auto comm = unopened_nccl_communicator(0, 1, timeout_s, nullptr);  // checks the timeout first
  std::string no_device;
  if (count_cuda_devices(0, no_device) == 0) throw Error(no_device);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    device = 0;
  }
  ncclUniqueId id{};
  const ncclResult_t rc = ncclGetUniqueId(&id);
  if (rc != ncclSuccess)
    throw Error("error: " + who + ": ncclGetUniqueId failed: " + ncclGetErrorString(rc) +
                "\nNCCL could not open a bootstrap socket; NCCL_DEBUG=INFO and NCCL_SOCKET_IFNAME (e.g. lo) help.");
  open_nccl(*comm, device, id);
  return comm;
}

}  // namespace halyard::runtime
