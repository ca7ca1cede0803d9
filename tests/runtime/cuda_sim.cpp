// A simulated CUDA runtime, CUDA driver, cuBLAS and NCCL, for running the
// runtime's GPU-side code that needs no GPU kernel of Halide's (the NCCL
// communicator, runtime/comm_nccl.cpp; the collectives on device memory,
// runtime/collectives_cuda.cpp; the offload copies' stream,
// runtime/cuda_context.cpp) with ranks as threads on a machine without GPUs
// (test_cuda_sim). Built as a shared library named libcuda.so.1
// (libcublas.so.13 beside it names the same file), so that the runtime's
// dlopen of the driver and of cuBLAS finds it. It implements the calls that
// code and the tests make, with the signatures of the CUDA runtime's and
// NCCL's headers and of the runtime's tables of the driver and cuBLAS, and
// keeps the semantics they rely on:
//   - "device" memory is host memory from cudaMalloc, known by its address
//     (cudaPointerGetAttributes tells it from host memory, and its device);
//   - a stream is a worker thread running its work in order, so nothing
//     queued has happened when the call returns; events complete when the
//     stream reaches them; cudaStreamWaitEvent waits for the event's latest
//     record;
//   - NCCL communicators are non-blocking: init and split finish once every
//     rank has called (polled with ncclCommGetAsyncError); a communicator's
//     first operation reports ncclInProgress once; collectives match by call
//     order; a send completes only when its receive takes it; sends and
//     receives of one group never block each other; two ranks of one
//     communicator on one device are invalid usage;
//   - work waiting for a peer waits forever, until ncclCommAbort on its own
//     communicator ends it (what the communicator's watchdog must do).
// Counts and types that disagree between ranks (garbage or a hang on real
// NCCL) set the communicator's error instead, so that a test names them.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "runtime/cuda_driver.h"
#include "tests/cuda_sim.h"

namespace {

// One lock and one condition for every wait in the simulation: simple to
// reason about, and speed does not matter here. Never destroyed: the
// streams of the runtime's context live until exit, their workers waiting
// on them (destroying a condition with waiters hangs glibc).
std::mutex& g_mu = *new std::mutex;
std::condition_variable& g_cv = *new std::condition_variable;

int g_devices = 4;
bool g_host_is_device = false;

}  // namespace

struct CUevent_st {
  uint64_t recorded = 0;   // records made
  uint64_t completed = 0;  // the latest record the stream has reached
};

namespace {

thread_local int t_device = 0;
thread_local cudaError_t t_last = cudaSuccess;

cudaError_t set_last(cudaError_t rc) {
  if (rc != cudaSuccess) t_last = rc;
  return rc;
}

struct Allocation {
  size_t bytes;
  int device;
  bool managed;
};
std::map<uintptr_t, Allocation> g_allocations;  // by start address
std::vector<std::unique_ptr<CUevent_st>> g_dead_events;

struct Kernel {
  size_t arg_bytes;
  halyard::testing::SimulatedKernel run;
};
std::map<std::string, Kernel> g_kernels;

// The allocation holding `p` (g_mu held), or null.
const Allocation* allocation_of(const void* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  auto it = g_allocations.upper_bound(at);
  if (it == g_allocations.begin()) return nullptr;
  --it;
  return at < it->first + it->second.bytes ? &it->second : nullptr;
}

// Waits on g_cv (g_mu held) until done() or stop(); true if done().
template <class Done, class Stop>
bool wait_until(std::unique_lock<std::mutex>& lock, Done done, Stop stop) {
  while (!done()) {
    if (stop()) return false;
    g_cv.wait_for(lock, std::chrono::milliseconds(5));
  }
  return true;
}

size_t type_bytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

template <class T>
void add_into(std::vector<char>& acc, const void* src, size_t count) {
  T* a = reinterpret_cast<T*>(acc.data());
  const T* s = static_cast<const T*>(src);
  for (size_t i = 0; i < count; ++i) {
    if constexpr (std::is_integral_v<T>)  // wrapping, as on the GPU
      a[i] = static_cast<T>(static_cast<std::make_unsigned_t<T>>(a[i]) + static_cast<std::make_unsigned_t<T>>(s[i]));
    else
      a[i] += s[i];
  }
}

}  // namespace

