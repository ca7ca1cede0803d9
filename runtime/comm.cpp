// The Communicator base (see comm.h): names, argument checks, the traffic
// counter and the shared message shapes; backends implement the do_* hooks.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/comm.h"
#include "runtime/bf16.h"
#include "runtime/error.h"

namespace halyard::runtime {

const char* comm_type_name(CommType t) {
  switch (t) {
    case CommType::F32: return "f32";
    case CommType::I32: return "i32";
    case CommType::F64: return "f64";
    case CommType::I64: return "i64";
    case CommType::BF16: return "bf16";
  }
  return "?";
}

int64_t comm_type_size(CommType t) {
  switch (t) {
    case CommType::BF16: return 2;
    case CommType::F32:
    case CommType::I32: return 4;
    case CommType::F64:
    case CommType::I64: return 8;
  }
  return 0;
}

namespace {
template <typename T>
void sum_into(void* acc, const void* x, int64_t n) {
  T* a = static_cast<T*>(acc);
  const T* b = static_cast<const T*>(x);
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}
}  // namespace

void comm_sum_into(CommType t, void* acc, const void* x, int64_t n) {
  switch (t) {
    case CommType::F32: return sum_into<float>(acc, x, n);
    case CommType::I32: return sum_into<int32_t>(acc, x, n);
    case CommType::F64: return sum_into<double>(acc, x, n);
    case CommType::I64: return sum_into<int64_t>(acc, x, n);
    case CommType::BF16: break;
  }
  throw Error("error: a sum of bf16 values; bf16 only moves (the Communicator::*_bf16 sums add in f32).");
}

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::AllToAllV: return "all_to_all_v";
    case CommOp::AllReduceSum: return "all_reduce_sum";
    case CommOp::AllGather: return "all_gather";
    case CommOp::ReduceScatterSum: return "reduce_scatter_sum";
    case CommOp::Send: return "send";
    case CommOp::Recv: return "recv";
    case CommOp::Barrier: return "barrier";
  }
  return "?";
}

Communicator::Communicator(int rank, int size, double timeout_s) : rank_(rank), size_(size) {
  set_timeout_s(timeout_s);
}

std::string Communicator::seconds_string(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

void Communicator::set_timeout_s(double seconds) {
  if (seconds > 0 && std::isfinite(seconds)) {
    timeout_s_ = seconds;
    return;
  }
  throw Error("error: communicator timeout of " + seconds_string(seconds) + " s on rank " + std::to_string(rank_) +
              " of " + std::to_string(size_) +
              "\nthe timeout must be a positive, finite number of seconds: a dead or stuck peer must never hang "
              "the others.\nfix: pass e.g. " +
              seconds_string(kDefaultCommTimeoutS) + " (the default), or 0.5 in tests.");
}

std::string Communicator::where(CommOp op) const {
  std::string s = std::string(comm_op_name(op)) + " on rank " + std::to_string(rank_) + " of " + std::to_string(size_);
  if (static_cast<int>(world_ranks_.size()) == size_)
    s += " (world rank " + std::to_string(world_ranks_[static_cast<size_t>(rank_)]) + ")";
  return s;
}

std::string Communicator::rank_list(const std::vector<int>& ranks) const {
  if (ranks.empty()) return "a peer";
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(ranks[i]);
    if (static_cast<int>(world_ranks_.size()) == size_ && ranks[i] >= 0 && ranks[i] < size_)
      s += " (world rank " + std::to_string(world_ranks_[static_cast<size_t>(ranks[i])]) + ")";
  }
  return s;
}

std::string Communicator::timeout_message(CommOp op, const std::vector<int>& missing, const std::string& detail) const {
  std::string who = rank_list(missing);
  return "error: " + where(op) + " timed out after " + seconds_string(timeout_s_) + " s waiting for " + who +
         " (dead or stuck?)" + (detail.empty() ? "" : "\n" + detail) +
         "\nevery rank must make the same calls in the same order; if " + who + (missing.size() > 1 ? " are" : " is") +
         " only slow (a long step, a slow disk), raise the timeout with Communicator::set_timeout_s.";
}

void Communicator::check_count(CommOp op, const char* name, int64_t n) const {
  if (n >= 0) return;
  throw Error("error: " + where(op) + ": " + name + " is " + std::to_string(n) +
              "; counts are numbers of elements and must be >= 0.");
}

void Communicator::check_buffer(CommOp op, const char* name, const void* p, int64_t n) const {
  if (p != nullptr || n == 0) return;
  throw Error("error: " + where(op) + ": " + name + " is null but must hold " + std::to_string(n) +
              " elements.\nfix: pass a buffer of at least " + std::to_string(n) + " elements.");
}

