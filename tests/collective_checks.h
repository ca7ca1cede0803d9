// The step's collectives as plans (runtime/collectives.h) against their
// layouts written out index by index, on whatever ranks and memory a test
// gives them: test_collectives runs them on host memory over in-process
// ranks, test_cuda_sim on (simulated) device memory over NCCL, as a
// CUDA model runs them (runtime/collectives_cuda.cpp).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/collectives.h"
#include "runtime/comm.h"
#include "tests/buffer_spec.h"
#include "tests/in_process_ranks.h"

namespace halyard::testing::collective_checks {

using runtime::BufferSpec;
using runtime::CallKind;
using runtime::CollectiveMemory;
using runtime::Communicator;
using runtime::ElemType;

// Runs fn on p ranks, each with its communicator and a memory of its own,
// and returns what each threw once every rank's collectives have finished
// writing (results are read after it returns).
using Ranks = std::function<std::vector<std::string>(int p, const std::function<void(Communicator&, CollectiveMemory&)>&)>;

inline BufferSpec spec(const char* name, ElemType type, const std::vector<int64_t>& shape) {
  return buffer_spec(name, type, shape);
}

// A value no two (rank, element) pairs share, exact in f32.
inline float value(int rank, int64_t i) { return static_cast<float>(rank * 100000 + i) * 0.25f; }

struct Case {
  int ranks;
  int64_t batch, heads;
};

// seq_to_heads, then heads_to_seq of what came out: each against its layout.
inline void check_ulysses(const Ranks& run, const Case& c) {
  const int p = c.ranks;
  const int64_t b = c.batch, sl = 3, h = c.heads, d = 2;
  const int64_t hr = h % p == 0 ? h / p : 1;
  const BufferSpec x = spec("x", ElemType::F32, {b, sl, h, d});
  const BufferSpec y = spec("y", ElemType::F32, {b, sl * p, hr, d});
  auto first_head = [&](int r) { return hr * p == h ? r * hr : r * h / p; };
  std::vector<std::vector<float>> ins(static_cast<size_t>(p)), ys(static_cast<size_t>(p)), back(static_cast<size_t>(p));
  expect_no_errors(run(p, [&](Communicator& comm, CollectiveMemory& memory) {
    const int r = comm.rank();
    auto& in = ins[static_cast<size_t>(r)];
    in.resize(static_cast<size_t>(b * sl * h * d));
    for (size_t i = 0; i < in.size(); ++i) in[i] = value(r, static_cast<int64_t>(i));
    auto& out = ys[static_cast<size_t>(r)];
    out.assign(static_cast<size_t>(b * sl * p * hr * d), -1.f);
    run_collective(CallKind::SeqToHeads, x, in.data(), y, out.data(), comm, memory);
    auto& x_again = back[static_cast<size_t>(r)];
    x_again.assign(in.size(), -1.f);
    run_collective(CallKind::HeadsToSeq, y, out.data(), x, x_again.data(), comm, memory);
  }));
  const std::string what = std::to_string(p) + " ranks, batch " + std::to_string(b) + ", " + std::to_string(h) + " heads";
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < b; ++i)
      for (int q = 0; q < p; ++q)
        for (int64_t t = 0; t < sl; ++t)
          for (int64_t j = 0; j < hr; ++j)
            for (int64_t k = 0; k < d; ++k) {
              const float got = ys[static_cast<size_t>(r)][static_cast<size_t>((((i * sl * p) + q * sl + t) * hr + j) * d + k)];
              const float want = value(q, ((i * sl + t) * h + first_head(r) + j) * d + k);
              ASSERT_EQ(got, want) << what << ": seq_to_heads: rank " << r << " row " << i << " from rank " << q
                                   << " token " << t << " head " << j << " element " << k;
            }
  // Back: every replica of a head brings the same values, so a head held by
  // n ranks comes back n times its value.
  const int64_t replicas = hr * p == h ? 1 : p / h;
  for (int r = 0; r < p; ++r)
    for (int64_t e = 0; e < b * sl * h * d; ++e)
      ASSERT_EQ(back[static_cast<size_t>(r)][static_cast<size_t>(e)], static_cast<float>(replicas) * value(r, e))
          << what << ": heads_to_seq: rank " << r << " element " << e;
}