struct CUstream_st {
  std::deque<std::function<void()>> work;  // under g_mu
  bool running = false;
  bool stop = false;
  std::thread worker;
};

namespace {

void worker_loop(CUstream_st* s) {
  std::unique_lock<std::mutex> lock(g_mu);
  for (;;) {
    wait_until(lock, [&] { return !s->work.empty(); }, [&] { return s->stop; });
    if (s->work.empty()) return;  // stopped and drained
    std::function<void()> task = std::move(s->work.front());
    s->work.pop_front();
    s->running = true;
    lock.unlock();
    task();
    lock.lock();
    s->running = false;
    g_cv.notify_all();
  }
}

void enqueue(cudaStream_t s, std::function<void()> task) {
  if (s == nullptr) {  // the legacy stream: the tests' synchronous copies
    task();
    return;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  s->work.push_back(std::move(task));
  g_cv.notify_all();
}

}  // namespace

// ---------------------------------------------------------------------------
// CUDA runtime

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = g_devices;
  return g_devices > 0 ? cudaSuccess : set_last(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= g_devices) return set_last(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = t_device;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t rc = t_last;
  t_last = cudaSuccess;
  return rc;
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorMemoryAllocation: return "out of memory";
    default: return "invalid argument";
  }
}

static cudaError_t allocate(void** p, size_t bytes, bool managed) {
  *p = ::operator new(std::max<size_t>(bytes, 1), std::align_val_t(256));
  std::lock_guard<std::mutex> lock(g_mu);
  g_allocations[reinterpret_cast<uintptr_t>(*p)] = Allocation{std::max<size_t>(bytes, 1), t_device, managed};
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) { return allocate(p, bytes, false); }
cudaError_t cudaMallocManaged(void** p, size_t bytes, unsigned int) { return allocate(p, bytes, true); }

cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_allocations.erase(reinterpret_cast<uintptr_t>(p)) == 0) return set_last(cudaErrorInvalidValue);
  }
  ::operator delete(p, std::align_val_t(256));
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  *a = cudaPointerAttributes{};
  a->type = cudaMemoryTypeUnregistered;
  a->device = -2;
  std::lock_guard<std::mutex> lock(g_mu);
  const Allocation* in = allocation_of(p);
  if (in == nullptr && !g_host_is_device) return cudaSuccess;
  a->type = in != nullptr && in->managed ? cudaMemoryTypeManaged : cudaMemoryTypeDevice;
  a->device = in != nullptr ? in->device : t_device;
  a->devicePointer = const_cast<void*>(p);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t stream) {
  if (bytes > 0) enqueue(stream, [=] { std::memcpy(dst, src, bytes); });
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  *s = new CUstream_st;
  (*s)->worker = std::thread(worker_loop, *s);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (s == nullptr) return cudaSuccess;
  std::unique_lock<std::mutex> lock(g_mu);
  wait_until(lock, [&] { return s->work.empty() && !s->running; }, [] { return false; });
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (s == nullptr) return set_last(cudaErrorInvalidValue);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    s->stop = true;
    g_cv.notify_all();
  }
  s->worker.join();  // after its work, as CUDA releases a stream once idle
  delete s;
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) {
  enqueue(stream, [=] { fn(user_data); });
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  *e = new CUevent_st;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  // Work still queued may record it (CUDA allows that): kept until exit.
  std::lock_guard<std::mutex> lock(g_mu);
  g_dead_events.emplace_back(e);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
  uint64_t n;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    n = ++e->recorded;
  }
  enqueue(stream, [e, n] {
    std::lock_guard<std::mutex> lock(g_mu);
    e->completed = std::max(e->completed, n);
    g_cv.notify_all();
  });
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(g_mu);
  return e->completed >= e->recorded ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t e, unsigned int) {
  uint64_t n;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    n = e->recorded;
  }
  enqueue(stream, [e, n] {
    std::unique_lock<std::mutex> lock(g_mu);
    wait_until(lock, [&] { return e->completed >= n; }, [] { return false; });
  });
  return cudaSuccess;
}

}  // extern "C"

