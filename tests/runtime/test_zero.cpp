// ZeroAdamW (runtime/zero.h) over the in-process group with 1, 2, 3 and 4
// ranks against plain AdamW on the gradients summed over ranks: several steps,
// clipping on and off, parameters of odd sizes with padding between them (and
// garbage in the gradients' padding, which must be ignored). Then the state's
// size per rank, the checkpoint round trip of the moments, and one test per
// user mistake checking its message.
#include "runtime/zero.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "runtime/adamw.h"
#include "runtime/comm.h"
#include "runtime/error.h"
#include "tests/runtime_error_of.h"
#include "tests/in_process_ranks.h"

namespace halyard::runtime {
namespace {

using ::testing::HasSubstr;

using halyard::testing::expect_no_errors;
// Every rank's errors, with the timeout these tests use.
std::vector<std::string> run_ranks(int n, const std::function<void(Communicator&)>& fn) {
  return halyard::testing::run_ranks(n, 10, fn);
}

using halyard::testing::error_of;

// The flat arrays' layout: parameters and the padding around them.
struct Layout {
  int64_t total;
  std::vector<int64_t> offsets, sizes;
  std::vector<bool> decay;

  bool is_padding(int64_t j) const {
    for (size_t i = 0; i < sizes.size(); ++i)
      if (j >= offsets[i] && j < offsets[i] + sizes[i]) return false;
    return true;
  }
};

// Odd sizes aligned to 8 floats, an empty parameter, trailing padding, and an
// odd total: 99 % 2 and 99 % 4 leave a tail for the last rank, 99 % 3 does not.
Layout padded_layout() {
  Layout l;
  const std::vector<int64_t> sizes = {13, 1, 37, 0, 6, 21};
  const std::vector<bool> decay = {true, false, true, true, false, true};
  int64_t at = 0;
  for (int64_t n : sizes) {
    l.offsets.push_back(at);
    at = (at + n + 7) / 8 * 8;
  }
  l.sizes = sizes;
  l.decay = decay;
  l.total = at + 3;
  return l;
}

// Fewer elements than ranks: some ranks own nothing.
Layout tiny_layout() { return {3, {0, 2}, {1, 1}, {true, false}}; }

// Max relative difference of a against b, 0 where bitwise equal (in practice
// everywhere: only the clip factor's norm is summed in another order).
double max_rel_diff(const float* a, const float* b, int64_t n) {
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) == 0) continue;
    const double x = a[i], y = b[i];
    worst = std::max(worst, std::fabs(x - y) / std::max({std::fabs(x), std::fabs(y), 1e-30}));
  }
  return worst;
}

constexpr int kSteps = 5;
// Clipping: off, active (the norm is ~5-10), inactive, active, inactive.
constexpr double kMaxNorm[kSteps] = {0.0, 1.0, 1e6, 0.5, 1e6};
constexpr double kLr = 3e-3;