// Three seq_to_heads in flight together (q's, k's and v's, each in a
// staging slot of its own) with a gather of positions run whole between
// them in a fourth, and finished out of their start order, k's slot taken
// again by a fourth all-to-all once k's is finished: each lands where the
// layout says at its finish. Ranks start at different times, so that on a
// device a plan staged where another's transfer still reads, or copied out
// before its transfer ended, would show.
inline void all_to_alls_in_flight_together_each_land_at_their_finish(const Ranks& run) {
  using runtime::finish_plan;
  using runtime::plan_collective;
  using runtime::start_plan;
  for (const Case& c : {Case{2, 2, 4}, Case{4, 1, 8}, Case{4, 2, 2}}) {
    const int p = c.ranks;
    const int64_t b = c.batch, sl = 3, h = c.heads, d = 2;
    const int64_t hr = h % p == 0 ? h / p : 1;
    const BufferSpec x = spec("x", ElemType::F32, {b, sl, h, d});
    const BufferSpec y = spec("y", ElemType::F32, {b, sl * p, hr, d});
    const BufferSpec pos = spec("pos", ElemType::I32, {b, sl});
    const BufferSpec pos_all = spec("pos_all", ElemType::I32, {b, sl * p});
    constexpr int kValues = 4;  // q, k, v, and one more into k's slot
    auto input = [](int r, int v, int64_t i) { return value(r, i) + 1e6f * static_cast<float>(v); };
    std::vector<std::vector<std::vector<float>>> ys(static_cast<size_t>(p));
    std::vector<std::vector<int32_t>> gathered(static_cast<size_t>(p));
    expect_no_errors(run(p, [&](Communicator& comm, CollectiveMemory& memory) {
      const int r = comm.rank();
      std::this_thread::sleep_for(std::chrono::milliseconds(15 * r));
      std::vector<std::vector<float>> ins(kValues, std::vector<float>(static_cast<size_t>(b * sl * h * d)));
      for (int v = 0; v < kValues; ++v)
        for (size_t i = 0; i < ins[static_cast<size_t>(v)].size(); ++i)
          ins[static_cast<size_t>(v)][i] = input(r, v, static_cast<int64_t>(i));
      auto& outs = ys[static_cast<size_t>(r)];
      outs.assign(kValues, std::vector<float>(static_cast<size_t>(b * sl * p * hr * d), -1.f));
      auto start = [&](int v, int slot) {
        return start_plan(plan_collective(CallKind::SeqToHeads, x, y, comm.size(), comm.backend()),
                          ins[static_cast<size_t>(v)].data(), outs[static_cast<size_t>(v)].data(), &comm, memory, slot);
      };
      auto q = start(0, 0), k = start(1, 1), v = start(2, 2);
      std::vector<int32_t> mine(static_cast<size_t>(b * sl));
      for (size_t i = 0; i < mine.size(); ++i) mine[i] = r * 1000 + static_cast<int32_t>(i);
      gathered[static_cast<size_t>(r)].assign(static_cast<size_t>(b * sl * p), -1);
      auto g = start_plan(plan_collective(CallKind::GatherSeq, pos, pos_all, comm.size(), comm.backend()), mine.data(),
                          gathered[static_cast<size_t>(r)].data(), &comm, memory, 3);
      finish_plan(g, memory);
      finish_plan(k, memory);
      auto again = start(3, 1);
      finish_plan(q, memory);
      finish_plan(v, memory);
      finish_plan(again, memory);
      memory.settle();  // (every transfer done, so the copies of `ins` and `mine` too)
    }));
    const std::string what = std::to_string(p) + " ranks, batch " + std::to_string(b) + ", " + std::to_string(h) + " heads";
    auto first_head = [&](int r) { return hr * p == h ? r * hr : r * h / p; };
    for (int r = 0; r < p; ++r)
      for (int v = 0; v < kValues; ++v)
        for (int64_t i = 0; i < b; ++i)
          for (int q = 0; q < p; ++q)
            for (int64_t t = 0; t < sl; ++t)
              for (int64_t j = 0; j < hr * d; ++j) {
                const float got = ys[static_cast<size_t>(r)][static_cast<size_t>(v)]
                                    [static_cast<size_t>(((i * sl * p) + q * sl + t) * hr * d + j)];
                ASSERT_EQ(got, input(q, v, (i * sl + t) * h * d + first_head(r) * d + j))
                    << what << ": all-to-all " << v << ": rank " << r << " row " << i << " from rank " << q << " token " << t;
              }
    for (int r = 0; r < p; ++r)
      for (int64_t i = 0; i < b; ++i)
        for (int q = 0; q < p; ++q)
          for (int64_t t = 0; t < sl; ++t)
            ASSERT_EQ(gathered[static_cast<size_t>(r)][static_cast<size_t>(i * sl * p + q * sl + t)], q * 1000 + i * sl + t)
                << what << ": gather";
  }
}

inline void ulysses_all_to_alls_move_heads_and_tokens_where_the_layout_says(const Ranks& run) {
  for (const Case& c : {Case{2, 1, 4}, Case{2, 2, 4}, Case{4, 1, 8}, Case{4, 2, 4}}) check_ulysses(run, c);
}