// ---------------------------------------------------------------------------
// NCCL

namespace {

struct Clique;

struct Message {
  const void* data;
  size_t count;
  ncclDataType_t type;
  bool taken = false;
};

// A collective's meeting point: the n-th collective of a clique.
struct Meeting {
  std::vector<const void*> send;
  std::vector<size_t> count;
  std::vector<ncclDataType_t> type;
  std::vector<int> what;  // 0 all-reduce, 1 all-gather, 2 reduce-scatter
  int arrived = 0, computed = 0, left = 0;
};

struct Split {
  int size;
  std::vector<int> color, key, device;
  std::vector<ncclComm_t> child;
  int arrived = 0;
  bool resolved = false;
};

struct Clique {
  int size;
  std::vector<ncclComm_t> member;
  int joined = 0;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Message>>> mail;  // (from, to)
  std::map<uint64_t, Meeting> meetings;
  std::map<uint64_t, std::shared_ptr<Split>> splits;
};

}  // namespace

struct ncclComm {
  std::shared_ptr<Clique> clique;  // null while a split is pending
  int rank = -1;
  int device = -1;
  ncclResult_t state = ncclInProgress;
  bool aborted = false;
  bool first_op = true;
  uint64_t collectives = 0, splits = 0;
  std::shared_ptr<Split> pending;  // the split that makes this one
  std::string last_error;
};

