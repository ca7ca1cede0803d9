// Tests for runtime/comm over the in-process group (threads as ranks), with
// 1, 2 and 4 ranks: every collective against values computed by hand, the
// all-to-all traffic counter against the Ulysses formula, one test per user
// mistake checking its message, and (suite CommFaults, label "faults") ranks
// that never arrive, which must make the others throw within the timeout
// naming the missing ranks.
#include "runtime/comm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "runtime/bf16.h"
#include "runtime/error.h"
#include "tests/in_process_ranks.h"
#include "tests/runtime_error_of.h"
#include "tests/uneven_exchange.h"

namespace halyard::runtime {
namespace {

using ::testing::HasSubstr;

using halyard::testing::expect_no_errors;
using halyard::testing::run_ranks;

using halyard::testing::error_of;

using halyard::testing::element;
using halyard::testing::UnevenExchange;

class Comm : public ::testing::TestWithParam<int> {};

INSTANTIATE_TEST_SUITE_P(Ranks, Comm, ::testing::Values(1, 2, 4), [](const auto& info) {
  return std::to_string(info.param) + "ranks";
});

TEST_P(Comm, AllToAllVPermutesUnevenBlocksExactly) {
  const int n = GetParam();
  expect_no_errors(run_ranks(n, 5, [&](Communicator& c) {
    const int r = c.rank();
    const UnevenExchange x(r, n);
    const auto& send_counts = x.send_counts;
    const auto& recv_counts = x.recv_counts;
    const auto& send = x.send;
    std::vector<float> recv(static_cast<size_t>(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0})),
                            -1.0f);
    c.all_to_all_v(send.data(), send_counts.data(), recv.data(), recv_counts.data());
    size_t at = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t k = 0; k < recv_counts[p]; ++k, ++at)
        EXPECT_EQ(recv[at], element(p, r, k)) << "rank " << r << " block from " << p << " element " << k;

    // The same exchange on int32 (token ids, positions).
    std::vector<int32_t> send_i(send.begin(), send.end()), recv_i(recv.size(), -1);
    c.all_to_all_v(send_i.data(), send_counts.data(), recv_i.data(), recv_counts.data());
    for (size_t i = 0; i < recv.size(); ++i) EXPECT_EQ(recv_i[i], static_cast<int32_t>(recv[i]));

    // Started, then finished by wait(): the counts may be gone by then.
    std::vector<float> late(recv.size(), -1.0f);
    auto counts = std::make_unique<UnevenExchange>(r, n);
    auto started = c.start_all_to_all_v(send.data(), counts->send_counts.data(), late.data(), counts->recv_counts.data());
    counts.reset();
    EXPECT_FALSE(started->join(nullptr)) << "host memory: nothing to join";
    started->wait();
    EXPECT_EQ(late, recv);
  }));
}

TEST_P(Comm, AllToAllBytesCounterMatchesFormula) {
  const int n = GetParam();
  expect_no_errors(run_ranks(n, 5, [&](Communicator& c) {
    const int r = c.rank();
    // Uneven: every element to another rank counts, the block to itself does not.
    const UnevenExchange x(r, n);
    const auto& send_counts = x.send_counts;
    const auto& recv_counts = x.recv_counts;
    const int64_t expected = x.bytes_to_others;
    std::vector<float> send(64), recv(64);
    EXPECT_EQ(c.all_to_all_bytes_sent(), 0);
    c.all_to_all_v(send.data(), send_counts.data(), recv.data(), recv_counts.data());
    EXPECT_EQ(c.all_to_all_bytes_sent(), expected);
    c.all_to_all_v(send.data(), send_counts.data(), recv.data(), recv_counts.data());
    EXPECT_EQ(c.all_to_all_bytes_sent(), 2 * expected);
    c.reset_all_to_all_bytes_sent();

    // Ulysses: q of f32[seq=S@sp, heads=H, head_dim=D] goes to heads@sp. Each
    // rank keeps 1/P of its slice and sends the rest: (P-1) * S/P * H/P * D * 4 bytes.
    const int64_t S = 32, H = 8, D = 4, P = n;
    std::vector<int64_t> counts(n, (S / P) * (H / P) * D);
    std::vector<float> q(static_cast<size_t>(S / P * H * D)), q_heads(q.size());
    c.all_to_all_v(q.data(), counts.data(), q_heads.data(), counts.data());
    EXPECT_EQ(c.all_to_all_bytes_sent(), (P - 1) * (S / P) * (H / P) * D * 4);
  }));
}

