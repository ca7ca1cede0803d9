// The in-process group: N ranks as threads of one process.
//
// The group is one shared state under one mutex. A collective is a rendezvous:
// each rank posts its arguments (buffer pointers and counts) and waits until all
// ranks have posted; then every rank checks that the posts agree (same
// operation, same element type, matching sizes), pulls the data it is owed
// straight from its peers' buffers, and waits until all ranks have finished
// pulling, so that no buffer is reused while a peer still reads it. The last
// rank to finish resets the state for the next collective. Point-to-point sends
// are buffered: the data is copied into a mailbox keyed by (from, to, tag).
//
// Every wait is a condition-variable wait_until the caller's deadline. A rank
// that times out records the failure in the group and wakes everyone: the
// peers blocked with it fail at once naming the same missing ranks, and any
// later call on any rank throws quoting the first failure.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "runtime/comm.h"
#include "runtime/error.h"

namespace halyard::runtime {

// ---------------------------------------------------------------------------
// The in-process group.

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// One rank's arguments to the collective in progress.
struct Post {
  CommOp op = CommOp::Barrier;
  CommType type = CommType::F32;
  const void* send = nullptr;
  void* recv = nullptr;  // all_reduce_sum: the data, reduced in place
  const int64_t* send_counts = nullptr;
  const int64_t* recv_counts = nullptr;
  int64_t n = 0;  // all_reduce_sum: elements; all_gather, reduce_scatter_sum: per rank
};

struct Message {
  CommType type;
  int64_t n;
  std::vector<uint8_t> bytes;
};

struct InProcessGroup {
  explicit InProcessGroup(int n) : size(n), posts(static_cast<size_t>(n)), posted(static_cast<size_t>(n), 0) {}

  const int size;
  std::mutex mutex;
  std::condition_variable changed;

  // The collective in progress: `generation` counts completed collectives.
  uint64_t generation = 0;
  int arrived = 0, finished = 0;
  bool all_arrived = false;
  std::vector<Post> posts;
  std::vector<char> posted;  // posts[r] belongs to this generation

  std::map<std::tuple<int, int, int>, std::deque<Message>> mailboxes;  // (from, to, tag)
  // Subgroups made by split(): (which split of this group, color) -> the subgroup.
  std::map<std::pair<uint64_t, int>, std::shared_ptr<InProcessGroup>> splits;