namespace {

std::map<std::string, std::shared_ptr<Clique>> g_cliques;  // by unique id
std::map<ncclComm_t, std::shared_ptr<ncclComm>> g_comms;   // live handles
uint64_t g_next_id = 1;

struct Op {
  enum Kind { Send, Recv, Collective } kind = Send;
  int what = 0;  // for Collective
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  int peer = -1;
  uint64_t seq = 0;
  std::shared_ptr<ncclComm> comm;
  cudaStream_t stream = nullptr;
};

thread_local int t_group_depth = 0;
thread_local std::vector<Op> t_group;

void fail_locked(ncclComm& c, const std::string& why) {
  if (c.state == ncclSuccess || c.state == ncclInProgress) c.state = ncclInvalidUsage;
  c.last_error = "simulated NCCL: " + why;
  g_cv.notify_all();
}

// One collective, on the stream's thread. Every rank reads every rank's
// input once all have arrived, then writes its own output once all have
// read (inputs may be outputs: in place).
void run_collective(const Op& op, std::unique_lock<std::mutex>& lock) {
  ncclComm& c = *op.comm;
  Clique& q = *c.clique;
  Meeting& m = q.meetings[op.seq];
  if (m.send.empty()) {
    m.send.assign(q.size, nullptr);
    m.count.assign(q.size, 0);
    m.type.assign(q.size, ncclFloat32);
    m.what.assign(q.size, -1);
  }
  m.send[c.rank] = op.send;
  m.count[c.rank] = op.count;
  m.type[c.rank] = op.type;
  m.what[c.rank] = op.what;
  ++m.arrived;
  g_cv.notify_all();
  if (!wait_until(lock, [&] { return m.arrived == q.size; }, [&] { return c.aborted; })) return;
  for (int p = 0; p < q.size; ++p)
    if (m.count[p] != op.count || m.type[p] != op.type || m.what[p] != op.what)
      return fail_locked(c, "rank " + std::to_string(p) + " called another collective or size at collective " +
                                std::to_string(op.seq));
  const size_t bytes = type_bytes(op.type);
  std::vector<char> result;
  if (op.what == 1) {  // all-gather: count from each
    result.resize(op.count * bytes * q.size);
    for (int p = 0; p < q.size; ++p) std::memcpy(result.data() + p * op.count * bytes, m.send[p], op.count * bytes);
  } else {
    const size_t n = op.count, offset = op.what == 2 ? c.rank * n * bytes : 0;
    result.assign(n * bytes, 0);
    for (int p = 0; p < q.size; ++p) {
      const char* src = static_cast<const char*>(m.send[p]) + offset;
      switch (op.type) {
        case ncclFloat32: add_into<float>(result, src, n); break;
        case ncclFloat64: add_into<double>(result, src, n); break;
        case ncclInt32: add_into<int32_t>(result, src, n); break;
        case ncclInt64: add_into<int64_t>(result, src, n); break;
        default: return fail_locked(c, "sums of this type are not simulated");
      }
    }
  }
  ++m.computed;
  g_cv.notify_all();
  if (!wait_until(lock, [&] { return m.computed == q.size; }, [&] { return c.aborted; })) return;
  std::memcpy(op.recv, result.data(), result.size());
  if (++m.left == q.size) q.meetings.erase(op.seq);
}

// A group's operations, on the stream's thread: its sends posted first, so
// that no order of sends and receives inside one group can deadlock.
void run_group(const std::vector<Op>& ops) {
  std::unique_lock<std::mutex> lock(g_mu);
  std::vector<std::pair<std::shared_ptr<Message>, const Op*>> posted;
  for (const Op& op : ops) {
    if (op.kind != Op::Send || op.comm->aborted) continue;
    auto msg = std::make_shared<Message>(Message{op.send, op.count, op.type});
    op.comm->clique->mail[{op.comm->rank, op.peer}].push_back(msg);
    posted.emplace_back(msg, &op);
  }
  g_cv.notify_all();
  for (const Op& op : ops) {
    ncclComm& c = *op.comm;
    if (c.aborted) return;
    if (op.kind == Op::Collective) {
      run_collective(op, lock);
    } else if (op.kind == Op::Recv) {
      auto& box = c.clique->mail[{op.peer, c.rank}];
      if (!wait_until(lock, [&] { return !box.empty(); }, [&] { return c.aborted; })) return;
      std::shared_ptr<Message> msg = box.front();
      box.pop_front();
      if (msg->count != op.count || msg->type != op.type) {
        msg->taken = true;
        return fail_locked(c, "rank " + std::to_string(op.peer) + " sent " + std::to_string(msg->count) +
                                  " elements, rank " + std::to_string(c.rank) + " received " +
                                  std::to_string(op.count));
      }
      std::memcpy(op.recv, msg->data, op.count * type_bytes(op.type));
      msg->taken = true;
      g_cv.notify_all();
    }
  }
  for (auto& [msg, op] : posted)
    if (!wait_until(lock, [&] { return msg->taken; }, [&] { return op->comm->aborted; })) return;
}

std::shared_ptr<ncclComm> live(ncclComm_t comm) {
  auto it = g_comms.find(comm);
  return it == g_comms.end() ? nullptr : it->second;
}

ncclResult_t submit(Op op, ncclComm_t comm) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    op.comm = live(comm);
    if (!op.comm || !op.comm->clique) return ncclInvalidArgument;
    if (op.comm->aborted) return ncclInvalidUsage;
    if (op.kind == Op::Collective) op.seq = op.comm->collectives++;
  }
  t_group.push_back(std::move(op));
  return t_group_depth > 0 ? ncclSuccess : ncclGroupEnd();
}

ncclResult_t collective(int what, const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t red,
                        ncclComm_t comm, cudaStream_t stream) {
  if (what != 1 && red != ncclSum) return ncclInvalidArgument;
  Op op;
  op.kind = Op::Collective;
  op.what = what;
  op.send = send;
  op.recv = recv;
  op.count = count;
  op.type = type;
  op.stream = stream;
  return submit(std::move(op), comm);
}

}  // namespace

