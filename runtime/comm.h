// Communicators: the collectives sequence parallelism needs, over ranks that
// each hold a slice of the sequence (DeepSpeed-Ulysses style).
//
//   auto group = halyard::runtime::make_in_process_group(4, 0.5);   // tests: threads
//   auto comm = halyard::runtime::make_mpi_communicator();          // mpirun -np 4
//   comm->all_to_all_v(send, send_counts, recv, recv_counts);        // seq@sp -> heads@sp
//   double tokens = comm->all_reduce_sum(double(local_tokens));      // global loss count
//
// Contract, for every backend:
// - Every rank calls the same collectives in the same order with matching
//   sizes; a Communicator is used by one thread at a time.
// - Counts are in elements, never bytes. Buffers are host memory unless a
//   backend says otherwise. Send and receive buffers of one call must not overlap
//   (all_reduce_sum works in place).
// - No call waits forever. Each waits at most timeout_s() (default 60 s; the MPI
//   backend may take up to a second more to find out which peers are missing)
//   and then throws Error naming the operation, this rank, and the rank(s) it
//   was waiting for:
//     error: all_to_all_v on rank 0 of 4 timed out after 60 s waiting for rank 2 (dead or stuck?)
// - After any failure (a timeout, mismatched calls, an error from MPI) the
//   communicator is broken: every later call throws at once, quoting the first
//   failure. A failed collective cannot be undone, so the caller should report
//   the error and exit non-zero; mpirun then stops the other ranks.
// - User mistakes (a negative count, a peer that is not a rank, a bad tag, a
//   timeout that is not a positive number of seconds) throw before anything is
//   sent, and leave the communicator usable.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace halyard::runtime {

// Element types the collectives move. BF16 is 16-bit patterns that only
// move (all_to_all_v under the *_bf16 sums); no backend sums them.
enum class CommType { F32, I32, F64, I64, BF16 };
const char* comm_type_name(CommType t);  // "f32", "i32", "f64", "i64", "bf16"
int64_t comm_type_size(CommType t);      // bytes per element
// acc[i] += x[i] for i < n, in type t; throws for BF16 (no backend sums it).
void comm_sum_into(CommType t, void* acc, const void* x, int64_t n);

// The operations, as named in error messages.
enum class CommOp { AllToAllV, AllReduceSum, AllGather, ReduceScatterSum, Send, Recv, Barrier };
const char* comm_op_name(CommOp op);  // "all_to_all_v", "all_reduce_sum", ...

inline constexpr double kDefaultCommTimeoutS = 60.0;
// Tags of send/recv: the range every MPI guarantees (MPI_TAG_UB >= 32767).
inline constexpr int kMaxCommTag = 32767;