TEST_P(Comm, AllReduceSumIsExactAndIdenticalOnEveryRank) {
  const int n = GetParam();
  std::vector<std::vector<float>> results(static_cast<size_t>(n));
  expect_no_errors(run_ranks(n, 5, [&](Communicator& c) {
    const int r = c.rank();
    for (int64_t len : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}}) {
      std::vector<float> data(static_cast<size_t>(len));
      for (int64_t i = 0; i < len; ++i) data[static_cast<size_t>(i)] = static_cast<float>(r + 1) + 0.5f * i;
      c.all_reduce_sum(data.data(), len);
      for (int64_t i = 0; i < len; ++i)
        EXPECT_EQ(data[static_cast<size_t>(i)], static_cast<float>(n * (n + 1) / 2) + 0.5f * i * n) << "i " << i;
    }
    // Values whose float sum depends on the order: every rank must agree bitwise.
    std::vector<float> noisy(257);
    for (size_t i = 0; i < noisy.size(); ++i) noisy[i] = std::sin(1.0f + r * 7.0f + i) * 1e-3f + 1.0f / (r + 3);
    c.all_reduce_sum(noisy.data(), static_cast<int64_t>(noisy.size()));
    results[static_cast<size_t>(r)] = noisy;

    std::vector<double> d = {0.25 * r, 1.0};
    c.all_reduce_sum(d.data(), 2);
    EXPECT_EQ(d[0], 0.25 * n * (n - 1) / 2);
    EXPECT_EQ(d[1], n);
    EXPECT_EQ(c.all_reduce_sum(1.5 * r), 1.5 * n * (n - 1) / 2);
    EXPECT_EQ(c.all_reduce_sum(int64_t{1} << (40 + r)), ((int64_t{1} << n) - 1) << 40);
  }));
  for (int r = 1; r < n; ++r)
    EXPECT_EQ(std::memcmp(results[0].data(), results[static_cast<size_t>(r)].data(), results[0].size() * 4), 0)
        << "rank " << r << " got a different sum than rank 0";
}

TEST_P(Comm, AllGatherConcatenatesInRankOrder) {
  const int n = GetParam();
  expect_no_errors(run_ranks(n, 5, [&](Communicator& c) {
    const int r = c.rank();
    const int64_t len = 5;
    std::vector<float> send(len);
    std::vector<int32_t> send_i(len);
    for (int64_t k = 0; k < len; ++k) send[k] = element(r, 0, k), send_i[k] = r * 10 + static_cast<int32_t>(k);
    std::vector<float> recv(static_cast<size_t>(len * n));
    std::vector<int32_t> recv_i(recv.size());
    c.all_gather(send.data(), len, recv.data());
    c.all_gather(send_i.data(), len, recv_i.data());
    for (int p = 0; p < n; ++p)
      for (int64_t k = 0; k < len; ++k) {
        EXPECT_EQ(recv[p * len + k], element(p, 0, k));
        EXPECT_EQ(recv_i[p * len + k], p * 10 + k);
      }
    c.all_gather(static_cast<const float*>(nullptr), 0, static_cast<float*>(nullptr));  // empty is fine
  }));
}

TEST_P(Comm, ReduceScatterSumGivesEachRankItsBlock) {
  const int n = GetParam();
  expect_no_errors(run_ranks(n, 5, [&](Communicator& c) {
    const int r = c.rank();
    const int64_t per = 6;
    std::vector<float> send(static_cast<size_t>(per * n));
    for (int64_t i = 0; i < per * n; ++i) send[i] = static_cast<float>(i) + 1000.0f * r;
    std::vector<float> recv(per);
    c.reduce_scatter_sum(send.data(), recv.data(), per);
    for (int64_t k = 0; k < per; ++k)
      EXPECT_EQ(recv[k], static_cast<float>(n * (r * per + k)) + 1000.0f * n * (n - 1) / 2) << "k " << k;
  }));
}