namespace halyard::testing {
void set_simulated_devices(int n) { g_devices = n; }
void treat_host_memory_as_device(bool on) { g_host_is_device = on; }
void register_simulated_kernel(const char* name, size_t arg_bytes, SimulatedKernel kernel) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_kernels[name] = Kernel{arg_bytes, kernel};
}
}  // namespace halyard::testing

extern "C" {

const char* ncclGetErrorString(ncclResult_t rc) {
  switch (rc) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "internal error";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  static thread_local std::string text;
  std::lock_guard<std::mutex> lock(g_mu);
  auto c = live(comm);
  text = c ? c->last_error : "";
  return text.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof(*id));
  std::lock_guard<std::mutex> lock(g_mu);
  const uint64_t n = g_next_id++;
  std::memcpy(id->internal, &n, sizeof(n));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  if (config == nullptr || config->blocking != 0) return ncclInvalidArgument;  // (the communicator never blocks)
  std::lock_guard<std::mutex> lock(g_mu);
  auto& q = g_cliques[std::string(id.internal, sizeof(id.internal))];
  if (!q) {
    q = std::make_shared<Clique>();
    q->size = nranks;
    q->member.assign(nranks, nullptr);
  }
  if (q->size != nranks || rank < 0 || rank >= nranks || q->member[rank] != nullptr) return ncclInvalidArgument;
  auto c = std::make_shared<ncclComm>();
  c->clique = q;
  c->rank = rank;
  c->device = t_device;
  for (ncclComm_t other : q->member)
    if (other != nullptr && other->device == c->device) {  // NCCL's "Duplicate GPU detected"
      fail_locked(*c, "rank " + std::to_string(rank) + " and rank " + std::to_string(other->rank) +
                          " both use CUDA device " + std::to_string(c->device));
      fail_locked(*other, c->last_error);
    }
  q->member[rank] = c.get();
  ++q->joined;
  g_comms[c.get()] = c;
  *comm = c.get();
  g_cv.notify_all();
  return ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto c = live(comm);
  if (!c) return ncclInvalidArgument;
  if (c->state == ncclInProgress) {
    if (c->pending && c->pending->resolved) c->pending.reset();
    if (!c->pending && c->clique && c->clique->joined == c->clique->size) c->state = ncclSuccess;
  }
  *state = c->state;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto c = live(comm);
  if (!c) return ncclInvalidArgument;
  *rank = c->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto c = live(comm);
  if (!c || !c->clique) return ncclInvalidArgument;
  *count = c->clique->size;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto c = live(comm);
  if (!c) return ncclInvalidArgument;
  c->aborted = true;
  g_comms.erase(comm);  // (work still queued holds it)
  g_cv.notify_all();
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_mu);
  return live(comm) ? ncclSuccess : ncclInvalidArgument;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_comms.erase(comm) ? ncclSuccess : ncclInvalidArgument;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  if (config == nullptr || config->blocking != 0) return ncclInvalidArgument;
  std::lock_guard<std::mutex> lock(g_mu);
  auto parent = live(comm);
  if (!parent || !parent->clique || parent->aborted) return ncclInvalidArgument;
  Clique& q = *parent->clique;
  auto& s = q.splits[parent->splits++];
  if (!s) {
    s = std::make_shared<Split>();
    s->size = q.size;
    s->color.assign(q.size, 0);
    s->key.assign(q.size, 0);
    s->device.assign(q.size, 0);
    s->child.assign(q.size, nullptr);
  }
  auto child = std::make_shared<ncclComm>();
  child->device = parent->device;
  child->pending = s;
  s->color[parent->rank] = color;
  s->key[parent->rank] = key;
  s->child[parent->rank] = child.get();
  *newcomm = color == NCCL_SPLIT_NOCOLOR ? nullptr : child.get();
  g_comms[child.get()] = child;
  if (++s->arrived == s->size) {  // the last one makes the groups: by color, ranked by key, then parent rank
    std::map<int, std::vector<int>> groups;
    for (int p = 0; p < s->size; ++p)
      if (s->color[p] != NCCL_SPLIT_NOCOLOR) groups[s->color[p]].push_back(p);
    for (auto& [c, ranks] : groups) {
      std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) { return s->key[a] < s->key[b]; });
      auto sub = std::make_shared<Clique>();
      sub->size = static_cast<int>(ranks.size());
      sub->joined = sub->size;
      for (int r = 0; r < sub->size; ++r) {
        ncclComm* k = s->child[ranks[r]];
        k->clique = sub;
        k->rank = r;
        sub->member.push_back(k);
      }
    }
    for (int p = 0; p < s->size; ++p)
      if (s->color[p] == NCCL_SPLIT_NOCOLOR) g_comms.erase(s->child[p]);
    s->resolved = true;
    g_cv.notify_all();
  }
  return ncclInProgress;
}