// A send to one rank and a receive from another, in flight together:
// started by Communicator::start_exchange, finished by wait(), which throws
// like any call (a timeout names the peer). Ring attention starts the next
// key block's pass before the current block's kernels and waits after them.
// Both buffers must stay untouched until wait() returns.
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual void wait() = 0;
  // Device backends: makes the work queued on `stream` (a CUstream of the
  // communicator's device) from now on wait for the exchange's end, by an
  // event, without the host waiting; true if so. False where the backend
  // cannot (host memory): call wait() instead. Either way wait() is still
  // due: it returns at once if the work is done and throws at the timeout,
  // so calling it before the host next waits for `stream` makes a dead
  // peer an error, not a hang.
  virtual bool join(void* stream) { return false; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // On a group of a larger world (the sp ranks of a dp x sp mesh), the world
  // rank of each group rank, so that errors name the process people launched.
  void set_world_ranks(std::vector<int> world) { world_ranks_ = std::move(world); }
  // "in-process" or "MPI", for messages and reports.
  virtual const char* backend() const = 0;
  // Whether a thread other than the one that made the communicator may make
  // its calls (still one thread at a time): a model's communication thread
  // does, to run collectives under the kernels. MPI says so only when it was
  // initialized with MPI_THREAD_SERIALIZED or more.
  virtual bool other_threads_may_call() const { return true; }
  // Whether the buffers of this backend's calls are device memory (NCCL).
  virtual bool moves_device_memory() const { return false; }
  // Backends on device memory: later calls run on `stream` (a CUstream of
  // the communicator's device and context, e.g. a model's communication
  // stream) instead of their own, each after the work queued on `after` (a
  // model's compute stream) before the call: an event recorded there that
  // `stream` waits for, so the caller need not wait for its kernels first.
  // Each call still returns once its work is done, or throws at the timeout.
  // nullptr for either: the backend's own stream, no ordering. Host backends
  // ignore it.
  virtual void use_streams(void* stream, void* after) {}
  // The stream whose work queued before a call runs before it (use_streams'
  // `after`); nullptr: none. Collectives on device memory need it to be the
  // stream their copies run on (check_ordered, runtime/collectives.h).
  virtual void* runs_after() const { return nullptr; }

  // How long any call waits for its peers before throwing. Must be a positive,
  // finite number of seconds: a dead or stuck peer must never hang the others.
  double timeout_s() const { return timeout_s_; }
  void set_timeout_s(double seconds);

  // All-to-all with uneven splits. `send` holds size() blocks back to back:
  // block p has send_counts[p] elements, goes to rank p, and starts at element
  // send_counts[0] + ... + send_counts[p-1]. `recv` likewise holds size()
  // blocks: block p has recv_counts[p] elements, came from rank p, and starts at
  // recv_counts[0] + ... + recv_counts[p-1]. Counts may be zero. recv_counts[p]
  // on this rank must equal send_counts[rank()] on rank p. The block a rank sends
  // itself is copied locally and not counted as traffic.
  void all_to_all_v(const float* send, const int64_t* send_counts, float* recv, const int64_t* recv_counts);
  void all_to_all_v(const int32_t* send, const int64_t* send_counts, int32_t* recv, const int64_t* recv_counts);
  // all_to_all_v(...) of f32, finished by wait() (or join): in the
  // background where the backend can (NCCL: queued now on its stream, after
  // the caller's compute stream's work); others move the blocks inside
  // wait(). Both buffers stay untouched until then. A GPU step's Ulysses
  // all-to-alls run so, under the kernels between their start and the
  // first kernel that reads what they bring.
  std::unique_ptr<Exchange> start_all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                                               const int64_t* recv_counts);

  // In place: data[i] becomes the sum of data[i] over all ranks. Every rank gets
  // bitwise the same result (the in-process group sums in rank order).
  void all_reduce_sum(float* data, int64_t n);
  void all_reduce_sum(double* data, int64_t n);
  // all_reduce_sum(data, n), finished by wait(): in the background where the
  // backend can (NCCL: queued now on its stream, after the caller's compute
  // stream's work); others sum inside wait(). `data` must stay untouched
  // until then, and every rank starts and waits for its sums in the same
  // order as its other calls. A GPU step sums its gradients so, bucket by
  // bucket, as the backward finishes them.
  std::unique_ptr<Exchange> start_all_reduce_sum(float* data, int64_t n);
  // Scalars, e.g. a global count of real tokens for the loss.
  double all_reduce_sum(double value);
  int64_t all_reduce_sum(int64_t value);

  // recv (size() * n elements) gets rank p's n elements at offset p * n.
  void all_gather(const float* send, int64_t n, float* recv);
  void all_gather(const int32_t* send, int64_t n, int32_t* recv);

  // send holds size() * n_per_rank elements; recv (n_per_rank elements) gets
  // the sum over all ranks of their block rank() (elements rank() * n_per_rank ...).
  void reduce_scatter_sum(const float* send, float* recv, int64_t n_per_rank);

  // The same sums with half the bytes on the wire: every rank's values are
  // rounded to bf16 (nearest, ties to even) and moved by all_to_all_v, and
  // each rank adds the size() blocks it receives in f32, in rank order, so
  // every run and every rank agree bitwise. What DeepSpeed's bf16
  // communication data type and Megatron's bf16 gradient reduction trade:
  // the summands lose their low bits, the sum does not. all_reduce_sum_bf16
  // reduce-scatters so (blocks of ceil(n / size()), the last one short) and
  // all-gathers the f32 sums.
  void reduce_scatter_sum_bf16(const float* send, float* recv, int64_t n_per_rank);
  void all_reduce_sum_bf16(float* data, int64_t n);

  // Point to point. A message is matched by (sender, receiver, tag), in order;
  // n must agree on both sides. Tags are 0..kMaxCommTag. A rank cannot send to
  // itself (copy the buffer instead). send returns once `data` may be reused.
  void send(const float* data, int64_t n, int peer, int tag);
  void send(const int32_t* data, int64_t n, int peer, int tag);
  void recv(float* data, int64_t n, int peer, int tag);
  void recv(int32_t* data, int64_t n, int peer, int tag);

  void barrier();

  // The ranks that pass the same color form a new communicator, ranked by
  // key (then by this group's rank), with this one's timeout; errors name
  // the launched ranks as before. Collective: every rank calls it, in the
  // same order as its other calls. A hybrid (Ulysses x ring) step splits its
  // sequence group into Ulysses groups and ring groups this way.
  std::unique_ptr<Communicator> split(int color, int key);

  // Sends n elements to rank `to` and receives n from rank `from`, in the
  // background where the backend can (MPI: nonblocking calls; in-process:
  // the send is buffered); others do both inside wait(), in an order that
  // cannot deadlock when every rank of a ring calls it together.
  std::unique_ptr<Exchange> start_exchange(const float* send, float* recv, int64_t n, int to, int from, int tag);
  std::unique_ptr<Exchange> start_exchange(const int32_t* send, int32_t* recv, int64_t n, int to, int from, int tag);

  // Bytes this rank has sent through all_to_all_v to other ranks (the block
  // to itself excluded), summed over all successful calls since construction
  // or the last reset. Tests and benchmarks check it against the formula of a
  // schedule, e.g. Ulysses' (P-1)/P of each q/k/v/out slice per layer.
  int64_t all_to_all_bytes_sent() const { return all_to_all_bytes_sent_; }
  void reset_all_to_all_bytes_sent() { all_to_all_bytes_sent_ = 0, p2p_bytes_sent_ = 0; }
  // Bytes this rank has sent with send() (ring attention's block passes),
  // since construction or the last reset.
  int64_t p2p_bytes_sent() const { return p2p_bytes_sent_; }

 protected:
  Communicator(int rank, int size, double timeout_s);

  // Backends implement these. Arguments are already checked (counts >= 0,
  // non-null buffers where elements move, peers and tags in range).
  virtual void do_all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                               CommType type) = 0;
  virtual void do_all_reduce_sum(void* data, int64_t n, CommType type) = 0;
  virtual void do_all_gather(const void* send, int64_t n, void* recv, CommType type) = 0;
  virtual void do_reduce_scatter_sum(const void* send, void* recv, int64_t n_per_rank, CommType type) = 0;
  virtual void do_send(const void* data, int64_t n, int peer, int tag, CommType type) = 0;
  virtual void do_recv(void* data, int64_t n, int peer, int tag, CommType type) = 0;
  virtual void do_barrier() = 0;
  // Backends that can make subgroups override this (the default throws).
  virtual std::unique_ptr<Communicator> do_split(int color, int key);
  // The world rank of this group's rank r (r itself on the world).
  int world_rank_of(int r) const { return world_ranks_.empty() ? r : world_ranks_[static_cast<size_t>(r)]; }
  // Default: nothing in the background; wait() sends then receives on even
  // ranks, receives then sends on odd ones.
  virtual std::unique_ptr<Exchange> do_start_exchange(const void* send, void* recv, int64_t n, int to, int from,
                                                      int tag, CommType type);
  // Default: the sum inside wait().
  virtual std::unique_ptr<Exchange> do_start_all_reduce_sum(float* data, int64_t n);
  // Default: the all-to-all inside wait().
  virtual std::unique_ptr<Exchange> do_start_all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                                                          const int64_t* recv_counts, CommType type);

  // "all_to_all_v on rank 1 of 4"
  std::string where(CommOp op) const;
  // The timeout error: "error: <op> on rank r of n timed out after T s waiting
  // for rank(s) <missing> (dead or stuck?)" then `detail` (one line or more,
  // may be empty), then the fix.
  std::string timeout_message(CommOp op, const std::vector<int>& missing, const std::string& detail) const;
  // "rank 2", "ranks 1, 3", "a peer" (empty list); on a group of a larger
  // world (see set_world_ranks), "rank 1 (world rank 3)".
  std::string rank_list(const std::vector<int>& ranks) const;
  // "0.5", "60": seconds as people write them.
  static std::string seconds_string(double s);

 private:
  void check_buffer(CommOp op, const char* name, const void* p, int64_t n) const;
  void check_count(CommOp op, const char* name, int64_t n) const;
  void check_counts(CommOp op, const char* name, const int64_t* counts) const;
  void check_peer(CommOp op, int peer, int tag) const;
  void all_to_all_v_any(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                        CommType type);
  // all_to_all_v's checks; returns the elements sent to other ranks.
  int64_t check_all_to_all_v(const void* send, const int64_t* send_counts, const void* recv,
                             const int64_t* recv_counts) const;
  void send_any(const void* data, int64_t n, int peer, int tag, CommType type);
  void recv_any(void* data, int64_t n, int peer, int tag, CommType type);
  std::unique_ptr<Exchange> start_exchange_any(const void* send, void* recv, int64_t n, int to, int from, int tag,
                                               CommType type);

  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;  // empty: this is the world
  double timeout_s_ = kDefaultCommTimeoutS;
  int64_t all_to_all_bytes_sent_ = 0;
  int64_t p2p_bytes_sent_ = 0;
};