void Communicator::check_counts(CommOp op, const char* name, const int64_t* counts) const {
  if (counts == nullptr)
    throw Error("error: " + where(op) + ": " + name + " is null.\nfix: pass " + std::to_string(size_) +
                " counts, one per rank (zeros allowed).");
  for (int p = 0; p < size_; ++p)
    if (counts[p] < 0)
      throw Error("error: " + where(op) + ": " + name + "[" + std::to_string(p) + "] is " +
                  std::to_string(counts[p]) + "; counts are numbers of elements per rank and must be >= 0.");
}

void Communicator::check_peer(CommOp op, int peer, int tag) const {
  std::string legal = size_ == 1 ? "none (a group of 1 rank has no peers)"
                                 : "0.." + std::to_string(size_ - 1) + " except " + std::to_string(rank_) +
                                       " (this rank)";
  if (peer < 0 || peer >= size_)
    throw Error("error: " + where(op) + ": peer " + std::to_string(peer) + " is not a rank.\nlegal peers: " + legal);
  if (peer == rank_)
    throw Error("error: " + where(op) + ": peer " + std::to_string(peer) +
                " is this rank; a rank cannot send to or receive from itself.\nfix: copy the buffer instead.");
  if (tag < 0 || tag > kMaxCommTag)
    throw Error("error: " + where(op) + ": tag " + std::to_string(tag) + " is out of range.\nlegal tags: 0.." +
                std::to_string(kMaxCommTag));
}

int64_t Communicator::check_all_to_all_v(const void* send, const int64_t* send_counts, const void* recv,
                                         const int64_t* recv_counts) const {
  check_counts(CommOp::AllToAllV, "send_counts", send_counts);
  check_counts(CommOp::AllToAllV, "recv_counts", recv_counts);
  int64_t send_total = 0, recv_total = 0, to_peers = 0;
  for (int p = 0; p < size_; ++p) {
    send_total += send_counts[p];
    recv_total += recv_counts[p];
    if (p != rank_) to_peers += send_counts[p];
  }
  check_buffer(CommOp::AllToAllV, "send", send, send_total);
  check_buffer(CommOp::AllToAllV, "recv", recv, recv_total);
  return to_peers;
}

void Communicator::all_to_all_v_any(const void* send, const int64_t* send_counts, void* recv,
                                    const int64_t* recv_counts, CommType type) {
  const int64_t to_peers = check_all_to_all_v(send, send_counts, recv, recv_counts);
  do_all_to_all_v(send, send_counts, recv, recv_counts, type);
  all_to_all_bytes_sent_ += to_peers * comm_type_size(type);
}

void Communicator::all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                                const int64_t* recv_counts) {
  all_to_all_v_any(send, send_counts, recv, recv_counts, CommType::F32);
}

void Communicator::all_to_all_v(const int32_t* send, const int64_t* send_counts, int32_t* recv,
                                const int64_t* recv_counts) {
  all_to_all_v_any(send, send_counts, recv, recv_counts, CommType::I32);
}

void Communicator::all_reduce_sum(float* data, int64_t n) {
  check_count(CommOp::AllReduceSum, "n", n);
  check_buffer(CommOp::AllReduceSum, "data", data, n);
  do_all_reduce_sum(data, n, CommType::F32);
}

void Communicator::all_reduce_sum(double* data, int64_t n) {
  check_count(CommOp::AllReduceSum, "n", n);
  check_buffer(CommOp::AllReduceSum, "data", data, n);
  do_all_reduce_sum(data, n, CommType::F64);
}

double Communicator::all_reduce_sum(double value) {
  do_all_reduce_sum(&value, 1, CommType::F64);
  return value;
}

int64_t Communicator::all_reduce_sum(int64_t value) {
  do_all_reduce_sum(&value, 1, CommType::I64);
  return value;
}

void Communicator::all_gather(const float* send, int64_t n, float* recv) {
  check_count(CommOp::AllGather, "n", n);
  check_buffer(CommOp::AllGather, "send", send, n);
  check_buffer(CommOp::AllGather, "recv", recv, n * size_);
  do_all_gather(send, n, recv, CommType::F32);
}

void Communicator::all_gather(const int32_t* send, int64_t n, int32_t* recv) {
  check_count(CommOp::AllGather, "n", n);
  check_buffer(CommOp::AllGather, "send", send, n);
  check_buffer(CommOp::AllGather, "recv", recv, n * size_);
  do_all_gather(send, n, recv, CommType::I32);
}

