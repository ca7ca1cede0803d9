// The MPI communicator: one rank of MPI_COMM_WORLD (launched by mpirun).
//
// Every operation is a nonblocking MPI call (MPI_Ialltoallv, MPI_Iallreduce,
// MPI_Iallgather, MPI_Ibarrier, MPI_Isend, MPI_Irecv; the reduce-scatter and
// large sums are rings of MPI_Isend and MPI_Irecv) polled with MPI_Test
// until it completes or the deadline passes, so a dead or stuck peer costs
// its partners a timeout, never a hang. The communicator is a duplicate of
// the world with MPI_ERRORS_RETURN, so an error MPI does detect (a broken
// connection) becomes an Error rather than an abort.
//
// MPI cannot tell which rank is missing from a collective, so the ranks talk
// on a second duplicate, the control communicator. A rank that times out asks
// every peer where it is; a peer answers whenever it is inside a call of this
// communicator (it polls the control queue while it waits):
//   query   {kQuery, query id, my collective number, my op}
//   reply   {kReply, query id, its collectives started, op of its last one, inside it?}
//   gave up {kGaveUp, collective number, op}  (sent by a rank that timed out)
// After a grace period (a quarter of the timeout, at most 1 s) the peers that
// did not answer, or answered from an earlier or a different collective, are
// the ones named in the error. Peers that gave up on the same collective count
// as arrived. Collectives are numbered from 1 on each rank, in call order.
//
// Counts are ints in MPI 3: a call over more than 2^31-1 elements per rank is
// split into pieces where the operation allows it (all_reduce_sum,
// reduce_scatter_sum, send/recv) and rejected with an Error otherwise.
#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
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

MPI_Datatype mpi_type(CommType t) {
  switch (t) {
    case CommType::F32: return MPI_FLOAT;
    case CommType::I32: return MPI_INT32_T;
    case CommType::F64: return MPI_DOUBLE;
    case CommType::I64: return MPI_INT64_T;
    case CommType::BF16: return MPI_UINT16_T;  // moved, never summed
  }
  return MPI_DATATYPE_NULL;
}

// Pieces of split calls; a power of two keeps them aligned.
constexpr int64_t kMaxPiece = int64_t{1} << 30;
// all_reduce_sum goes round a ring from this many bytes (libnbc's own limit
// for its small-message tree).
constexpr int64_t kRingMinBytes = 64 << 10;

// Control messages; the ring collectives' messages go on the same communicator.
constexpr int kControlTag = 1;
constexpr int kRingTag = 2;
enum : int64_t { kQuery = 1, kReply = 2, kGaveUp = 3 };
using Control = std::array<int64_t, 5>;

// A buffer MPI may point at when a count is zero and the caller passed null.
char g_empty[8];

