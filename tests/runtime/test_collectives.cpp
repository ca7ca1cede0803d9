// The collectives of a step program as plans (runtime/collectives.h), run on
// host memory over 1, 2 and 4 in-process ranks, against their layouts
// written out index by index: Ulysses' all-to-alls both ways (heads split
// over the ranks, and kv heads fewer than the ranks, replicated there and
// summed on the way back), the gather of token positions, and the sum over
// ranks; batch 1 (messages landing in place) and batch 2 (rows through the
// staging area). A CUDA model over NCCL runs the same plans on its device
// memory (runtime/collectives_cuda.cpp), so these are its layouts too.
#include "runtime/collectives.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "tests/buffer_spec.h"
#include "tests/in_process_ranks.h"
#include "tests/runtime_error_of.h"

namespace halyard::runtime {
namespace {

using halyard::testing::error_of;
using halyard::testing::expect_no_errors;
using halyard::testing::run_ranks;
using ::testing::HasSubstr;

BufferSpec spec(const char* name, ElemType type, const std::vector<int64_t>& shape) {
  return halyard::testing::buffer_spec(name, type, shape);
}

// A value no two (rank, element) pairs share, exact in f32.
float value(int rank, int64_t i) { return static_cast<float>(rank * 100000 + i) * 0.25f; }

struct Case {
  int ranks;
  int64_t batch, heads;
};

// seq_to_heads, then heads_to_seq of what came out: each against its layout.
void check_ulysses(const Case& c) {
  const int p = c.ranks;
  const int64_t b = c.batch, sl = 3, h = c.heads, d = 2;
  const int64_t hr = h % p == 0 ? h / p : 1;
  const BufferSpec x = spec("x", ElemType::F32, {b, sl, h, d});
  const BufferSpec y = spec("y", ElemType::F32, {b, sl * p, hr, d});
  auto first_head = [&](int r) { return hr * p == h ? r * hr : r * h / p; };
  std::vector<std::vector<float>> ys(static_cast<size_t>(p)), back(static_cast<size_t>(p));
  expect_no_errors(run_ranks(p, 10, [&](Communicator& comm) {
    const int r = comm.rank();
    std::vector<float> in(static_cast<size_t>(b * sl * h * d));
    for (size_t i = 0; i < in.size(); ++i) in[i] = value(r, static_cast<int64_t>(i));
    HostCollectiveMemory memory;
    auto& out = ys[static_cast<size_t>(r)];
    out.assign(static_cast<size_t>(b * sl * p * hr * d), -1.f);
    run_collective(CallKind::SeqToHeads, x, in.data(), y, out.data(), comm, memory);
    auto& x_again = back[static_cast<size_t>(r)];
    x_again.assign(in.size(), -1.f);
    run_collective(CallKind::HeadsToSeq, y, out.data(), x, x_again.data(), comm, memory);
  }));
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < b; ++i)
      for (int q = 0; q < p; ++q)
        for (int64_t t = 0; t < sl; ++t)
          for (int64_t j = 0; j < hr; ++j)
            for (int64_t k = 0; k < d; ++k) {
              const float got = ys[static_cast<size_t>(r)][static_cast<size_t>((((i * sl * p) + q * sl + t) * hr + j) * d + k)];
              const float want = value(q, ((i * sl + t) * h + first_head(r) + j) * d + k);
              ASSERT_EQ(got, want) << "seq_to_heads: rank " << r << " row " << i << " from rank " << q << " token " << t
                                   << " head " << j << " element " << k;
            }
  // Back: every replica of a head brings the same values, so a head held by
  // n ranks comes back n times its value.
  const int64_t replicas = hr * p == h ? 1 : p / h;
  for (int r = 0; r < p; ++r)
    for (int64_t e = 0; e < b * sl * h * d; ++e)
      ASSERT_EQ(back[static_cast<size_t>(r)][static_cast<size_t>(e)], static_cast<float>(replicas) * value(r, e))
          << "heads_to_seq: rank " << r << " element " << e;
}

TEST(Collectives, UlyssesAllToAllsMoveHeadsAndTokensWhereTheLayoutSays) {
  for (const Case& c : {Case{2, 1, 4}, Case{2, 2, 4}, Case{4, 1, 8}, Case{4, 2, 4}})
    check_ulysses(c);
}

TEST(Collectives, KvHeadsFewerThanRanksAreReplicatedAndSummedBack) {
  for (const Case& c : {Case{4, 1, 2}, Case{4, 2, 2}, Case{4, 2, 1}, Case{2, 2, 1}})
    check_ulysses(c);
}

TEST(Collectives, GatherOfPositionsPutsEachRanksTokensInItsPlace) {
  for (int p : {2, 4})
    for (int64_t b : {1, 2}) {
      const int64_t sl = 5;
      const BufferSpec in = spec("pos", ElemType::I32, {b, sl});
      const BufferSpec out = spec("pos_all", ElemType::I32, {b, sl * p});
      std::vector<std::vector<int32_t>> got(static_cast<size_t>(p));
      expect_no_errors(run_ranks(p, 10, [&](Communicator& comm) {
        std::vector<int32_t> mine(static_cast<size_t>(b * sl));
        for (size_t i = 0; i < mine.size(); ++i) mine[i] = comm.rank() * 1000 + static_cast<int32_t>(i);
        HostCollectiveMemory memory;
        got[static_cast<size_t>(comm.rank())].assign(static_cast<size_t>(b * sl * p), -1);
        run_collective(CallKind::GatherSeq, in, mine.data(), out, got[static_cast<size_t>(comm.rank())].data(), comm, memory);
      }));
      for (int r = 0; r < p; ++r)
        for (int64_t i = 0; i < b; ++i)
          for (int q = 0; q < p; ++q)
            for (int64_t t = 0; t < sl; ++t)
              ASSERT_EQ(got[static_cast<size_t>(r)][static_cast<size_t>(i * sl * p + q * sl + t)], q * 1000 + i * sl + t)
                  << p << " ranks, batch " << b;
    }
}

TEST(Collectives, SumOverRanksInPlaceOrIntoAnotherBuffer) {
  const BufferSpec f = spec("loss", ElemType::F32, {3});
  const BufferSpec g = spec("count", ElemType::F64, {2});
  expect_no_errors(run_ranks(4, 10, [&](Communicator& comm) {
    HostCollectiveMemory memory;
    const float r = static_cast<float>(comm.rank());
    std::vector<float> in = {r, 2 * r, 1.f}, out(3, -1.f);
    run_collective(CallKind::AllReduce, f, in.data(), f, out.data(), comm, memory);
    EXPECT_EQ(out, (std::vector<float>{6.f, 12.f, 4.f}));
    EXPECT_EQ(in, (std::vector<float>{r, 2 * r, 1.f}));  // (the input is left alone)
    std::vector<double> same = {0.5, static_cast<double>(comm.rank())};
    run_collective(CallKind::AllReduce, g, same.data(), g, same.data(), comm, memory);
    EXPECT_EQ(same, (std::vector<double>{2.0, 6.0}));
  }));
}

// One rank without a communicator: what it would send itself.
TEST(Collectives, OneRankWithoutACommunicatorCopies) {
  const BufferSpec x = spec("x", ElemType::F32, {2, 3, 4, 2});
  HostCollectiveMemory memory;
  std::vector<float> in(48), out(48, -1.f);
  for (size_t i = 0; i < in.size(); ++i) in[i] = value(0, static_cast<int64_t>(i));
  run_plan(plan_collective(CallKind::SeqToHeads, x, x, 1, "one rank"), in.data(), out.data(), nullptr, memory);
  EXPECT_EQ(out, in);
  std::vector<float> sum(48, -1.f);
  run_plan(plan_collective(CallKind::AllReduce, x, x, 1, "one rank"), in.data(), sum.data(), nullptr, memory);
  EXPECT_EQ(sum, in);
}

TEST(Collectives, ALibraryForAnotherMeshIsAClearError) {
  const BufferSpec x = spec("attn_q", ElemType::F32, {1, 4, 8, 2});
  const BufferSpec y = spec("attn_q_heads", ElemType::F32, {1, 16, 4, 2});  // made for 4 ranks
  const std::string e = error_of([&] { plan_collective(CallKind::SeqToHeads, x, y, 2, "MPI"); });
  EXPECT_THAT(e, HasSubstr("collective seq_to_heads from \"attn_q\" to \"attn_q_heads\" does not fit 2 ranks (MPI)"));
  EXPECT_THAT(e, HasSubstr("rebuild it for this one"));
  const BufferSpec i = spec("pos", ElemType::I32, {1, 4});
  EXPECT_THAT(error_of([&] { plan_collective(CallKind::AllReduce, i, i, 2, "MPI"); }), HasSubstr("all_reduce"));
}

}  // namespace
}  // namespace halyard::runtime