// n ranks as threads of this process, over shared memory: element [r] is rank
// r's communicator, to be used by one thread. Used by fast unit tests. A failure
// on one rank (a timeout, mismatched calls) breaks the whole group, so peers
// blocked in a call fail at once instead of waiting out their own timeout.
std::vector<std::unique_ptr<Communicator>> make_in_process_group(int n, double timeout_s = kDefaultCommTimeoutS);

// This process's rank of MPI_COMM_WORLD (runtime/comm_mpi.cpp; link
// halyard_comm_mpi). Initializes MPI if nobody has (and finalizes it at exit,
// unless a communicator failed: finalizing then could wait on a dead peer).
// Each call makes an independent communicator over a duplicate of the world.
// With color >= 0, the communicator spans only the world ranks that pass the
// same color (ranked in world order): e.g. the sp group of a dp x sp mesh,
// color = world_rank / sp. Its ranks (also in error messages) are group ranks.
std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s = kDefaultCommTimeoutS, int color = -1);

// This process's rank of MPI_COMM_WORLD over NCCL, for GPUs (runtime/comm_nccl_mpi.cpp;
// link halyard_comm_nccl, built only where CMake finds CUDA and NCCL). backend()
// is "NCCL". Differences from the contract above:
// - Buffers are DEVICE memory on this rank's GPU (cudaMalloc or managed); a host
//   or other-GPU buffer is a user mistake and throws before anything is sent.
//   The scalar all_reduce_sum overloads still take and return host values, and
//   the array all_reduce_sum, and all_gather with host buffers on both sides,
//   accept host memory too (staged through the GPU). split() is ncclCommSplit:
//   its groups share the device and the streams (use_streams) of this one.
// - One GPU per rank: the device is the node-local rank (OMPI_COMM_WORLD_LOCAL_RANK,
//   else the rank in MPI_Comm_split_type(SHARED)) modulo cudaGetDeviceCount(), so
//   CUDA_VISIBLE_DEVICES with one GPU per rank works too. The factory makes it
//   this thread's current device; allocate buffers after calling it. Each call
//   switches to that device and back, and returns once its work on the GPU is done.
// - NCCL has no tags: messages between a pair of ranks are matched in call order
//   (the tag is only checked to be in range), and a send completes only when the
//   peer receives it, so order the calls so that pairs meet (even ranks send
//   first, odd ranks receive first).
// - A timeout aborts the NCCL communicator (ncclCommAbort). NCCL cannot tell which
//   rank is missing, so the error says "waiting for a peer".
// Bootstrapped over MPI: initializes MPI if nobody has (as make_mpi_communicator
// does), rank 0 makes the ncclUniqueId and broadcasts it over MPI_COMM_WORLD.
// Every rank must call it, in the same order as its other communicators. With no
// CUDA device it throws "error: NCCL communicator on rank r: no CUDA device ...".
std::unique_ptr<Communicator> make_nccl_communicator(double timeout_s = kDefaultCommTimeoutS);

// A group of one over NCCL, without MPI: rank 0 of 1 on this thread's current
// CUDA device. The collectives still launch NCCL's kernels, so a GPU node
// without MPI (scripts/gpu_check.sh) checks NCCL, its libraries and the
// device-buffer contract. Same errors as above with no CUDA device.
std::unique_ptr<Communicator> make_nccl_single_rank(double timeout_s = kDefaultCommTimeoutS);

}  // namespace halyard::runtime