// Summed from bf16: each rank's values rounded to bf16 (nearest even), added
// in f32 in rank order, the same bits on every rank; half the bytes of f32
// on the wire, counted by the all-to-all counter. A length that the ranks do
// not divide is padded inside all_reduce_sum_bf16. Past 2^20 elements of
// all ranks the sums go in chunks (runtime/comm.cpp: kBf16SumChunk), which
// change neither a bit nor a byte on the wire.
TEST_P(Comm, SumsFromBf16AreTheRoundedValuesAddedInF32) {
  const int n = GetParam();
  auto value = [](int r, int64_t i) { return std::sin(1.0f + 7.0f * r + 0.37f * i) / (r + 3) + 1e-3f * i; };
  auto want = [&](int64_t i) {
    float sum = 0;
    for (int p = 0; p < n; ++p) sum += bf16_value(bf16_bits(value(p, i)));
    return sum;
  };
  std::vector<std::vector<float>> everyone(static_cast<size_t>(n));
  expect_no_errors(run_ranks(n, 5, [&](Communicator& c) {
    const int r = c.rank();
    const int64_t per = 9;
    std::vector<float> send(static_cast<size_t>(per * n)), recv(per);
    for (int64_t i = 0; i < per * n; ++i) send[static_cast<size_t>(i)] = value(r, i);
    c.reset_all_to_all_bytes_sent();
    c.reduce_scatter_sum_bf16(send.data(), recv.data(), per);
    EXPECT_EQ(c.all_to_all_bytes_sent(), 2 * per * (n - 1));
    for (int64_t k = 0; k < per; ++k) EXPECT_EQ(recv[static_cast<size_t>(k)], want(r * per + k)) << "k " << k;
    const int64_t long_per = (int64_t{1} << 20) / n + 7;  // two chunks
    std::vector<float> long_send(static_cast<size_t>(long_per * n)), long_recv(static_cast<size_t>(long_per));
    for (int64_t i = 0; i < long_per * n; ++i) long_send[static_cast<size_t>(i)] = value(r, i);
    c.reset_all_to_all_bytes_sent();
    c.reduce_scatter_sum_bf16(long_send.data(), long_recv.data(), long_per);
    EXPECT_EQ(c.all_to_all_bytes_sent(), 2 * long_per * (n - 1));
    int64_t wrong = 0;
    for (int64_t k = 0; k < long_per; ++k) wrong += long_recv[static_cast<size_t>(k)] != want(r * long_per + k);
    EXPECT_EQ(wrong, 0) << "of " << long_per << " sums in two chunks";
    for (int64_t len : {int64_t{0}, int64_t{1}, int64_t{257}, (int64_t{1} << 20) + 3}) {
      std::vector<float> data(static_cast<size_t>(len));
      for (int64_t i = 0; i < len; ++i) data[static_cast<size_t>(i)] = value(r, i);
      c.reset_all_to_all_bytes_sent();
      c.all_reduce_sum_bf16(data.data(), len);
      EXPECT_EQ(c.all_to_all_bytes_sent(), 2 * ((len + n - 1) / n) * (n - 1)) << "len " << len;
      wrong = 0;
      for (int64_t i = 0; i < len; ++i) wrong += data[static_cast<size_t>(i)] != want(i);
      EXPECT_EQ(wrong, 0) << "of " << len << " sums";
      if (len == 257) everyone[static_cast<size_t>(r)] = data;
    }
  }));
  for (int r = 1; r < n; ++r) EXPECT_EQ(everyone[static_cast<size_t>(r)], everyone[0]) << "rank " << r;
}