// Runs kSteps of ZeroAdamW on n ranks and the same steps of AdamW on the
// summed gradients, and compares parameters, padding, norms and moments.
void check_against_adamw(const Layout& l, int n) {
  const size_t P = static_cast<size_t>(n), total = static_cast<size_t>(l.total);
  std::mt19937 rng(1234 + n);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);

  std::vector<float> init(total, 0.f);
  for (size_t i = 0; i < l.sizes.size(); ++i)
    for (int64_t j = 0; j < l.sizes[i]; ++j) init[static_cast<size_t>(l.offsets[i] + j)] = uni(rng);
  // grads[t][r]: rank r's partial gradients of step t, garbage in the padding.
  std::vector<std::vector<std::vector<float>>> grads(kSteps, std::vector<std::vector<float>>(P));
  for (auto& step : grads)
    for (auto& g : step) {
      g.resize(total);
      for (size_t j = 0; j < total; ++j) g[j] = l.is_padding(static_cast<int64_t>(j)) ? 1e3f : uni(rng);
    }

  // The reference: sums in rank order (as the group does), then AdamW per parameter.
  std::vector<std::vector<float>> ref_w(l.sizes.size());
  for (size_t i = 0; i < l.sizes.size(); ++i)
    ref_w[i].assign(init.begin() + l.offsets[i], init.begin() + l.offsets[i] + l.sizes[i]);
  AdamW ref(l.sizes, l.decay);
  std::vector<double> ref_norm(kSteps);
  bool clipped = false;
  for (int t = 0; t < kSteps; ++t) {
    std::vector<float> sum = grads[t][0];
    for (size_t r = 1; r < P; ++r)
      for (size_t j = 0; j < total; ++j) sum[j] += grads[t][r][j];
    std::vector<float*> w;
    std::vector<const float*> g;
    for (size_t i = 0; i < l.sizes.size(); ++i) {
      w.push_back(ref_w[i].data());
      g.push_back(sum.data() + l.offsets[i]);
    }
    ref_norm[t] = global_grad_norm(g.data(), l.sizes);
    clipped |= clip_scale(ref_norm[t], kMaxNorm[t]) < 1.0;
    ref.step(t + 1, kLr, w.data(), g.data(), clip_scale(ref_norm[t], kMaxNorm[t]));
  }
  if (l.total > 10) {
    EXPECT_TRUE(clipped) << "the test should clip in at least one step";
  }

  std::vector<std::vector<float>> params(P, init);
  std::vector<std::vector<double>> norms(P);
  std::vector<std::vector<std::vector<float>>> gathered_m(P), gathered_v(P);
  expect_no_errors(run_ranks(n, [&](Communicator& c) {
    const size_t r = static_cast<size_t>(c.rank());
    ZeroAdamW opt(c, l.total, l.offsets, l.sizes, l.decay);
    for (int t = 0; t < kSteps; ++t) {
      std::vector<float> g = grads[t][r];
      norms[r].push_back(opt.step(t + 1, kLr, params[r].data(), g.data(), kMaxNorm[t]));
    }
    for (size_t i = 0; i < l.sizes.size(); ++i) {
      std::vector<float> m, v;
      opt.gather_moments(i, m, v);
      gathered_m[r].push_back(m);
      gathered_v[r].push_back(v);
    }
  }));

  for (size_t r = 0; r < P; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(n));
    for (int t = 0; t < kSteps; ++t) EXPECT_NEAR(norms[r][t], ref_norm[t], 1e-12 * ref_norm[t]) << "step " << t + 1;
    for (size_t i = 0; i < l.sizes.size(); ++i) {
      EXPECT_LE(max_rel_diff(params[r].data() + l.offsets[i], ref_w[i].data(), l.sizes[i]), 1e-6) << "parameter " << i;
      ASSERT_EQ(gathered_m[r][i].size(), static_cast<size_t>(l.sizes[i]));
      ASSERT_EQ(gathered_v[r][i].size(), static_cast<size_t>(l.sizes[i]));
      EXPECT_LE(max_rel_diff(gathered_m[r][i].data(), ref.m(i).data(), l.sizes[i]), 1e-6) << "m of parameter " << i;
      EXPECT_LE(max_rel_diff(gathered_v[r][i].data(), ref.v(i).data(), l.sizes[i]), 1e-6) << "v of parameter " << i;
    }
    for (int64_t j = 0; j < l.total; ++j)
      if (l.is_padding(j)) {
        EXPECT_EQ(params[r][static_cast<size_t>(j)], 0.f) << "padding element " << j;
      }
    // The all-gather gives every rank the same bits.
    EXPECT_EQ(std::memcmp(params[r].data(), params[0].data(), total * sizeof(float)), 0);
  }
}

class Zero : public ::testing::TestWithParam<int> {};

INSTANTIATE_TEST_SUITE_P(Ranks, Zero, ::testing::Values(1, 2, 3, 4), [](const auto& info) {
  return std::to_string(info.param) + "ranks";
});

TEST_P(Zero, MatchesAdamWOnSummedGradients) { check_against_adamw(padded_layout(), GetParam()); }

TEST_P(Zero, MatchesAdamWWithFewerElementsThanRanks) { check_against_adamw(tiny_layout(), GetParam()); }

TEST_P(Zero, ShardsTileTheArrayAndStateIsOneOverP) {
  const int n = GetParam();
  auto comms = make_in_process_group(n);
  // The constructor does not communicate, so all ranks can be built here.
  for (int64_t total : {int64_t{99}, int64_t{1000003}}) {
    SCOPED_TRACE("total " + std::to_string(total));
    int64_t at = 0, bytes = 0;
    for (int r = 0; r < n; ++r) {
      ZeroAdamW opt(*comms[static_cast<size_t>(r)], total, {0, 50}, {40, total - 60}, {true, false});
      EXPECT_EQ(opt.shard_begin(), at) << "rank " << r;
      EXPECT_GE(opt.shard_end(), opt.shard_begin()) << "rank " << r;
      at = opt.shard_end();
      // 2 moments of 4 bytes for total / P elements, the last rank up to P - 1 more.
      EXPECT_GE(opt.state_bytes(), 8 * (total / n)) << "rank " << r;
      EXPECT_LE(opt.state_bytes(), 8 * (total / n + n - 1)) << "rank " << r;
      bytes += opt.state_bytes();
    }
    EXPECT_EQ(at, total);
    EXPECT_EQ(bytes, 8 * total);  // unsharded: m and v for every element
  }
}