ncclResult_t ncclGroupStart() {
  ++t_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (t_group_depth > 0 && --t_group_depth > 0) return ncclSuccess;
  std::vector<Op> ops = std::move(t_group);
  t_group.clear();
  if (ops.empty()) return ncclSuccess;
  bool in_progress = false;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (Op& op : ops)  // a communicator's first work connects to its peers first
      if (op.comm->first_op) {
        op.comm->first_op = false;
        if (op.comm->state == ncclSuccess) op.comm->state = ncclInProgress;
        in_progress = true;
      }
  }
  enqueue(ops.front().stream, [ops] { run_group(ops); });
  return in_progress ? ncclInProgress : ncclSuccess;
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  Op op;
  op.kind = Op::Send;
  op.send = send;
  op.count = count;
  op.type = type;
  op.peer = peer;
  op.stream = stream;
  return submit(std::move(op), comm);
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  Op op;
  op.kind = Op::Recv;
  op.recv = recv;
  op.count = count;
  op.type = type;
  op.peer = peer;
  op.stream = stream;
  return submit(std::move(op), comm);
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t red,
                           ncclComm_t comm, cudaStream_t stream) {
  return collective(0, send, recv, count, type, red, comm, stream);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  return collective(1, send, recv, count, type, ncclSum, comm, stream);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t red,
                               ncclComm_t comm, cudaStream_t stream) {
  return collective(2, send, recv, count, type, red, comm, stream);
}

}  // extern "C"

// ---------------------------------------------------------------------------
// CUDA driver, with the types of the runtime's table of it
// (runtime/cuda_driver.h: CUresult as int, handles as void*, device pointers
// as unsigned long long; UBSan checks that a call through the table has the
// callee's type): one primary context per device (a tag: memory and streams
// are the runtime API's above), streams and events as above.