TEST_P(Comm, SendRecvMatchesByPeerAndTag) {
  const int n = GetParam();
  if (n == 1) GTEST_SKIP() << "a single rank has no peer";
  expect_no_errors(run_ranks(n, 5, [&](Communicator& c) {
    const int r = c.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
    std::vector<float> a = {1.0f * r, 2.0f * r, 3.0f * r}, b = {-1.0f * r};
    std::vector<int32_t> ids = {r, r + 100};
    c.send(a.data(), 3, next, 1);
    c.send(b.data(), 1, next, 2);
    c.send(ids.data(), 2, next, 3);
    std::vector<float> got_b(1), got_a(3);
    std::vector<int32_t> got_ids(2);
    c.recv(got_b.data(), 1, prev, 2);  // tags out of order: matched by tag
    c.recv(got_a.data(), 3, prev, 1);
    c.recv(got_ids.data(), 2, prev, 3);
    EXPECT_EQ(got_a, (std::vector<float>{1.0f * prev, 2.0f * prev, 3.0f * prev}));
    EXPECT_EQ(got_b, (std::vector<float>{-1.0f * prev}));
    EXPECT_EQ(got_ids, (std::vector<int32_t>{prev, prev + 100}));
    EXPECT_EQ(c.all_to_all_bytes_sent(), 0);  // send/recv is not all-to-all traffic
  }));
}

// Ring attention's passes: several exchanges in flight at once (each with its
// own tag), finished in another order than they started.
TEST_P(Comm, ExchangesInFlightTogetherEachGetTheirMessage) {
  const int n = GetParam();
  if (n == 1) GTEST_SKIP() << "a single rank has no peer";
  expect_no_errors(run_ranks(n, 5, [&](Communicator& c) {
    const int r = c.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
    std::vector<float> k = {1.0f * r, 2.0f * r}, v = {-3.0f * r};
    std::vector<int32_t> pos = {r, r + 10, r + 20};
    std::vector<float> got_k(2), got_v(1);
    std::vector<int32_t> got_pos(3);
    auto ek = c.start_exchange(k.data(), got_k.data(), 2, next, prev, 11);
    auto ev = c.start_exchange(v.data(), got_v.data(), 1, next, prev, 12);
    auto ep = c.start_exchange(pos.data(), got_pos.data(), 3, next, prev, 13);
    ep->wait();
    ek->wait();
    ev->wait();
    EXPECT_EQ(got_k, (std::vector<float>{1.0f * prev, 2.0f * prev}));
    EXPECT_EQ(got_v, (std::vector<float>{-3.0f * prev}));
    EXPECT_EQ(got_pos, (std::vector<int32_t>{prev, prev + 10, prev + 20}));
    EXPECT_EQ(c.p2p_bytes_sent(), (2 + 1 + 3) * 4);
  }));
}

// Gradient buckets: sums started as the backward finishes them, other calls
// between, each finished by its wait() (here, where the backend sums).
TEST_P(Comm, SumsStartedEarlyFinishAtTheirWait) {
  const int n = GetParam();
  expect_no_errors(run_ranks(n, 5, [&](Communicator& c) {
    const float r = static_cast<float>(c.rank());
    std::vector<float> a = {r, 1.f}, b = {2 * r};
    auto sa = c.start_all_reduce_sum(a.data(), 2);
    auto sb = c.start_all_reduce_sum(b.data(), 1);
    const double count = c.all_reduce_sum(1.0);
    sa->wait();
    sb->wait();
    sb->wait();  // (once is enough; again does nothing)
    const float ranks = static_cast<float>(n), sum = ranks * (ranks - 1) / 2;
    EXPECT_EQ(count, n);
    EXPECT_EQ(a, (std::vector<float>{sum, ranks}));
    EXPECT_EQ(b, (std::vector<float>{2 * sum}));
  }));
}