  // The first failure, one line ("all_to_all_v on rank 0 of 4 timed out ...");
  // empty while the group is healthy.
  std::string failure;
  // Set when the ranks' posts to one collective disagree: what is wrong.
  std::string mismatch;
};

// acc[0..n) = sum over ranks, in rank order, of src(p)[0..n).
void sum_over_ranks(CommType type, void* acc, int64_t n, int size, const std::function<const void*(int)>& src) {
  std::memcpy(acc, src(0), static_cast<size_t>(n * comm_type_size(type)));
  for (int p = 1; p < size; ++p) comm_sum_into(type, acc, src(p), n);
}

const uint8_t* bytes_at(const void* p, int64_t elements, CommType type) {
  return static_cast<const uint8_t*>(p) + elements * comm_type_size(type);
}

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessGroup> group, int rank, double timeout_s)
      : Communicator(rank, group->size, timeout_s), g_(std::move(group)) {}
  uint64_t splits_ = 0;  // split() calls so far: the same count on every rank

  const char* backend() const override { return "in-process"; }

 protected:
  void do_all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                       CommType type) override {
    Post post{CommOp::AllToAllV, type, send, recv, send_counts, recv_counts, 0};
    collective(post, [&](const std::vector<Post>& posts) {
      int64_t at = 0;  // where the block from rank p lands in recv
      for (int p = 0; p < size(); ++p) {
        const Post& from = posts[static_cast<size_t>(p)];
        int64_t offset = 0;  // of the block for this rank in p's send
        for (int q = 0; q < rank(); ++q) offset += from.send_counts[q];
        int64_t count = recv_counts[p];
        if (count > 0)
          std::memcpy(static_cast<uint8_t*>(recv) + at * comm_type_size(type), bytes_at(from.send, offset, type),
                      static_cast<size_t>(count * comm_type_size(type)));
        at += count;
      }
    });
  }

  // Rank r sums slice r of the elements over all ranks and writes the sum into
  // every rank's buffer: only rank r touches slice r, so it works in place.
  void do_all_reduce_sum(void* data, int64_t n, CommType type) override {
    Post post{CommOp::AllReduceSum, type, nullptr, data, nullptr, nullptr, n};
    collective(post, [&](const std::vector<Post>& posts) {
      int64_t lo = n * rank() / size(), hi = n * (rank() + 1) / size();
      if (hi == lo) return;
      int64_t elem = comm_type_size(type);
      std::vector<uint8_t> acc(static_cast<size_t>((hi - lo) * elem));
      sum_over_ranks(type, acc.data(), hi - lo, size(),
                     [&](int p) { return bytes_at(posts[static_cast<size_t>(p)].recv, lo, type); });
      for (const Post& to : posts)
        std::memcpy(static_cast<uint8_t*>(to.recv) + lo * elem, acc.data(), acc.size());
    });
  }

  void do_all_gather(const void* send, int64_t n, void* recv, CommType type) override {
    Post post{CommOp::AllGather, type, send, recv, nullptr, nullptr, n};
    collective(post, [&](const std::vector<Post>& posts) {
      if (n == 0) return;
      int64_t elem = comm_type_size(type);
      for (int p = 0; p < size(); ++p)
        std::memcpy(static_cast<uint8_t*>(recv) + p * n * elem, posts[static_cast<size_t>(p)].send,
                    static_cast<size_t>(n * elem));
    });
  }

  void do_reduce_scatter_sum(const void* send, void* recv, int64_t n_per_rank, CommType type) override {
    Post post{CommOp::ReduceScatterSum, type, send, recv, nullptr, nullptr, n_per_rank};
    collective(post, [&](const std::vector<Post>& posts) {
      if (n_per_rank == 0) return;
      sum_over_ranks(type, recv, n_per_rank, size(), [&](int p) {
        return bytes_at(posts[static_cast<size_t>(p)].send, rank() * n_per_rank, type);
      });
    });
  }

  void do_barrier() override {
    collective(Post{}, [](const std::vector<Post>&) {});
  }

  void do_send(const void* data, int64_t n, int peer, int tag, CommType type) override {
    std::unique_lock<std::mutex> lock(g_->mutex);
    throw_if_broken(CommOp::Send);
    const uint8_t* bytes = static_cast<const uint8_t*>(data);
    Message m{type, n, std::vector<uint8_t>(bytes, bytes + n * comm_type_size(type))};
    g_->mailboxes[{rank(), peer, tag}].push_back(std::move(m));
    g_->changed.notify_all();
  }

  // Every rank learns every (color, key) through an all_gather (with its
  // timeout); the first member of a color to get here makes the subgroup.
  std::unique_ptr<Communicator> do_split(int color, int key) override {
    const int32_t mine[2] = {color, key};
    std::vector<int32_t> all(static_cast<size_t>(2 * size()));
    all_gather(mine, 2, all.data());
    std::vector<std::pair<int, int>> members;  // (key, rank) of this color
    for (int p = 0; p < size(); ++p)
      if (all[static_cast<size_t>(2 * p)] == color) members.push_back({all[static_cast<size_t>(2 * p + 1)], p});
    std::sort(members.begin(), members.end());
    const int sub_rank = static_cast<int>(std::find(members.begin(), members.end(), std::pair{key, rank()}) - members.begin());
    std::shared_ptr<InProcessGroup> sub;
    {
      std::lock_guard<std::mutex> lock(g_->mutex);
      auto& slot = g_->splits[{splits_, color}];
      if (!slot) slot = std::make_shared<InProcessGroup>(static_cast<int>(members.size()));
      sub = slot;
    }
    ++splits_;
    return std::make_unique<InProcessCommunicator>(sub, sub_rank, timeout_s());
  }

  // The send is buffered (its mailbox copy), so it goes at once; wait() receives.
  std::unique_ptr<Exchange> do_start_exchange(const void* send, void* recv, int64_t n, int to, int from, int tag,
                                              CommType type) override {
    do_send(send, n, to, tag, type);
    struct Receive final : Exchange {
      std::function<void()> finish;
      void wait() override {
        if (finish) std::exchange(finish, nullptr)();
      }
    };
    auto e = std::make_unique<Receive>();
    e->finish = [=, this] { do_recv(recv, n, from, tag, type); };
    return e;
  }

  void do_recv(void* data, int64_t n, int peer, int tag, CommType type) override {
    std::unique_lock<std::mutex> lock(g_->mutex);
    throw_if_broken(CommOp::Recv);
    std::deque<Message>& box = g_->mailboxes[{peer, rank(), tag}];
    bool ready = g_->changed.wait_until(lock, deadline_after(timeout_s()),
                                        [&] { return !box.empty() || !g_->failure.empty(); });
    throw_if_broken(CommOp::Recv);
    if (!ready)
      fail(timeout_message(CommOp::Recv, {peer},
                           "no message with tag " + std::to_string(tag) + " (" + std::to_string(n) + " " +
                               comm_type_name(type) + ") came from rank " + std::to_string(peer) + "."),
           where(CommOp::Recv) + " timed out waiting for rank " + std::to_string(peer));
    Message m = std::move(box.front());
    box.pop_front();
    if (m.type != type || m.n != n)
      fail("error: " + where(CommOp::Recv) + ": rank " + std::to_string(peer) + " sent " + std::to_string(m.n) + " " +
               comm_type_name(m.type) + " with tag " + std::to_string(tag) + " but this rank expected " +
               std::to_string(n) + " " + comm_type_name(type) +
               ".\nthe element count and type must agree on both sides of a send/recv pair.",
           where(CommOp::Recv) + " got a message of the wrong size from rank " + std::to_string(peer));
    if (!m.bytes.empty()) std::memcpy(data, m.bytes.data(), m.bytes.size());
  }

 private:
  // Throws if the group failed earlier. Call with the mutex held.
  void throw_if_broken(CommOp op) const {
    if (g_->failure.empty()) return;
    throw Error("error: " + where(op) + ": the communicator is broken by an earlier failure:\n  " + g_->failure +
                "\na failed call cannot be undone; report it and exit (then restart from the last checkpoint).");
  }

  // Records the first failure, wakes every waiting rank, throws `message`.
  [[noreturn]] void fail(const std::string& message, const std::string& summary) {
    if (g_->failure.empty()) g_->failure = summary;
    g_->changed.notify_all();
    throw Error(message);
  }

  std::vector<int> missing() const {
    std::vector<int> m;
    for (int p = 0; p < size(); ++p)
      if (!g_->posted[static_cast<size_t>(p)]) m.push_back(p);
    return m;
  }

  // Empty when the posts agree; otherwise what is wrong, in words that hold
  // for every rank (each prefixes its own "error: <op> on rank r of n: ").
  std::string disagreement(const std::vector<Post>& posts) const {
    const Post& mine = posts[static_cast<size_t>(rank())];
    auto list = [&](const std::function<std::string(const Post&)>& what) {
      std::string s;
      for (int p = 0; p < size(); ++p)
        s += "\n  rank " + std::to_string(p) + ": " + what(posts[static_cast<size_t>(p)]);
      return s;
    };
    for (const Post& p : posts)
      if (p.op != mine.op)
        return "the ranks called different collectives at the same point:" +
               list([](const Post& q) { return std::string(comm_op_name(q.op)); }) +
               "\nevery rank must call the same collectives in the same order.";
    for (const Post& p : posts)
      if (p.type != mine.type)
        return "the ranks passed different element types:" +
               list([](const Post& q) { return std::string(comm_type_name(q.type)); }) +
               "\nevery rank must pass the same element type.";
    if (mine.op == CommOp::AllToAllV) {
      for (int p = 0; p < size(); ++p)
        for (int q = 0; q < size(); ++q) {
          int64_t sent = posts[static_cast<size_t>(p)].send_counts[q];
          int64_t expected = posts[static_cast<size_t>(q)].recv_counts[p];
          if (sent != expected)
            return "rank " + std::to_string(p) + " sends " + std::to_string(sent) +
                   " elements to rank " + std::to_string(q) + " (its send_counts[" + std::to_string(q) +
                   "]) but rank " + std::to_string(q) + " expects " + std::to_string(expected) + " from rank " +
                   std::to_string(p) + " (its recv_counts[" + std::to_string(p) + "]).\nrecv_counts[p] on rank q " +
                   "must equal send_counts[q] on rank p.";
        }
    } else if (mine.op != CommOp::Barrier) {
      for (const Post& p : posts)
        if (p.n != mine.n)
          return "the ranks passed different sizes:" +
                 list([](const Post& q) { return std::to_string(q.n) + " elements"; }) +
                 "\nevery rank must pass the same size.";
    }
    return "";
  }

  // The rendezvous described at the top of the file. `move` runs once all
  // ranks have posted and their posts agree; it reads the peers' posts.
  void collective(const Post& post, const std::function<void(const std::vector<Post>&)>& move) {
    std::unique_lock<std::mutex> lock(g_->mutex);
    throw_if_broken(post.op);
    const uint64_t generation = g_->generation;
    g_->posts[static_cast<size_t>(rank())] = post;
    g_->posted[static_cast<size_t>(rank())] = 1;
    if (++g_->arrived == size()) {
      g_->all_arrived = true;
      g_->changed.notify_all();
    }
    auto deadline = deadline_after(timeout_s());
    bool ready = g_->changed.wait_until(lock, deadline, [&] { return g_->all_arrived || !g_->failure.empty(); });
    if (!g_->all_arrived) {
      std::vector<int> absent = missing();
      if (ready)  // woken by a peer's failure
        throw Error("error: " + where(post.op) + " gave up waiting for " + rank_list(absent) +
                    " (dead or stuck?): the group broke when\n  " + g_->failure +
                    "\na failed call cannot be undone; report it and exit (then restart from the last checkpoint).");
      fail(timeout_message(post.op, absent, ""),
           where(post.op) + " timed out after " + seconds_string(timeout_s()) + " s waiting for " + rank_list(absent));
    }
    // The first rank to check finds any disagreement and records it; the
    // others must not read the posts then (their owners may have left).
    if (g_->failure.empty()) g_->mismatch = disagreement(g_->posts);
    if (!g_->mismatch.empty())
      fail("error: " + where(post.op) + ": " + g_->mismatch,
           comm_op_name(post.op) + std::string(" found that the ranks' calls disagree"));
    throw_if_broken(post.op);

    lock.unlock();
    move(g_->posts);
    lock.lock();

    if (++g_->finished == size()) {
      g_->arrived = g_->finished = 0;
      g_->all_arrived = false;
      std::fill(g_->posted.begin(), g_->posted.end(), 0);
      ++g_->generation;
      g_->changed.notify_all();
      return;
    }
    if (!g_->changed.wait_until(lock, deadline_after(timeout_s()), [&] { return g_->generation != generation; }))
      fail(timeout_message(post.op, {}, "every rank arrived, but not all finished copying their data."),
           where(post.op) + " timed out waiting for peers to finish copying");
  }

  std::shared_ptr<InProcessGroup> g_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_in_process_group(int n, double timeout_s) {
  if (n < 1)
    throw Error("error: in-process group of " + std::to_string(n) + " ranks\na group needs at least 1 rank.");
  auto group = std::make_shared<InProcessGroup>(n);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < n; ++r) comms.push_back(std::make_unique<InProcessCommunicator>(group, r, timeout_s));
  return comms;
}

}  // namespace halyard::runtime