// Polls `request` until it completes or `deadline` passes, calling `idle`
// about every 5 ms. Spins (yielding the core) for the first millisecond, then
// sleeps 50 us between tests: MPI progresses a nonblocking collective only
// inside MPI calls, so the tests must keep coming. Returns MPI_Test's error
// code, or -1 on timeout.
template <typename Idle>
int poll(MPI_Request* request, MPI_Status* status, Clock::time_point deadline, Idle&& idle) {
  const auto start = Clock::now();
  auto next_idle = start;
  for (;;) {
    int done = 0;
    int rc = MPI_Test(request, &done, status);
    if (rc != MPI_SUCCESS) return rc;
    if (done) return MPI_SUCCESS;
    const auto now = Clock::now();
    if (now >= next_idle) {
      idle();
      next_idle = now + std::chrono::milliseconds(5);
    }
    if (now >= deadline) return -1;
    if (now - start < std::chrono::milliseconds(1))
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(int rank, int size, MPI_Comm data, MPI_Comm control, double timeout_s)
      : Communicator(rank, size, timeout_s),
        comm_(data),
        ctl_(control),
        replies_(static_cast<size_t>(size)),
        gave_up_(static_cast<size_t>(size), 0) {}

  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // A failed communicator is left as it is: freeing it could wait on a dead peer.
    if (finalized || !failure_.empty() || comm_ == MPI_COMM_NULL) return;
    for (Pending& p : pending_) {
      int done = 0;
      MPI_Test(&p.request, &done, MPI_STATUS_IGNORE);
      if (!done) MPI_Request_free(&p.request);  // a reply to a peer that gave up
    }
    MPI_Comm_free(&ctl_);
    MPI_Comm_free(&comm_);
  }

  const char* backend() const override { return "MPI"; }
  bool other_threads_may_call() const override {
    int level = MPI_THREAD_SINGLE;
    return MPI_Query_thread(&level) == MPI_SUCCESS && level >= MPI_THREAD_SERIALIZED;
  }

 protected:
  void do_all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                       CommType type) override {
    const size_t n = static_cast<size_t>(size());
    send_counts_.resize(n), send_offsets_.resize(n), recv_counts_.resize(n), recv_offsets_.resize(n);
    int64_t send_at = 0, recv_at = 0;
    for (size_t p = 0; p < n; ++p) {
      send_offsets_[p] = to_int(CommOp::AllToAllV, "the offset of send block " + std::to_string(p), send_at);
      recv_offsets_[p] = to_int(CommOp::AllToAllV, "the offset of recv block " + std::to_string(p), recv_at);
      send_counts_[p] = to_int(CommOp::AllToAllV, "send_counts[" + std::to_string(p) + "]", send_counts[p]);
      recv_counts_[p] = to_int(CommOp::AllToAllV, "recv_counts[" + std::to_string(p) + "]", recv_counts[p]);
      send_at += send_counts[p];
      recv_at += recv_counts[p];
    }
    start(CommOp::AllToAllV);
    MPI_Request request;
    check(MPI_Ialltoallv(send ? send : g_empty, send_counts_.data(), send_offsets_.data(), mpi_type(type),
                         recv ? recv : g_empty, recv_counts_.data(), recv_offsets_.data(), mpi_type(type), comm_,
                         &request),
          CommOp::AllToAllV, "MPI_Ialltoallv");
    wait(&request, CommOp::AllToAllV);
    finish();
  }

  // Large sums go round a ring (a reduce-scatter, then an all-gather, in
  // place), staging one block; libnbc's in-place MPI_Iallreduce sums on a
  // binomial tree into a whole-size buffer on rank 0 (and rank 2 of 4).
  // Small ones (a loss, a norm) take libnbc's log(ranks) rounds.
  void do_all_reduce_sum(void* data, int64_t n, CommType type) override {
    start(CommOp::AllReduceSum);
    const int64_t elem = comm_type_size(type);
    if (size() > 1 && n * elem >= kRingMinBytes) {
      const int P = size(), r = rank();
      auto lo = [&](int b) { return static_cast<int64_t>(b) * n / P; };  // block b is [lo(b), lo(b + 1))
      auto count = [&](int b) { return lo((b + P) % P + 1) - lo((b + P) % P); };
      auto at = [&](int b) { return static_cast<char*>(data) + lo((b + P) % P) * elem; };
      ring_staging_.resize(static_cast<size_t>(count(P - 1) * elem));  // the last block is the largest, ceil(n / P)
      for (int s = 0; s < P - 1; ++s) {  // block b summed from rank b + 1 round to rank b
        const int out = r - 1 - s, in = r - 2 - s;
        ring_step(at(out), count(out), ring_staging_.data(), count(in), type);
        comm_sum_into(type, at(in), ring_staging_.data(), count(in));
      }
      for (int s = 0; s < P - 1; ++s) ring_step(at(r - s), count(r - s), at(r - 1 - s), count(r - 1 - s), type);
      finish();
      return;
    }
    int64_t at = 0;
    do {  // once even when n is 0, like every rank
      int piece = static_cast<int>(std::min(n - at, kMaxPiece));
      MPI_Request request;
      check(MPI_Iallreduce(MPI_IN_PLACE, data ? static_cast<char*>(data) + at * elem : g_empty, piece, mpi_type(type),
                           MPI_SUM, comm_, &request),
            CommOp::AllReduceSum, "MPI_Iallreduce");
      wait(&request, CommOp::AllReduceSum);
      at += piece;
    } while (at < n);
    finish();
  }

  void do_all_gather(const void* send, int64_t n, void* recv, CommType type) override {
    int count = to_int(CommOp::AllGather, "n", n);
    to_int(CommOp::AllGather, "size() * n", n * size());
    start(CommOp::AllGather);
    MPI_Request request;
    check(MPI_Iallgather(send ? send : g_empty, count, mpi_type(type), recv ? recv : g_empty, count, mpi_type(type),
                         comm_, &request),
          CommOp::AllGather, "MPI_Iallgather");
    wait(&request, CommOp::AllGather);
    finish();
  }

  // A ring, as NCCL's: in each of size() - 1 steps every rank sends the
  // partial sum of one block to the next rank and adds its own share to the
  // block that comes from the previous one; the last to come is its own.
  // Block b is summed from rank b + 1 round to rank b. A rank stages one
  // block (recv is the other). libnbc's MPI_Ireduce_scatter_block instead
  // sums the whole vector to rank 0 on a binomial tree: rank 0 of 4 does the
  // sums in two whole-vector buffers (rank 2 in one), 12.5 MiB above its
  // peers for the tiny Llama's 6.25 MiB of gradients.
  void do_reduce_scatter_sum(const void* send, void* recv, int64_t n_per_rank, CommType type) override {
    start(CommOp::ReduceScatterSum);
    const int P = size(), r = rank();
    const int64_t bytes = n_per_rank * comm_type_size(type);
    auto own = [&](int b) { return bytes ? static_cast<const char*>(send) + (b + P) % P * bytes : nullptr; };
    if (P == 1 && bytes > 0) std::memcpy(recv, send, static_cast<size_t>(bytes));
    if (P > 1) ring_staging_.resize(static_cast<size_t>(bytes));
    const void* out = own(r - 1);
    for (int s = 0; s < P - 1; ++s) {
      void* in = (P - 2 - s) % 2 == 0 ? recv : static_cast<void*>(ring_staging_.data());
      ring_step(out, n_per_rank, in, n_per_rank, type);
      comm_sum_into(type, in, own(r - 2 - s), n_per_rank);
      out = in;
    }
    finish();
  }

  void do_barrier() override {
    start(CommOp::Barrier);
    MPI_Request request;
    check(MPI_Ibarrier(comm_, &request), CommOp::Barrier, "MPI_Ibarrier");
    wait(&request, CommOp::Barrier);
    finish();
  }

  void do_send(const void* data, int64_t n, int peer, int tag, CommType type) override {
    throw_if_broken(CommOp::Send);
    const Peer who{peer, tag, n, type};
    int64_t at = 0;
    do {
      int piece = static_cast<int>(std::min(n - at, kMaxPiece));
      MPI_Request request;
      check(MPI_Isend(data ? static_cast<const char*>(data) + at * comm_type_size(type) : g_empty, piece,
                      mpi_type(type), peer, tag, comm_, &request),
            CommOp::Send, "MPI_Isend");
      wait(&request, CommOp::Send, &who);
      at += piece;
    } while (at < n);
  }

  void do_recv(void* data, int64_t n, int peer, int tag, CommType type) override {
    throw_if_broken(CommOp::Recv);
    const Peer who{peer, tag, n, type};
    int64_t at = 0;
    do {
      int piece = static_cast<int>(std::min(n - at, kMaxPiece));
      MPI_Request request;
      check(MPI_Irecv(data ? static_cast<char*>(data) + at * comm_type_size(type) : g_empty, piece, mpi_type(type),
                      peer, tag, comm_, &request),
            CommOp::Recv, "MPI_Irecv");
      MPI_Status status = wait(&request, CommOp::Recv, &who);
      int got = 0;
      MPI_Get_count(&status, mpi_type(type), &got);
      if (got != piece) size_mismatch(who, at + got);
      at += piece;
    } while (at < n);
  }

  // A barrier first (with the timeout: every member is alive), then the
  // blocking MPI_Comm_split of both communicators.
  std::unique_ptr<Communicator> do_split(int color, int key) override {
    barrier();
    MPI_Comm comms[2] = {MPI_COMM_NULL, MPI_COMM_NULL};
    const MPI_Comm from[2] = {comm_, ctl_};
    for (int k = 0; k < 2; ++k) {
      check(MPI_Comm_split(from[k], color, key, &comms[k]), CommOp::Barrier, "MPI_Comm_split");
      MPI_Comm_set_errhandler(comms[k], MPI_ERRORS_RETURN);
    }
    int rank = 0, size = 0;
    MPI_Comm_rank(comms[0], &rank);
    MPI_Comm_size(comms[0], &size);
    return std::make_unique<MpiCommunicator>(rank, size, comms[0], comms[1], timeout_s());
  }

  // Both directions posted at once (MPI_Irecv, MPI_Isend); wait() polls them
  // like any call, so a dead peer is named after the timeout.
  std::unique_ptr<Exchange> do_start_exchange(const void* send, void* recv, int64_t n, int to, int from, int tag,
                                              CommType type) override {
    throw_if_broken(CommOp::Send);
    auto e = std::make_unique<MpiExchange>(*this, Peer{to, tag, n, type}, Peer{from, tag, n, type});
    const int64_t bytes = comm_type_size(type);
    int64_t at = 0;
    do {
      const int piece = static_cast<int>(std::min(n - at, kMaxPiece));
      MPI_Request r, q;
      check(MPI_Irecv(recv ? static_cast<char*>(recv) + at * bytes : g_empty, piece, mpi_type(type), from, tag, comm_, &r),
            CommOp::Recv, "MPI_Irecv");
      e->recvs.push_back({r, piece});
      check(MPI_Isend(send ? static_cast<const char*>(send) + at * bytes : g_empty, piece, mpi_type(type), to, tag,
                      comm_, &q),
            CommOp::Send, "MPI_Isend");
      e->sends.push_back(q);
      at += piece;
    } while (at < n);
    return e;
  }

 private:
  // The other side of a send or recv, for messages.
  struct Peer {
    int rank, tag;
    int64_t n;
    CommType type;
  };

  struct MpiExchange final : Exchange {
    MpiExchange(MpiCommunicator& c, Peer to, Peer from) : comm(c), to(to), from(from) {}
    ~MpiExchange() override {  // never waited (an earlier error): let MPI drop the requests
      for (auto& [r, piece] : recvs)
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
      for (MPI_Request& q : sends)
        if (q != MPI_REQUEST_NULL) MPI_Request_free(&q);
    }
    void wait() override {
      for (auto& [r, piece] : recvs) {
        MPI_Status status = comm.wait(&r, CommOp::Recv, &from);
        int got = 0;
        MPI_Get_count(&status, mpi_type(from.type), &got);
        if (got != piece) comm.size_mismatch(from, got);
      }
      for (MPI_Request& q : sends) comm.wait(&q, CommOp::Send, &to);
      recvs.clear();
      sends.clear();
    }
    MpiCommunicator& comm;
    Peer to, from;
    std::vector<std::pair<MPI_Request, int>> recvs;
    std::vector<MPI_Request> sends;
  };

  struct Pending {
    Control message;
    MPI_Request request;
  };

  void throw_if_broken(CommOp op) const {
    if (failure_.empty()) return;
    throw Error("error: " + where(op) + ": the communicator is broken by an earlier failure:\n  " + failure_ +
                "\na failed call cannot be undone; report it and exit (then restart from the last checkpoint).");
  }

  // One step of a ring collective: `n_out` elements from `out` to the next
  // rank and `n_in` from the previous into `in`, in flight together. On the
  // control communicator under their own tag, so users' tags on comm_ never
  // match them.
  void ring_step(const void* out, int64_t n_out, void* in, int64_t n_in, CommType type) {
    const int next = (rank() + 1) % size(), prev = (rank() + size() - 1) % size();
    const int64_t elem = comm_type_size(type);
    int64_t sent = 0, got = 0;
    do {  // pieces of at most kMaxPiece each way, once even when both are empty
      const int piece_out = static_cast<int>(std::min(n_out - sent, kMaxPiece));
      const int piece_in = static_cast<int>(std::min(n_in - got, kMaxPiece));
      MPI_Request requests[2];
      check(MPI_Irecv(in && piece_in ? static_cast<char*>(in) + got * elem : g_empty, piece_in, mpi_type(type), prev,
                      kRingTag, ctl_, &requests[0]),
            last_op_, "MPI_Irecv");
      check(MPI_Isend(out && piece_out ? static_cast<const char*>(out) + sent * elem : g_empty, piece_out,
                      mpi_type(type), next, kRingTag, ctl_, &requests[1]),
            last_op_, "MPI_Isend");
      for (MPI_Request& q : requests) wait(&q, last_op_);
      sent += piece_out, got += piece_in;
    } while (sent < n_out || got < n_in);
  }

  // Before a collective: counts it and remembers what it is, for peers' queries.
  void start(CommOp op) {
    throw_if_broken(op);
    ++calls_;
    last_op_ = op;
    in_collective_ = 1;
  }
  void finish() { in_collective_ = 0; }

  [[noreturn]] void fail(const std::string& message, const std::string& summary) {
    failure_ = summary;
    in_collective_ = 0;
    mark_mpi_failed();
    throw Error(message);
  }

  void check(int rc, CommOp op, const char* call) {
    if (rc == MPI_SUCCESS) return;
    fail("error: " + where(op) + ": " + call + " failed: " + mpi_error_string(rc) +
             "\na peer may have died or the network failed; this communicator cannot be used any more.",
         where(op) + ": " + call + " failed: " + mpi_error_string(rc));
  }

  int to_int(CommOp op, const std::string& name, int64_t n) const {
    if (n <= INT_MAX) return static_cast<int>(n);
    throw Error("error: " + where(op) + ": " + name + " is " + std::to_string(n) +
                " elements, but MPI counts and offsets are ints (at most " + std::to_string(INT_MAX) +
                ").\nfix: split the call into pieces of at most " + std::to_string(INT_MAX) + " elements per rank.");
  }

  [[noreturn]] void size_mismatch(const Peer& who, int64_t got) {
    fail("error: " + where(CommOp::Recv) + ": rank " + std::to_string(who.rank) + " sent " +
             (got > who.n ? "more than " + std::to_string(who.n) : std::to_string(got)) + " " +
             comm_type_name(who.type) + " with tag " + std::to_string(who.tag) + " but this rank expected " +
             std::to_string(who.n) + " " + comm_type_name(who.type) +
             ".\nthe element count and type must agree on both sides of a send/recv pair.",
         where(CommOp::Recv) + " got a message of the wrong size from rank " + std::to_string(who.rank));
  }

  // Waits for `request`; `peer` is set for send and recv. Throws on an MPI
  // error or at the deadline, naming the missing ranks.
  MPI_Status wait(MPI_Request* request, CommOp op, const Peer* peer = nullptr) {
    MPI_Status status;
    int rc = poll(request, &status, deadline_after(timeout_s()), [&] { serve_control(); });
    if (rc == MPI_SUCCESS) return status;
    if (rc != -1) {
      int error_class = 0;
      MPI_Error_class(rc, &error_class);
      if (op == CommOp::Recv && error_class == MPI_ERR_TRUNCATE) size_mismatch(*peer, peer->n + 1);
      check(rc, op, "MPI_Test");
    }
    std::vector<int> missing;
    std::string detail;
    if (peer) {
      missing = {peer->rank};
      detail = op == CommOp::Send ? "rank " + std::to_string(peer->rank) + " did not receive the message with tag "
                                  : "no message with tag ";
      detail += std::to_string(peer->tag) + " (" + std::to_string(peer->n) + " " + comm_type_name(peer->type) + ")";
      detail += op == CommOp::Send ? "." : " came from rank " + std::to_string(peer->rank) + ".";
    } else {
      missing = find_missing(op, &detail);
      for (int p = 0; p < size(); ++p)
        if (p != rank()) post_control(p, {kGaveUp, calls_, static_cast<int64_t>(op), 0, 0});
    }
    fail(timeout_message(op, missing, detail), where(op) + " timed out after " + seconds_string(timeout_s()) +
                                                   " s waiting for " + rank_list(missing));
  }

  void post_control(int peer, const Control& message) {
    pending_.push_back(Pending{message, MPI_REQUEST_NULL});
    Pending& p = pending_.back();
    if (MPI_Isend(p.message.data(), static_cast<int>(p.message.size()), MPI_INT64_T, peer, kControlTag, ctl_,
                  &p.request) != MPI_SUCCESS)
      pending_.pop_back();  // best effort: the control channel only improves messages
  }

  // Answers queries, records replies and give-ups, forgets finished sends.
  void serve_control() {
    pending_.remove_if([](Pending& p) {
      int done = 0;
      return MPI_Test(&p.request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done;
    });
    for (;;) {
      int waiting = 0;
      MPI_Status status;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kControlTag, ctl_, &waiting, &status) != MPI_SUCCESS || !waiting) return;
      Control m{};
      if (MPI_Recv(m.data(), static_cast<int>(m.size()), MPI_INT64_T, status.MPI_SOURCE, kControlTag, ctl_,
                   MPI_STATUS_IGNORE) != MPI_SUCCESS)
        return;
      const size_t from = static_cast<size_t>(status.MPI_SOURCE);
      if (m[0] == kQuery)
        post_control(status.MPI_SOURCE, {kReply, m[1], calls_, static_cast<int64_t>(last_op_), in_collective_});
      else if (m[0] == kReply && m[1] == query_)
        replies_[from] = m;
      else if (m[0] == kGaveUp)
        gave_up_[from] = std::max(gave_up_[from], m[1]);
    }
  }

  // Asks every peer where it is (see the top of the file). Returns the ranks
  // that have not reached this collective; explains any out-of-step rank in
  // `detail`.
  std::vector<int> find_missing(CommOp op, std::string* detail) {
    ++query_;
    std::fill(replies_.begin(), replies_.end(), Control{});
    for (int p = 0; p < size(); ++p)
      if (p != rank()) post_control(p, {kQuery, query_, calls_, static_cast<int64_t>(op), 0});
    auto answered = [&] {
      for (int p = 0; p < size(); ++p)
        if (p != rank() && replies_[static_cast<size_t>(p)][0] != kReply) return false;
      return true;
    };
    const auto grace = deadline_after(std::min(1.0, timeout_s() / 4));
    while (!answered() && Clock::now() < grace) {
      serve_control();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    serve_control();

    const std::string here = std::string(comm_op_name(op)) + " (collective #" + std::to_string(calls_) + ")";
    std::vector<int> missing;
    std::string lines;
    for (int p = 0; p < size(); ++p) {
      const Control& r = replies_[static_cast<size_t>(p)];
      if (p == rank() || gave_up_[static_cast<size_t>(p)] >= calls_) continue;
      const std::string who = "rank " + std::to_string(p);
      if (r[0] != kReply) {
        missing.push_back(p);
      } else if (r[2] < calls_) {
        missing.push_back(p);
        const auto last = static_cast<CommOp>(r[3]);
        lines += "\n  " + who + " has not reached it: " +
                 (r[4] ? "it is still in its collective #" + std::to_string(r[2]) + " (" + comm_op_name(last) + ")"
                       : "it has started " + std::to_string(r[2]) + (r[2] == 1 ? " collective" : " collectives") +
                             " and is in none now");
      } else if (r[2] == calls_ && static_cast<CommOp>(r[3]) != op) {
        missing.push_back(p);
        lines += "\n  " + who + " called " + comm_op_name(static_cast<CommOp>(r[3])) +
                 " as its collective #" + std::to_string(r[2]) + ": the ranks' calls are out of step";
      }
    }
    *detail = "this rank is in " + here + "; no answer means dead, or busy outside the communicator." + lines;
    return missing;
  }

  MPI_Comm comm_, ctl_;
  int64_t calls_ = 0;  // collectives started on this rank
  CommOp last_op_ = CommOp::Barrier;
  int64_t in_collective_ = 0;  // 1 while inside collective calls_
  std::string failure_;        // the first failure, one line; empty while healthy
  int64_t query_ = 0;
  std::vector<Control> replies_;  // per peer, to query_
  std::vector<int64_t> gave_up_;  // per peer: the collective number it gave up on
  std::list<Pending> pending_;    // control sends in flight
  std::vector<int> send_counts_, send_offsets_, recv_counts_, recv_offsets_;
  std::vector<char> ring_staging_;  // one block of a ring collective, kept for the next
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s, int color) {
  ensure_mpi("make_mpi_communicator");
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (!(timeout_s > 0 && std::isfinite(timeout_s)))  // the base class words the error, and throws
    MpiCommunicator(rank, size, MPI_COMM_NULL, MPI_COMM_NULL, timeout_s);

  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%g", timeout_s);
  // Duplicating is collective: poll it too, so a rank that never arrives
  // cannot hang the others at startup.
  MPI_Comm comms[2] = {MPI_COMM_NULL, MPI_COMM_NULL};
  for (MPI_Comm& c : comms) {
    MPI_Request request;
    MPI_Status status;
    int rc = MPI_Comm_idup(MPI_COMM_WORLD, &c, &request);
    if (rc == MPI_SUCCESS) rc = poll(&request, &status, deadline_after(timeout_s), [] {});
    if (rc == -1) {
      mark_mpi_failed();
      throw Error("error: make_mpi_communicator on rank " + std::to_string(rank) + " of " + std::to_string(size) +
                  " timed out after " + seconds + 
                  " s waiting for a peer (dead or stuck?)\nevery rank must make its communicators in the same order.");
    }
    if (rc != MPI_SUCCESS)
      throw Error("error: make_mpi_communicator: MPI_Comm_idup failed: " + mpi_error_string(rc));
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
  }
  if (color >= 0) {
    // Every rank has just answered the duplication, so the blocking split
    // (MPI has no non-blocking one) waits on live peers only.
    for (MPI_Comm& c : comms) {
      MPI_Comm sub = MPI_COMM_NULL;
      int rc = MPI_Comm_split(c, color, rank, &sub);
      if (rc != MPI_SUCCESS) throw Error("error: make_mpi_communicator: MPI_Comm_split failed: " + mpi_error_string(rc));
      MPI_Comm_free(&c);
      c = sub;
      MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    }
    const int world_rank = rank;
    MPI_Comm_rank(comms[0], &rank);
    MPI_Comm_size(comms[0], &size);
    std::vector<int> world(static_cast<size_t>(size));
    MPI_Allgather(&world_rank, 1, MPI_INT, world.data(), 1, MPI_INT, comms[0]);  // members just answered the split
    auto group = std::make_unique<MpiCommunicator>(rank, size, comms[0], comms[1], timeout_s);
    group->set_world_ranks(std::move(world));
    return group;
  }
  return std::make_unique<MpiCommunicator>(rank, size, comms[0], comms[1], timeout_s);
}

}  // namespace halyard::runtime