TEST_P(Zero, MomentsRoundTripThroughACheckpoint) {
  const int n = GetParam();
  const Layout l = padded_layout();
  const size_t total = static_cast<size_t>(l.total);
  expect_no_errors(run_ranks(n, [&](Communicator& c) {
    std::mt19937 rng(7 + c.rank());
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    auto fill_grads = [&](std::vector<float>& g) {
      for (size_t j = 0; j < total; ++j) g[j] = l.is_padding(static_cast<int64_t>(j)) ? 0.f : uni(rng);
    };
    std::vector<float> w(total, 0.f), g(total);
    for (size_t j = 0; j < total; ++j)
      if (!l.is_padding(static_cast<int64_t>(j))) w[j] = 0.5f;
    ZeroAdamW saved(c, l.total, l.offsets, l.sizes, l.decay);
    for (int t = 1; t <= 3; ++t) {
      fill_grads(g);
      saved.step(t, kLr, w.data(), g.data(), 1.0);
    }
    // Save every parameter's moments, restore them into a fresh optimizer.
    ZeroAdamW restored(c, l.total, l.offsets, l.sizes, l.decay);
    for (size_t i = 0; i < l.sizes.size(); ++i) {
      std::vector<float> m, v, m2, v2;
      saved.gather_moments(i, m, v);
      restored.set_moments(i, m, v);
      restored.gather_moments(i, m2, v2);
      EXPECT_EQ(m, m2) << "parameter " << i;
      EXPECT_EQ(v, v2) << "parameter " << i;
    }
    // Both continue identically.
    std::vector<float> w2 = w, g2(total);
    fill_grads(g);
    g2 = g;
    saved.step(4, kLr, w.data(), g.data(), 1.0);
    restored.step(4, kLr, w2.data(), g2.data(), 1.0);
    EXPECT_EQ(w, w2);
  }));
}

// --- User mistakes: one test each, checking the message. -------------------

class ZeroErrors : public ::testing::Test {
 protected:
  std::vector<std::unique_ptr<Communicator>> comms = make_in_process_group(1);
  Communicator& c = *comms[0];
};

// The slices by hand: 10 elements over 3 ranks are blocks of 3, the last
// rank holding the last 4; parameters [0, 4) and [5, 9) (element 4 and 9
// padding) fall into runs of each slice, in flat order. A GPU model's ZeRO-1
// keeps its state by the same slices (Model::use_zero_adamw).
TEST(ZeroSlices, EqualBlocksTheRemainderToTheLastRank) {
  const std::vector<int64_t> offsets = {5, 0}, sizes = {4, 4};
  using S = ZeroSlice::Segment;
  auto runs = [](const ZeroSlice& z) {
    std::vector<std::array<int64_t, 3>> out;
    for (const S& s : z.segments) out.push_back({static_cast<int64_t>(s.param), s.begin, s.end});
    return out;
  };
  const ZeroSlice r0 = zero_slice(10, 3, 0, offsets, sizes), r1 = zero_slice(10, 3, 1, offsets, sizes),
                  r2 = zero_slice(10, 3, 2, offsets, sizes);
  EXPECT_EQ(r0.block, 3);
  EXPECT_EQ(r0.begin, 0);
  EXPECT_EQ(r0.end, 3);
  EXPECT_EQ(r1.begin, 3);
  EXPECT_EQ(r1.end, 6);
  EXPECT_EQ(r2.begin, 6);
  EXPECT_EQ(r2.end, 10);
  EXPECT_EQ(runs(r0), (std::vector<std::array<int64_t, 3>>{{1, 0, 3}}));
  EXPECT_EQ(runs(r1), (std::vector<std::array<int64_t, 3>>{{1, 3, 4}, {0, 5, 6}}));
  EXPECT_EQ(runs(r2), (std::vector<std::array<int64_t, 3>>{{0, 6, 9}}));
  // Fewer elements than ranks: every block is empty, the last rank holds all.
  const ZeroSlice few = zero_slice(2, 4, 3, {0}, {2});
  EXPECT_EQ(few.block, 0);
  EXPECT_EQ(runs(few), (std::vector<std::array<int64_t, 3>>{{0, 0, 2}}));
  EXPECT_TRUE(zero_slice(2, 4, 1, {0}, {2}).segments.empty());
}