void Communicator::reduce_scatter_sum(const float* send, float* recv, int64_t n_per_rank) {
  check_count(CommOp::ReduceScatterSum, "n_per_rank", n_per_rank);
  check_buffer(CommOp::ReduceScatterSum, "send", send, n_per_rank * size_);
  check_buffer(CommOp::ReduceScatterSum, "recv", recv, n_per_rank);
  do_reduce_scatter_sum(send, recv, n_per_rank, CommType::F32);
}

// The bf16 sums go kBf16SumChunk elements (of all ranks) per all-to-all, so
// their staging is bounded however many gradients they sum: 4 MiB for the
// reduce-scatter, about 9 MiB for the all-reduce (the plan counts it:
// grad_sum_staging in schedules/plan.cpp). Each element is summed whole, in
// rank order, so the chunks change no bit.
constexpr int64_t kBf16SumChunk = int64_t{1} << 20;

void Communicator::reduce_scatter_sum_bf16(const float* send, float* recv, int64_t n_per_rank) {
  check_count(CommOp::ReduceScatterSum, "n_per_rank", n_per_rank);
  check_buffer(CommOp::ReduceScatterSum, "send", send, n_per_rank * size_);
  check_buffer(CommOp::ReduceScatterSum, "recv", recv, n_per_rank);
  const int64_t chunk = std::min(n_per_rank, std::max<int64_t>(1, kBf16SumChunk / size_));  // of each rank's block
  std::vector<uint16_t> out(static_cast<size_t>(chunk * size_)), in(out.size());
  int64_t at = 0;
  do {  // once even when n_per_rank is 0, like every rank
    const int64_t c = std::min(chunk, n_per_rank - at);
    for (int p = 0; p < size_; ++p)
      for (int64_t i = 0; i < c; ++i) out[static_cast<size_t>(p * c + i)] = bf16_bits(send[p * n_per_rank + at + i]);
    const std::vector<int64_t> counts(static_cast<size_t>(size_), c);
    all_to_all_v_any(out.data(), counts.data(), in.data(), counts.data(), CommType::BF16);
    for (int64_t i = 0; i < c; ++i) {
      float sum = 0;
      for (int p = 0; p < size_; ++p) sum += bf16_value(in[static_cast<size_t>(p * c + i)]);
      recv[at + i] = sum;
    }
    at += c;
  } while (at < n_per_rank);
}

// Segments of kBf16SumChunk elements (a multiple of the ranks), the last
// padded to one: the same bits and bytes on the wire as one call over all n.
void Communicator::all_reduce_sum_bf16(float* data, int64_t n) {
  check_count(CommOp::AllReduceSum, "n", n);
  check_buffer(CommOp::AllReduceSum, "data", data, n);
  const int64_t segment = std::max<int64_t>(1, kBf16SumChunk / size_) * size_;
  const int64_t first = std::min(segment, (n + size_ - 1) / size_ * size_);
  std::vector<float> padded(static_cast<size_t>(first)), mine(static_cast<size_t>(first / size_));
  int64_t at = 0;
  do {  // once even when n is 0, like every rank
    const int64_t len = std::min(segment, n - at), block = (len + size_ - 1) / size_;
    std::fill(padded.begin(), padded.begin() + block * size_, 0.f);
    std::copy(data + at, data + at + len, padded.begin());
    reduce_scatter_sum_bf16(padded.data(), mine.data(), block);
    all_gather(mine.data(), block, padded.data());
    std::copy(padded.begin(), padded.begin() + len, data + at);
    at += len;
  } while (at < n);
}

void Communicator::send_any(const void* data, int64_t n, int peer, int tag, CommType type) {
  check_peer(CommOp::Send, peer, tag);
  check_count(CommOp::Send, "n", n);
  check_buffer(CommOp::Send, "data", data, n);
  do_send(data, n, peer, tag, type);
  p2p_bytes_sent_ += n * comm_type_size(type);
}

void Communicator::recv_any(void* data, int64_t n, int peer, int tag, CommType type) {
  check_peer(CommOp::Recv, peer, tag);
  check_count(CommOp::Recv, "n", n);
  check_buffer(CommOp::Recv, "data", data, n);
  do_recv(data, n, peer, tag, type);
}

namespace {
class DeferredExchange final : public Exchange {
 public:
  explicit DeferredExchange(std::function<void()> both) : both_(std::move(both)) {}
  void wait() override {
    if (both_) std::exchange(both_, nullptr)();
  }