inline void kv_heads_fewer_than_ranks_are_replicated_and_summed_back(const Ranks& run) {
  for (const Case& c : {Case{4, 1, 2}, Case{4, 2, 2}, Case{4, 2, 1}, Case{2, 2, 1}}) check_ulysses(run, c);
}

inline void gather_of_positions_puts_each_ranks_tokens_in_its_place(const Ranks& run) {
  for (int p : {2, 4})
    for (int64_t b : {1, 2}) {
      const int64_t sl = 5;
      const BufferSpec in = spec("pos", ElemType::I32, {b, sl});
      const BufferSpec out = spec("pos_all", ElemType::I32, {b, sl * p});
      std::vector<std::vector<int32_t>> mine(static_cast<size_t>(p)), got(static_cast<size_t>(p));
      expect_no_errors(run(p, [&](Communicator& comm, CollectiveMemory& memory) {
        auto& m = mine[static_cast<size_t>(comm.rank())];
        m.resize(static_cast<size_t>(b * sl));
        for (size_t i = 0; i < m.size(); ++i) m[i] = comm.rank() * 1000 + static_cast<int32_t>(i);
        got[static_cast<size_t>(comm.rank())].assign(static_cast<size_t>(b * sl * p), -1);
        run_collective(CallKind::GatherSeq, in, m.data(), out, got[static_cast<size_t>(comm.rank())].data(), comm,
                       memory);
      }));
      for (int r = 0; r < p; ++r)
        for (int64_t i = 0; i < b; ++i)
          for (int q = 0; q < p; ++q)
            for (int64_t t = 0; t < sl; ++t)
              ASSERT_EQ(got[static_cast<size_t>(r)][static_cast<size_t>(i * sl * p + q * sl + t)], q * 1000 + i * sl + t)
                  << p << " ranks, batch " << b;
    }
}

inline void sum_over_ranks_in_place_or_into_another_buffer(const Ranks& run) {
  const BufferSpec f = spec("loss", ElemType::F32, {3});
  const BufferSpec g = spec("count", ElemType::F64, {2});
  std::vector<std::vector<float>> ins(4), outs(4);
  std::vector<std::vector<double>> same(4);
  expect_no_errors(run(4, [&](Communicator& comm, CollectiveMemory& memory) {
    const size_t r = static_cast<size_t>(comm.rank());
    const float x = static_cast<float>(r);
    ins[r] = {x, 2 * x, 1.f};
    outs[r].assign(3, -1.f);
    run_collective(CallKind::AllReduce, f, ins[r].data(), f, outs[r].data(), comm, memory);
    same[r] = {0.5, static_cast<double>(r)};
    run_collective(CallKind::AllReduce, g, same[r].data(), g, same[r].data(), comm, memory);
  }));
  for (size_t r = 0; r < 4; ++r) {
    const float x = static_cast<float>(r);
    EXPECT_EQ(outs[r], (std::vector<float>{6.f, 12.f, 4.f})) << "rank " << r;
    EXPECT_EQ(ins[r], (std::vector<float>{x, 2 * x, 1.f})) << "rank " << r << ": the input is left alone";
    EXPECT_EQ(same[r], (std::vector<double>{2.0, 6.0})) << "rank " << r;
  }
}

}  // namespace halyard::testing::collective_checks

// The checks as the tests of `suite`, on the ranks `run` (a Ranks) gives.
#define HALYARD_COLLECTIVE_CHECKS(suite, run)                                                               \
  TEST(suite, UlyssesAllToAllsMoveHeadsAndTokensWhereTheLayoutSays) {                                      \
    halyard::testing::collective_checks::ulysses_all_to_alls_move_heads_and_tokens_where_the_layout_says(run); \
  }                                                                                                          \
  TEST(suite, KvHeadsFewerThanRanksAreReplicatedAndSummedBack) {                                           \
    halyard::testing::collective_checks::kv_heads_fewer_than_ranks_are_replicated_and_summed_back(run);     \
  }                                                                                                          \
  TEST(suite, GatherOfPositionsPutsEachRanksTokensInItsPlace) {                                            \
    halyard::testing::collective_checks::gather_of_positions_puts_each_ranks_tokens_in_its_place(run);      \
  }                                                                                                          \
  TEST(suite, SumOverRanksInPlaceOrIntoAnotherBuffer) {                                                    \
    halyard::testing::collective_checks::sum_over_ranks_in_place_or_into_another_buffer(run);               \
  }                                                                                                          \
  TEST(suite, AllToAllsInFlightTogetherEachLandAtTheirFinish) {                                             \
    halyard::testing::collective_checks::all_to_alls_in_flight_together_each_land_at_their_finish(run);     \
  }