namespace {

using halyard::runtime::CudaMemcpy2D;

constexpr int kSuccess = 0, kInvalidValue = 1, kNoDevice = 100, kInvalidDevice = 101, kInvalidContext = 201,
              kNotFound = 500;
constexpr int kPointerMemoryType = 2;  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kMemoryTypeDevice = 2;   // CU_MEMORYTYPE_DEVICE

thread_local void* t_context = nullptr;
thread_local std::vector<void*> t_pushed;

void* context_of(int device) { return reinterpret_cast<void*>(static_cast<uintptr_t>(0x1000 + device)); }
int device_of(void* c) { return static_cast<int>(reinterpret_cast<uintptr_t>(c) - 0x1000); }
void* at(unsigned long long p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); }
cudaStream_t stream_of(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

extern "C" {

int cuInit(unsigned) { return g_devices > 0 ? kSuccess : kNoDevice; }

int cuDeviceGetCount(int* count) {
  *count = g_devices;
  return kSuccess;
}

int cuDeviceGet(int* device, int ordinal) {
  if (ordinal < 0 || ordinal >= g_devices) return kInvalidDevice;
  *device = ordinal;
  return kSuccess;
}

int cuDeviceGetName(char* name, int len, int) {
  std::snprintf(name, static_cast<size_t>(len), "Simulated GPU");
  return kSuccess;
}

int cuDevicePrimaryCtxRetain(void** ctx, int device) {
  *ctx = context_of(device);
  return kSuccess;
}

int cuDevicePrimaryCtxRelease_v2(int) { return kSuccess; }

int cuCtxGetCurrent(void** ctx) {
  *ctx = t_context;
  return kSuccess;
}

int cuCtxGetDevice(int* device) {
  if (t_context == nullptr) return kInvalidContext;
  *device = device_of(t_context);
  return kSuccess;
}

int cuCtxPushCurrent_v2(void* ctx) {
  t_pushed.push_back(t_context);
  t_context = ctx;
  return kSuccess;
}

int cuCtxPopCurrent_v2(void** ctx) {
  if (t_pushed.empty()) return kInvalidContext;
  if (ctx != nullptr) *ctx = t_context;
  t_context = t_pushed.back();
  t_pushed.pop_back();
  return kSuccess;
}

int cuMemGetInfo_v2(size_t* free, size_t* total) {
  *free = *total = size_t{80} << 30;
  return kSuccess;
}

int cuGetErrorString(int rc, const char** text) {
  *text = rc == kSuccess ? "no error"
          : rc == kInvalidValue ? "invalid argument"
          : rc == kNotFound ? "named symbol not found"
                            : "simulated CUDA error";
  return kSuccess;
}

int cuStreamCreate(void** stream, unsigned flags) {
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, flags);
  *stream = s;
  return kSuccess;
}

int cuStreamSynchronize(void* stream) {
  cudaStreamSynchronize(stream_of(stream));
  return kSuccess;
}

int cuEventCreate(void** event, unsigned flags) {
  cudaEvent_t e = nullptr;
  cudaEventCreateWithFlags(&e, flags);
  *event = e;
  return kSuccess;
}

int cuEventDestroy_v2(void* event) {
  cudaEventDestroy(static_cast<cudaEvent_t>(event));
  return kSuccess;
}

int cuEventRecord(void* event, void* stream) {
  cudaEventRecord(static_cast<cudaEvent_t>(event), stream_of(stream));
  return kSuccess;
}

int cuStreamWaitEvent(void* stream, void* event, unsigned flags) {
  cudaStreamWaitEvent(stream_of(stream), static_cast<cudaEvent_t>(event), flags);
  return kSuccess;
}

int cuMemHostRegister_v2(void*, size_t, unsigned) { return kSuccess; }
int cuMemHostUnregister(void*) { return kSuccess; }

int cuMemAlloc_v2(unsigned long long* p, size_t bytes) {
  void* q = nullptr;
  allocate(&q, bytes, false);
  *p = reinterpret_cast<uintptr_t>(q);
  return kSuccess;
}

int cuMemFree_v2(unsigned long long p) { return cudaFree(at(p)) == cudaSuccess ? kSuccess : kInvalidValue; }

int cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, size_t bytes, void* stream) {
  cudaMemcpyAsync(dst, at(src), bytes, cudaMemcpyDeviceToHost, stream_of(stream));
  return kSuccess;
}

int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t bytes, void* stream) {
  cudaMemcpyAsync(at(dst), src, bytes, cudaMemcpyHostToDevice, stream_of(stream));
  return kSuccess;
}