 private:
  std::function<void()> both_;
};
}  // namespace

std::unique_ptr<Exchange> Communicator::do_start_exchange(const void* send, void* recv, int64_t n, int to, int from,
                                                          int tag, CommType type) {
  return std::make_unique<DeferredExchange>([=, this] {
    if (rank() % 2 == 0) {
      do_send(send, n, to, tag, type);
      do_recv(recv, n, from, tag, type);
    } else {
      do_recv(recv, n, from, tag, type);
      do_send(send, n, to, tag, type);
    }
  });
}

std::unique_ptr<Exchange> Communicator::start_all_reduce_sum(float* data, int64_t n) {
  check_count(CommOp::AllReduceSum, "n", n);
  check_buffer(CommOp::AllReduceSum, "data", data, n);
  return do_start_all_reduce_sum(data, n);
}

std::unique_ptr<Exchange> Communicator::do_start_all_reduce_sum(float* data, int64_t n) {
  return std::make_unique<DeferredExchange>([=, this] { do_all_reduce_sum(data, n, CommType::F32); });
}

std::unique_ptr<Exchange> Communicator::start_all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                                                           const int64_t* recv_counts) {
  const int64_t to_peers = check_all_to_all_v(send, send_counts, recv, recv_counts);
  auto started = do_start_all_to_all_v(send, send_counts, recv, recv_counts, CommType::F32);
  all_to_all_bytes_sent_ += to_peers * comm_type_size(CommType::F32);
  return started;
}

std::unique_ptr<Exchange> Communicator::do_start_all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                                                              const int64_t* recv_counts, CommType type) {
  // (The counts are the caller's; they may be gone by wait().)
  return std::make_unique<DeferredExchange>(
      [=, this, s = std::vector<int64_t>(send_counts, send_counts + size()),
       r = std::vector<int64_t>(recv_counts, recv_counts + size())] { do_all_to_all_v(send, s.data(), recv, r.data(), type); });
}

std::unique_ptr<Communicator> Communicator::do_split(int, int) {
  throw Error(std::string("error: ") + backend() + " communicator on rank " + std::to_string(rank()) +
              " cannot split into subgroups.\nfix: use the MPI or in-process backend for hybrid (Ulysses x ring) steps.");
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  if (color < 0)
    throw Error("error: split on rank " + std::to_string(rank()) + " of " + std::to_string(size()) + ": color " +
                std::to_string(color) + " is negative.\nlegal: colors >= 0.");
  auto sub = do_split(color, key);
  std::vector<int> world(static_cast<size_t>(sub->size()));
  const int32_t mine = world_rank_of(rank());
  std::vector<int32_t> all(static_cast<size_t>(sub->size()));
  sub->all_gather(&mine, 1, all.data());
  world.assign(all.begin(), all.end());
  sub->set_world_ranks(std::move(world));
  return sub;
}

std::unique_ptr<Exchange> Communicator::start_exchange_any(const void* send, void* recv, int64_t n, int to, int from,
                                                           int tag, CommType type) {
  check_peer(CommOp::Send, to, tag);
  check_peer(CommOp::Recv, from, tag);
  check_count(CommOp::Send, "n", n);
  check_buffer(CommOp::Send, "send", send, n);
  check_buffer(CommOp::Recv, "recv", recv, n);
  auto e = do_start_exchange(send, recv, n, to, from, tag, type);
  p2p_bytes_sent_ += n * comm_type_size(type);
  return e;
}

std::unique_ptr<Exchange> Communicator::start_exchange(const float* send, float* recv, int64_t n, int to, int from,
                                                       int tag) {
  return start_exchange_any(send, recv, n, to, from, tag, CommType::F32);
}
std::unique_ptr<Exchange> Communicator::start_exchange(const int32_t* send, int32_t* recv, int64_t n, int to,
                                                       int from, int tag) {
  return start_exchange_any(send, recv, n, to, from, tag, CommType::I32);
}

void Communicator::send(const float* data, int64_t n, int peer, int tag) {
  send_any(data, n, peer, tag, CommType::F32);
}
void Communicator::send(const int32_t* data, int64_t n, int peer, int tag) {
  send_any(data, n, peer, tag, CommType::I32);
}
void Communicator::recv(float* data, int64_t n, int peer, int tag) { recv_any(data, n, peer, tag, CommType::F32); }
void Communicator::recv(int32_t* data, int64_t n, int peer, int tag) {
  recv_any(data, n, peer, tag, CommType::I32);
}

void Communicator::barrier() { do_barrier(); }

}  // namespace halyard::runtime
