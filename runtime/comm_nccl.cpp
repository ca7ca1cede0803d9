// The NCCL communicator: one rank of MPI_COMM_WORLD, one GPU, device buffers
// (see make_nccl_communicator in comm.h for what differs from the MPI backend).
//
// Startup, over MPI_COMM_WORLD, every step polled against the timeout:
//   1. each rank counts its CUDA devices; the ranks all-gather whether they
//      have one, so a CPU-only rank fails everywhere at once, with its name,
//      instead of leaving its peers to time out;
//   2. the node-local rank picks the device (modulo the device count);
//   3. rank 0 makes the ncclUniqueId and broadcasts it;
//   4. ncclCommInitRankConfig with blocking = 0.
//
// The NCCL communicator is non-blocking, so no NCCL call can wait on a peer:
// a call that would returns ncclInProgress, and ncclCommGetAsyncError is polled
// until the work is on the stream. Completion is then a cudaEvent polled with
// cudaEventQuery. At the deadline, or on any NCCL or CUDA error, the
// communicator is aborted (ncclCommAbort ends kernels stuck on a dead peer) and
// every later call throws, quoting the first failure.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm.h"
#include "runtime/error.h"
#include "runtime/mpi_process.h"

namespace halyard::runtime {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Calls done() until it returns true or the deadline passes. Spins (yielding)
// for the first millisecond, where most collectives end, then sleeps 50 us so
// that a long wait does not take a core from the rank's own threads.
template <typename Done>
bool poll_until(Clock::time_point deadline, Done&& done) {
  const auto start = Clock::now();
  for (;;) {
    if (done()) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    if (now - start < std::chrono::milliseconds(1))
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

ncclDataType_t nccl_type(CommType t) {
  switch (t) {
    case CommType::F32: return ncclFloat32;
    case CommType::I32: return ncclInt32;
    case CommType::F64: return ncclFloat64;
    case CommType::I64: return ncclInt64;
  }
  return ncclFloat32;
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
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
  // Only checks the timeout (the base class words that error); open() does the rest.
  NcclCommunicator(int rank, int size, double timeout_s) : Communicator(rank, size, timeout_s) {}

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
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (scratch_ != nullptr) cudaFree(scratch_);
  }

  const char* backend() const override { return "NCCL"; }

  // Makes the stream, the event, the scratch buffer and the NCCL communicator
  // on `device`; every rank passes the same id.
  void open(int device, const ncclUniqueId& id) {
    device_ = device;
    const std::string who = "make_nccl_communicator on rank " + std::to_string(rank()) + " of " +
                            std::to_string(size());
    auto cuda = [&](cudaError_t rc, const char* call) {
      if (rc == cudaSuccess) return;
      mark_mpi_failed();
      throw Error("error: " + who + ": " + call + " on CUDA device " + std::to_string(device_) +
                  " failed: " + cudaGetErrorString(rc));
    };
    DeviceScope on(device_);
    cuda(on.result(), "cudaSetDevice");
    // Non-blocking: the caller's work on the legacy default stream must not
    // serialize with ours.
    cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    cuda(cudaMalloc(&scratch_, kMinScratch), "cudaMalloc");
    scratch_bytes_ = kMinScratch;

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
        mark_mpi_failed();
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
      mark_mpi_failed();
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
    const int me = rank();
    if (send_counts[me] != recv_counts[me])
      throw Error("error: " + where(op) + ": send_counts[" + std::to_string(me) + "] is " +
                  std::to_string(send_counts[me]) + " but recv_counts[" + std::to_string(me) + "] is " +
                  std::to_string(recv_counts[me]) +
                  "; the block a rank sends itself is the block it receives from itself, so they must be equal.");
    check_device_buffer(op, "send", send);
    check_device_buffer(op, "recv", recv);
    DeviceScope on(device_);
    check_cuda(on.result(), op, "cudaSetDevice");

    const int64_t esize = comm_type_size(type);
    auto send_at = [&](int64_t elements) { return static_cast<const char*>(send) + elements * esize; };
    auto recv_at = [&](int64_t elements) { return static_cast<char*>(recv) + elements * esize; };
    int64_t send_offset = 0, recv_offset = 0;
    for (int p = 0; p < me; ++p) send_offset += send_counts[p], recv_offset += recv_counts[p];
    if (send_counts[me] > 0)
      check_cuda(cudaMemcpyAsync(recv_at(recv_offset), send_at(send_offset),
                                 static_cast<size_t>(send_counts[me] * esize), cudaMemcpyDeviceToDevice, stream_),
                 op, "cudaMemcpyAsync");

    // Zero blocks are skipped on both sides alike: recv_counts[p] here is
    // send_counts[me] on p, so the pairs still match.
    check_nccl(ncclGroupStart(), op, "ncclGroupStart");
    send_offset = recv_offset = 0;
    for (int p = 0; p < size(); ++p) {
      if (p != me && send_counts[p] > 0)
        check_nccl(ncclSend(send_at(send_offset), static_cast<size_t>(send_counts[p]), nccl_type(type), p, comm_,
                            stream_),
                   op, "ncclSend");
      if (p != me && recv_counts[p] > 0)
        check_nccl(ncclRecv(recv_at(recv_offset), static_cast<size_t>(recv_counts[p]), nccl_type(type), p, comm_,
                            stream_),
                   op, "ncclRecv");
      send_offset += send_counts[p];
      recv_offset += recv_counts[p];
    }
    check_nccl(ncclGroupEnd(), op, "ncclGroupEnd");
    wait(op, "ncclGroupEnd");
  }

  void do_all_reduce_sum(void* data, int64_t n, CommType type) override {
    const CommOp op = CommOp::AllReduceSum;
    throw_if_broken(op);
    if (n == 0) return;
    const bool on_host = !is_device_buffer(op, "data", data);
    DeviceScope on(device_);
    check_cuda(on.result(), op, "cudaSetDevice");
    const size_t bytes = static_cast<size_t>(n * comm_type_size(type));
    void* buffer = data;
    if (on_host) {  // the scalar overloads, and callers that summed on the CPU
      reserve_scratch(op, bytes);
      buffer = scratch_;
      check_cuda(cudaMemcpyAsync(buffer, data, bytes, cudaMemcpyHostToDevice, stream_), op, "cudaMemcpyAsync");
    }
    check_nccl(ncclAllReduce(buffer, buffer, static_cast<size_t>(n), nccl_type(type), ncclSum, comm_, stream_), op,
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
    check_device_buffer(op, "send", send);
    check_device_buffer(op, "recv", recv);
    DeviceScope on(device_);
    check_cuda(on.result(), op, "cudaSetDevice");
    check_nccl(ncclAllGather(send, recv, static_cast<size_t>(n), nccl_type(type), comm_, stream_), op,
               "ncclAllGather");
    wait(op, "ncclAllGather");
  }

  void do_reduce_scatter_sum(const void* send, void* recv, int64_t n_per_rank, CommType type) override {
    const CommOp op = CommOp::ReduceScatterSum;
    throw_if_broken(op);
    if (n_per_rank == 0) return;
    check_device_buffer(op, "send", send);
    check_device_buffer(op, "recv", recv);
    DeviceScope on(device_);
    check_cuda(on.result(), op, "cudaSetDevice");
    check_nccl(ncclReduceScatter(send, recv, static_cast<size_t>(n_per_rank), nccl_type(type), ncclSum, comm_,
                                 stream_),
               op, "ncclReduceScatter");
    wait(op, "ncclReduceScatter");
  }

  // The tag was checked for range by the base class; NCCL matches by order.
  void do_send(const void* data, int64_t n, int peer, int tag, CommType type) override {
    const CommOp op = CommOp::Send;
    throw_if_broken(op);
    if (n == 0) return;
    check_device_buffer(op, "data", data);
    DeviceScope on(device_);
    check_cuda(on.result(), op, "cudaSetDevice");
    check_nccl(ncclSend(data, static_cast<size_t>(n), nccl_type(type), peer, comm_, stream_), op, "ncclSend");
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
    DeviceScope on(device_);
    check_cuda(on.result(), op, "cudaSetDevice");
    check_nccl(ncclRecv(data, static_cast<size_t>(n), nccl_type(type), peer, comm_, stream_), op, "ncclRecv");
    wait(op, "ncclRecv",
         "no message (" + std::to_string(n) + " " + comm_type_name(type) + ", tag " + std::to_string(tag) +
             ") came from rank " + std::to_string(peer) + ".");
  }

  void do_barrier() override {
    const CommOp op = CommOp::Barrier;
    throw_if_broken(op);
    DeviceScope on(device_);
    check_cuda(on.result(), op, "cudaSetDevice");
    check_nccl(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_), op, "ncclAllReduce");
    wait(op, "ncclAllReduce");
  }

 private:
  static constexpr size_t kMinScratch = 256;

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
    mark_mpi_failed();
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

  // Waits until the work just issued by `call` is done on the GPU, at most
  // timeout_s() from now. `detail` explains a timeout of send or recv.
  void wait(CommOp op, const char* call, const std::string& detail = "") {
    const auto deadline = deadline_after(timeout_s());
    ncclResult_t state = last_result_;
    // First until NCCL has put the work on the stream (it may be waiting to
    // connect to a peer); no CUDA call may touch the stream before that.
    bool queued = state == ncclSuccess || poll_until(deadline, [&] {
                    check_nccl(ncclCommGetAsyncError(comm_, &state), op, "ncclCommGetAsyncError");
                    return state != ncclInProgress;
                  });
    if (queued && state != ncclSuccess) check_nccl(state, op, call);
    if (queued) {
      check_cuda(cudaEventRecord(done_, stream_), op, "cudaEventRecord");
      if (poll_until(deadline, [&] {
            cudaError_t rc = cudaEventQuery(done_);
            if (rc == cudaSuccess) return true;
            if (rc != cudaErrorNotReady) check_cuda(rc, op, "cudaEventQuery");
            // A peer's failure shows here while our kernel still waits on it.
            check_nccl(ncclCommGetAsyncError(comm_, &state), op, "ncclCommGetAsyncError");
            if (state != ncclSuccess && state != ncclInProgress) check_nccl(state, op, call);
            return false;
          }))
        return;
    }
    const std::string why = std::string(call) + (queued ? " was still running on the GPU" : " was still in progress") +
                            "; the NCCL communicator was aborted (ncclCommAbort).";
    fail(timeout_message(op, {}, detail.empty() ? why : detail + "\n" + why),
         where(op) + " timed out after " + seconds_string(timeout_s()) + " s waiting for a peer");
  }

  int device_ = -1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  void* scratch_ = nullptr;  // device: barrier operand, staging of host all_reduce_sum
  size_t scratch_bytes_ = 0;
  ncclResult_t last_result_ = ncclSuccess;  // of the latest NCCL call
  std::string failure_;                     // the first failure, one line; empty while healthy
};

// Polls an MPI request of the bootstrap; throws on error or at the deadline.
void wait_mpi(MPI_Request* request, double timeout_s, const std::string& who, const char* call,
              const char* what) {
  int rc = MPI_SUCCESS;
  const bool done = poll_until(deadline_after(timeout_s), [&] {
    int flag = 0;
    rc = MPI_Test(request, &flag, MPI_STATUS_IGNORE);
    return rc != MPI_SUCCESS || flag != 0;
  });
  if (done && rc == MPI_SUCCESS) return;
  mark_mpi_failed();
  if (!done)
    throw Error("error: " + who + " timed out after " + seconds_text(timeout_s) +
                " s waiting for a peer (dead or stuck?) " + what +
                "\nevery rank must make its communicators in the same order.");
  throw Error("error: " + who + ": " + call + " failed: " + mpi_error_string(rc));
}

// The rank among the processes of this node: mpirun's variable when it set
// one, else MPI's shared-memory split (blocking, but by now every rank is known
// to be inside the factory, since all of them answered the all-gather).
int local_rank(int rank, const std::string& who) {
  if (const char* env = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) {
    char* end = nullptr;
    long value = std::strtol(env, &end, 10);
    if (end != env && *end == 0 && value >= 0) return static_cast<int>(value);
  }
  MPI_Comm node = MPI_COMM_NULL;
  int rc = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  if (rc != MPI_SUCCESS) throw Error("error: " + who + ": MPI_Comm_split_type failed: " + mpi_error_string(rc));
  int local = 0;
  MPI_Comm_rank(node, &local);
  MPI_Comm_free(&node);
  return local;
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(double timeout_s) {
  ensure_mpi("make_nccl_communicator");
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto comm = std::make_unique<NcclCommunicator>(rank, size, timeout_s);
  const std::string who = "make_nccl_communicator on rank " + std::to_string(rank) + " of " + std::to_string(size);

  // The buffers MPI writes into. A request that times out cannot be
  // cancelled (MPI has no way to cancel a collective) and may still write
  // them later, so they are leaked then rather than freed.
  struct Bootstrap {
    int has_device = 0;
    std::vector<int> everyone;
    struct {
      int result;
      ncclUniqueId id;
    } id{};
  };
  auto boot = std::make_unique<Bootstrap>();
  auto wait = [&](MPI_Request* request, const char* call, const char* what) {
    try {
      wait_mpi(request, timeout_s, who, call, what);
    } catch (const Error&) {
      (void)boot.release();
      throw;
    }
  };

  // 1. Who has a GPU.
  int devices = 0;
  const cudaError_t count_rc = cudaGetDeviceCount(&devices);
  if (count_rc != cudaSuccess) {
    cudaGetLastError();
    devices = 0;
  }
  const bool has_device = devices > 0;
  const std::string no_device =
      "error: NCCL communicator on rank " + std::to_string(rank) + ": no CUDA device (cudaGetDeviceCount: " +
      (count_rc != cudaSuccess ? std::string(cudaGetErrorString(count_rc)) : "0 devices") +
      "); fix: run on GPU nodes or use make_mpi_communicator()";
  boot->has_device = has_device ? 1 : 0;
  boot->everyone.assign(static_cast<size_t>(size), 0);
  MPI_Request request;
  int rc = MPI_Iallgather(&boot->has_device, 1, MPI_INT, boot->everyone.data(), 1, MPI_INT, MPI_COMM_WORLD, &request);
  if (rc != MPI_SUCCESS) throw Error("error: " + who + ": MPI_Iallgather failed: " + mpi_error_string(rc));
  try {
    wait(&request, "MPI_Iallgather", "while the ranks counted their CUDA devices");
  } catch (const Error&) {
    if (!has_device) throw Error(no_device);  // the root cause, whatever the peers did
    throw;
  }
  if (!has_device) throw Error(no_device);
  std::vector<int> without;
  for (int p = 0; p < size; ++p)
    if (!boot->everyone[static_cast<size_t>(p)]) without.push_back(p);
  if (!without.empty())
    throw Error("error: NCCL communicator on rank " + std::to_string(rank) + ": " + ranks_text(without) +
                (without.size() == 1 ? " has" : " have") +
                " no CUDA device; fix: run on GPU nodes or use make_mpi_communicator()");

  // 2. Which GPU.
  const int device = local_rank(rank, who) % devices;
  const cudaError_t set_rc = cudaSetDevice(device);
  if (set_rc != cudaSuccess)
    throw Error("error: " + who + ": cudaSetDevice(" + std::to_string(device) +
                ") failed: " + cudaGetErrorString(set_rc));

  // 3. The id, with rank 0's result so that its failure is everyone's error.
  if (rank == 0) boot->id.result = static_cast<int>(ncclGetUniqueId(&boot->id.id));
  rc = MPI_Ibcast(&boot->id, static_cast<int>(sizeof boot->id), MPI_BYTE, 0, MPI_COMM_WORLD, &request);
  if (rc != MPI_SUCCESS) throw Error("error: " + who + ": MPI_Ibcast failed: " + mpi_error_string(rc));
  wait(&request, "MPI_Ibcast", "while rank 0 broadcast the NCCL unique id");
  if (boot->id.result != ncclSuccess)
    throw Error("error: " + who + ": ncclGetUniqueId on rank 0 failed: " +
                ncclGetErrorString(static_cast<ncclResult_t>(boot->id.result)) +
                "\nrank 0 could not open a bootstrap socket; NCCL_DEBUG=INFO and NCCL_SOCKET_IFNAME help find why.");

  // 4. The communicator.
  comm->open(device, boot->id.id);
  return comm;
}

}  // namespace halyard::runtime
