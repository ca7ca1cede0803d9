// The uneven all-to-all the communicator tests share (in-process, MPI, NCCL):
// rank `from` sends rank `to` uneven_count(from, to) elements (0..4, zeros
// included), the k-th being element(from, to, k), exact in f32 and i32.
#pragma once

#include <cstdint>
#include <vector>

namespace halyard::testing {

inline int64_t uneven_count(int from, int to) { return (from * 3 + to * 5 + 1) % 5; }
inline float element(int from, int to, int64_t k) { return static_cast<float>(from * 1000 + to * 100 + k); }

// Rank r's side of the exchange among n ranks.
struct UnevenExchange {
  std::vector<int64_t> send_counts, recv_counts;
  std::vector<float> send;
  int64_t bytes_to_others = 0;  // what all_to_all_bytes_sent() counts: not the block to itself

  UnevenExchange(int r, int n) : send_counts(static_cast<size_t>(n)), recv_counts(static_cast<size_t>(n)) {
    for (int p = 0; p < n; ++p) {
      send_counts[static_cast<size_t>(p)] = uneven_count(r, p);
      recv_counts[static_cast<size_t>(p)] = uneven_count(p, r);
      for (int64_t k = 0; k < uneven_count(r, p); ++k) send.push_back(element(r, p, k));
      if (p != r) bytes_to_others += uneven_count(r, p) * static_cast<int64_t>(sizeof(float));
    }
  }
};

}  // namespace halyard::testing