TEST_F(ZeroErrors, CountsThatDisagree) {
  const std::string e = error_of([&] { ZeroAdamW(c, 100, {0, 50}, {40, 20, 5}, {true, true, true}); });
  EXPECT_THAT(e, HasSubstr("error: ZeroAdamW got 2 offsets, 3 sizes and 3 decay flags"));
  EXPECT_THAT(e, HasSubstr("fix: give one offset, one size and one decay flag per parameter"));
}

TEST_F(ZeroErrors, NegativeSize) {
  const std::string e = error_of([&] { ZeroAdamW(c, 100, {0, 50}, {40, -3}, {true, true}); });
  EXPECT_THAT(e, HasSubstr("parameter 1 (offset 50, size -3"));
  EXPECT_THAT(e, HasSubstr("offsets and sizes must be >= 0"));
}

TEST_F(ZeroErrors, NegativeTotal) {
  const std::string e = error_of([&] { ZeroAdamW(c, -1, {}, {}, {}); });
  EXPECT_THAT(e, HasSubstr("total is -1 elements"));
}

TEST_F(ZeroErrors, TotalTooSmall) {
  const std::string e = error_of([&] { ZeroAdamW(c, 64, {0, 48}, {40, 20}, {true, false}); });
  EXPECT_THAT(e, HasSubstr("parameter 1 (offset 48, size 20, elements [48, 68)) ends at element 68 but the flat "
                           "array has total = 64 elements"));
  EXPECT_THAT(e, HasSubstr("fix: pass total >= 68"));
}

TEST_F(ZeroErrors, OverlappingParameters) {
  // Given out of order: the overlap is found in flat order.
  const std::string e = error_of([&] { ZeroAdamW(c, 100, {60, 0, 35}, {10, 40, 20}, {true, true, true}); });
  EXPECT_THAT(e, HasSubstr("parameter 2 (offset 35, size 20, elements [35, 55)) overlaps parameter 1 (offset 0, "
                           "size 40, elements [0, 40)) in 5 elements"));
  EXPECT_THAT(e, HasSubstr("fix: start parameter 2 at offset >= 40 (the end of parameter 1)"));
}

TEST_F(ZeroErrors, ParameterInsideAnother) {
  const std::string e = error_of([&] { ZeroAdamW(c, 100, {0, 10, 20}, {50, 5, 5}, {true, true, true}); });
  EXPECT_THAT(e, HasSubstr("parameter 1 (offset 10, size 5, elements [10, 15)) overlaps parameter 0"));
  EXPECT_THAT(e, HasSubstr("in 5 elements"));
}

TEST_F(ZeroErrors, SetMomentsOfTheWrongLength) {
  ZeroAdamW opt(c, 64, {0, 48}, {40, 10}, {true, false});
  const std::string e = error_of([&] { opt.set_moments(1, std::vector<float>(40), std::vector<float>(10)); });
  EXPECT_THAT(e, HasSubstr("parameter 1 has 10 elements but got m of 40 and v of 10 floats"));
  EXPECT_THAT(e, HasSubstr("fix: pass the full moments of the parameter, 10 floats each"));
}

TEST_F(ZeroErrors, ParameterIndexOutOfRange) {
  ZeroAdamW opt(c, 64, {0, 48}, {40, 10}, {true, false});
  std::vector<float> m, v;
  EXPECT_THAT(error_of([&] { opt.gather_moments(2, m, v); }),
              HasSubstr("gather_moments: parameter 2 does not exist; there are 2 (0..1)"));
}

TEST_F(ZeroErrors, StepCountsFromOne) {
  ZeroAdamW opt(c, 4, {0}, {4}, {true});
  std::vector<float> w(4), g(4);
  EXPECT_THAT(error_of([&] { opt.step(0, 1e-3, w.data(), g.data(), 1.0); }),
              HasSubstr("step is 0; steps count from 1"));
}

}  // namespace
}  // namespace halyard::runtime