// Device to device only (what the runtime asks), with the driver's checks:
// pitches at least the width, every byte touched in device memory.
int cuMemcpy2DAsync_v2(const void* args, void* stream) {
  const CudaMemcpy2D c = *static_cast<const CudaMemcpy2D*>(args);
  if (c.src_memory_type != kMemoryTypeDevice || c.dst_memory_type != kMemoryTypeDevice) return kInvalidValue;
  if (c.src_pitch < c.width_bytes || c.dst_pitch < c.width_bytes) return kInvalidValue;
  auto first = [](unsigned long long base, size_t x, size_t y, size_t pitch) { return at(base + y * pitch + x); };
  if (c.height > 0 && c.width_bytes > 0) {
    std::lock_guard<std::mutex> lock(g_mu);
    const size_t last_y = c.height - 1, last_x = c.width_bytes - 1;
    for (const void* p : {first(c.src_device, c.src_x_bytes, c.src_y, c.src_pitch),
                          first(c.src_device, c.src_x_bytes + last_x, c.src_y + last_y, c.src_pitch),
                          first(c.dst_device, c.dst_x_bytes, c.dst_y, c.dst_pitch),
                          first(c.dst_device, c.dst_x_bytes + last_x, c.dst_y + last_y, c.dst_pitch)})
      if (allocation_of(p) == nullptr && !g_host_is_device) return kInvalidValue;
  }
  enqueue(stream_of(stream), [c, first] {
    for (size_t y = 0; y < c.height; ++y)
      std::memmove(first(c.dst_device, c.dst_x_bytes, c.dst_y + y, c.dst_pitch),
                   first(c.src_device, c.src_x_bytes, c.src_y + y, c.src_pitch), c.width_bytes);
  });
  return kSuccess;
}

int cuMemsetD8Async(unsigned long long p, unsigned char value, size_t n, void* stream) {
  enqueue(stream_of(stream), [=] { std::memset(at(p), value, n); });
  return kSuccess;
}

int cuPointerGetAttribute(void* data, int attribute, unsigned long long p) {
  if (attribute != kPointerMemoryType) return kInvalidValue;
  std::lock_guard<std::mutex> lock(g_mu);
  if (allocation_of(at(p)) == nullptr && !g_host_is_device) return kInvalidValue;
  *static_cast<unsigned*>(data) = kMemoryTypeDevice;
  return kSuccess;
}

int cuModuleLoadData(void** module, const void*) {
  *module = reinterpret_cast<void*>(uintptr_t{0x2000});
  return kSuccess;
}

int cuModuleGetFunction(void** f, void*, const char* name) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_kernels.find(name);
  if (it == g_kernels.end()) return kNotFound;
  *f = &it->second;
  return kSuccess;
}

int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned,
                   void* stream, void** params, void**) {
  if (gy != 1 || gz != 1 || by != 1 || bz != 1 || params == nullptr) return kInvalidValue;
  const Kernel k = *static_cast<const Kernel*>(f);
  // The arguments are copied now, as CUDA copies them at the launch.
  auto args = std::make_shared<std::vector<char>>(static_cast<const char*>(params[0]),
                                                  static_cast<const char*>(params[0]) + k.arg_bytes);
  enqueue(stream_of(stream), [k, args, gx, bx] { k.run(gx, bx, args->data()); });
  return kSuccess;
}

// ---------------------------------------------------------------------------
// cuBLAS (the runtime's table of it, runtime/gemm.cpp): a handle is a
// stream; geam runs on it. No GEMM: the collectives need none.

int cublasCreate_v2(void** handle) {
  *handle = new cudaStream_t(nullptr);  // (one per process, as the runtime makes it; kept until exit)
  return 0;
}

int cublasSetStream_v2(void* handle, void* stream) {
  *static_cast<cudaStream_t*>(handle) = stream_of(stream);
  return 0;
}

constexpr int kCublasNotSupported = 15, kCublasInvalidValue = 7;

int cublasSgemm_v2(void*, int, int, int, int, int, const float*, const float*, int, const float*, int, const float*,
                   float*, int) {
  return kCublasNotSupported;
}

int cublasGemmEx(void*, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                 const void*, void*, int, int, int, int) {
  return kCublasNotSupported;
}

// C = alpha A + beta B, column-major, neither transposed.
int cublasSgeam(void* handle, int ta, int tb, int m, int n, const float* alpha, const float* a, int lda,
                const float* beta, const float* b, int ldb, float* c, int ldc) {
  if (ta != 0 || tb != 0 || lda < m || ldb < m || ldc < m) return kCublasInvalidValue;
  const float al = *alpha, be = *beta;
  enqueue(*static_cast<cudaStream_t*>(handle), [=] {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) c[i + j * ldc] = al * a[i + j * lda] + be * b[i + j * ldb];
  });
  return 0;
}

}  // extern "C"