// Hybrid steps split the sequence group: colors make the groups, keys order them.
TEST_P(Comm, SplitMakesSubgroupsRankedByKey) {
  const int n = GetParam();
  expect_no_errors(run_ranks(n, 5, [&](Communicator& c) {
    const int r = c.rank();
    auto sub = c.split(r % 2, -r);  // evens and odds, each in reverse rank order
    const int members = (n + 1 - r % 2) / 2;
    ASSERT_EQ(sub->size(), members);
    EXPECT_EQ(sub->rank(), members - 1 - r / 2);
    float x = static_cast<float>(r);
    sub->all_reduce_sum(&x, 1);
    float want = 0;
    for (int p = r % 2; p < n; p += 2) want += static_cast<float>(p);
    EXPECT_EQ(x, want);
    float y = 1;
    c.all_reduce_sum(&y, 1);  // the parent still works
    EXPECT_EQ(y, static_cast<float>(n));
  }));
}

TEST_P(Comm, ManyCollectivesInARowStayInStep) {
  const int n = GetParam();
  expect_no_errors(run_ranks(n, 5, [&](Communicator& c) {
    for (int it = 0; it < 300; ++it) {
      float x = static_cast<float>(c.rank() + it);
      c.all_reduce_sum(&x, 1);
      ASSERT_EQ(x, static_cast<float>(n * (n - 1) / 2 + n * it)) << "iteration " << it;
      if (it % 3 == 0) c.barrier();
      std::vector<float> all(n);
      c.all_gather(&x, 1, all.data());
      for (float v : all) ASSERT_EQ(v, x);
    }
  }));
}

TEST(Comm, ReportsItsRankSizeAndBackend) {
  auto comms = make_in_process_group(3, 2.5);
  ASSERT_EQ(comms.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(comms[r]->rank(), r);
    EXPECT_EQ(comms[r]->size(), 3);
    EXPECT_EQ(comms[r]->timeout_s(), 2.5);
    EXPECT_STREQ(comms[r]->backend(), "in-process");
  }
  EXPECT_EQ(make_in_process_group(1)[0]->timeout_s(), kDefaultCommTimeoutS);
}

// ---------------------------------------------------------------------------
// User mistakes: one test each, checking the message.

TEST(CommErrors, TimeoutMustBePositiveAndFinite) {
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
    std::string e = error_of([&] { make_in_process_group(2, bad); });
    EXPECT_THAT(e, HasSubstr("error: communicator timeout of ")) << bad;
    EXPECT_THAT(e, HasSubstr("must be a positive, finite number of seconds"));
  }
  auto comms = make_in_process_group(1, 1);
  std::string e = error_of([&] { comms[0]->set_timeout_s(-2); });
  EXPECT_THAT(e, HasSubstr("error: communicator timeout of -2 s on rank 0 of 1"));
  EXPECT_EQ(comms[0]->timeout_s(), 1);
}

TEST(CommErrors, GroupNeedsARank) {
  EXPECT_THAT(error_of([] { make_in_process_group(0, 1); }),
              HasSubstr("error: in-process group of 0 ranks\na group needs at least 1 rank."));
}

TEST(CommErrors, NegativeCountIsRejectedBeforeSending) {
  auto errors = run_ranks(2, 5, [](Communicator& c) {
    std::vector<float> buf(4);
    std::vector<int64_t> bad = {1, -3}, good = {1, 1};
    if (c.rank() == 1) {
      std::string e = error_of([&] { c.all_to_all_v(buf.data(), bad.data(), buf.data() + 2, good.data()); });
      EXPECT_EQ(e, "error: all_to_all_v on rank 1 of 2: send_counts[1] is -3; counts are numbers of elements per "
                   "rank and must be >= 0.");
      EXPECT_THAT(error_of([&] { c.all_reduce_sum(buf.data(), -1); }),
                  HasSubstr("all_reduce_sum on rank 1 of 2: n is -1"));
    }
    c.barrier();  // still usable
  });
  expect_no_errors(errors);
}

TEST(CommErrors, NullBufferWithElementsIsRejected) {
  auto comms = make_in_process_group(1, 1);
  EXPECT_EQ(error_of([&] { comms[0]->all_reduce_sum(static_cast<float*>(nullptr), 3); }),
            "error: all_reduce_sum on rank 0 of 1: data is null but must hold 3 elements.\n"
            "fix: pass a buffer of at least 3 elements.");
}

TEST(CommErrors, PeerMustBeAnotherRank) {
  auto comms = make_in_process_group(4, 1);
  float x = 0;
  EXPECT_EQ(error_of([&] { comms[1]->send(&x, 1, 4, 0); }),
            "error: send on rank 1 of 4: peer 4 is not a rank.\nlegal peers: 0..3 except 1 (this rank)");
  EXPECT_THAT(error_of([&] { comms[1]->recv(&x, 1, -1, 0); }), HasSubstr("recv on rank 1 of 4: peer -1 is not a rank"));
  EXPECT_EQ(error_of([&] { comms[2]->send(&x, 1, 2, 0); }),
            "error: send on rank 2 of 4: peer 2 is this rank; a rank cannot send to or receive from itself.\n"
            "fix: copy the buffer instead.");
}

TEST(CommErrors, TagMustBeInRange) {
  auto comms = make_in_process_group(2, 1);
  float x = 0;
  EXPECT_EQ(error_of([&] { comms[0]->send(&x, 1, 1, 40000); }),
            "error: send on rank 0 of 2: tag 40000 is out of range.\nlegal tags: 0..32767");
}

TEST(CommErrors, AllToAllCountsMustMatchAcrossRanks) {
  auto errors = run_ranks(2, 5, [](Communicator& c) {
    std::vector<float> send(8), recv(8);
    // Rank 0 sends 3 elements to rank 1, which expects 2.
    std::vector<int64_t> send_counts = c.rank() == 0 ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{2, 2};
    std::vector<int64_t> recv_counts = c.rank() == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{2, 2};
    c.all_to_all_v(send.data(), send_counts.data(), recv.data(), recv_counts.data());
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(errors[r], "error: all_to_all_v on rank " + std::to_string(r) +
                             " of 2: rank 0 sends 3 elements to rank 1 (its send_counts[1]) but rank 1 expects 2 "
                             "from rank 0 (its recv_counts[0]).\nrecv_counts[p] on rank q must equal send_counts[q] "
                             "on rank p.");
}

TEST(CommErrors, RanksMustCallTheSameCollective) {
  auto errors = run_ranks(2, 5, [](Communicator& c) {
    float x = 1, all[2];
    if (c.rank() == 0)
      c.all_gather(&x, 1, all);
    else
      c.barrier();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[r], HasSubstr("the ranks called different collectives at the same point:\n"
                                     "  rank 0: all_gather\n  rank 1: barrier\n"));
    EXPECT_THAT(errors[r], HasSubstr("every rank must call the same collectives in the same order."));
  }
}

TEST(CommErrors, RanksMustPassTheSameSize) {
  auto errors = run_ranks(2, 5, [](Communicator& c) {
    std::vector<float> data(4);
    c.all_reduce_sum(data.data(), c.rank() == 0 ? 4 : 3);
  });
  EXPECT_THAT(errors[1], HasSubstr("error: all_reduce_sum on rank 1 of 2: the ranks passed different sizes:\n"
                                   "  rank 0: 4 elements\n  rank 1: 3 elements\n"));
}

TEST(CommErrors, RecvSizeMustMatchSend) {
  auto errors = run_ranks(2, 5, [](Communicator& c) {
    std::vector<float> data(4);
    if (c.rank() == 0) c.send(data.data(), 4, 1, 9);
    if (c.rank() == 1) c.recv(data.data(), 3, 0, 9);
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "error: recv on rank 1 of 2: rank 0 sent 4 f32 with tag 9 but this rank expected 3 f32.\n"
                       "the element count and type must agree on both sides of a send/recv pair.");
}

// ---------------------------------------------------------------------------
// Faults: a rank that never arrives.

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// A group of a larger world (the sp ranks 2, 3 of a dp 2 x sp 2 mesh):
// errors name the world ranks people launched, next to the group ranks.
TEST(CommFaults, GroupOfAWorldNamesWorldRanks) {
  auto errors = run_ranks(2, 0.5, [&](Communicator& c) {
    c.set_world_ranks({2, 3});
    if (c.rank() == 0) c.barrier();  // rank 1 (world rank 3) never arrives
  });
  EXPECT_THAT(errors[0], HasSubstr("barrier on rank 0 of 2 (world rank 2)"));
  EXPECT_THAT(errors[0], HasSubstr("waiting for rank 1 (world rank 3) (dead or stuck?)"));
  EXPECT_EQ(errors[1], "");
}

TEST(CommFaults, MissingRankMakesTheOthersThrowNamingIt) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<double> elapsed(4);
  auto errors = run_ranks(4, 0.5, [&](Communicator& c) {
    std::vector<float> send(8), recv(8);
    std::vector<int64_t> counts(4, 2);
    if (c.rank() != 2) {  // rank 2 is stuck elsewhere
      try {
        c.all_to_all_v(send.data(), counts.data(), recv.data(), counts.data());
      } catch (...) {
        elapsed[c.rank()] = seconds_since(start);
        throw;
      }
    }
  });
  EXPECT_EQ(errors[2], "");
  int timed_out = 0;
  for (int r : {0, 1, 3}) {
    // The first to time out says so; the ones it wakes say they gave up.
    EXPECT_THAT(errors[r], HasSubstr("error: all_to_all_v on rank " + std::to_string(r) + " of 4 "));
    EXPECT_THAT(errors[r], HasSubstr("waiting for rank 2 (dead or stuck?)"));
    if (errors[r].find("timed out after 0.5 s waiting for rank 2 (dead or stuck?)\n") != std::string::npos) {
      ++timed_out;
      EXPECT_THAT(errors[r], HasSubstr("raise the timeout with Communicator::set_timeout_s"));
    }
    EXPECT_GE(elapsed[r], 0.45) << "rank " << r;
    EXPECT_LT(elapsed[r], 3.0) << "rank " << r;
  }
  EXPECT_GE(timed_out, 1);
}

TEST(CommFaults, MessageNamesEveryMissingRank) {
  auto errors = run_ranks(4, 0.5, [&](Communicator& c) {
    float x = 1;
    if (c.rank() == 0 || c.rank() == 2) c.all_reduce_sum(&x, 1);
  });
  for (int r : {0, 2}) EXPECT_THAT(errors[r], HasSubstr("waiting for ranks 1, 3 (dead or stuck?)"));
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(errors[3], "");
}

TEST(CommFaults, LateRankFindsTheGroupBroken) {
  auto errors = run_ranks(2, 0.3, [&](Communicator& c) {
    if (c.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(800));
    c.barrier();
  });
  EXPECT_THAT(errors[0], HasSubstr("error: barrier on rank 0 of 2 timed out after 0.3 s waiting for rank 1"));
  EXPECT_THAT(errors[1], HasSubstr("error: barrier on rank 1 of 2: the communicator is broken by an earlier "
                                   "failure:\n  barrier on rank 0 of 2 timed out after 0.3 s waiting for rank 1\n"));
}

TEST(CommFaults, ExchangeWaitTimesOutNamingThePeer) {
  auto errors = run_ranks(2, 0.5, [&](Communicator& c) {
    float x[4] = {}, y[4];
    if (c.rank() == 1) c.start_exchange(x, y, 4, 0, 0, 9)->wait();  // rank 0 never sends
  });
  EXPECT_THAT(errors[1], HasSubstr("timed out after 0.5 s waiting for rank 0 (dead or stuck?)"));
}

TEST(CommFaults, RecvTimesOutNamingThePeer) {
  const auto start = std::chrono::steady_clock::now();
  auto errors = run_ranks(2, 0.5, [&](Communicator& c) {
    float x[4];
    if (c.rank() == 1) c.recv(x, 4, 0, 7);  // rank 0 never sends
  });
  EXPECT_LT(seconds_since(start), 3.0);
  EXPECT_THAT(errors[1], HasSubstr("error: recv on rank 1 of 2 timed out after 0.5 s waiting for rank 0 (dead or "
                                   "stuck?)\nno message with tag 7 (4 f32) came from rank 0."));
}

}  // namespace
}  // namespace halyard::runtime
