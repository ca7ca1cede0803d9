// Tests for runtime/measure.h: resident memory against an allocation of known
// size, collective fits over in-process groups of 2 and 4 ranks (sane and the
// same on every rank), the bandwidth probe, calibrate_machine's JSON, the plan
// line, and one test per user mistake checking its message. Nothing here
// asserts a speed: CI machines differ; only sanity and consistency are checked.
#include "runtime/measure.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "tests/in_process_ranks.h"
#include "tests/runtime_error_of.h"

namespace halyard::runtime {
namespace {

using ::testing::HasSubstr;
using halyard::testing::error_of;
using halyard::testing::expect_no_errors;
using halyard::testing::run_ranks;

constexpr int64_t kMiB = int64_t{1} << 20;

// Keeps an allocation observable, so that no compiler elides it.
char* volatile g_keep = nullptr;

TEST(Rss, GrowsByTheBytesOfATouchedAllocation) {
  const int64_t bytes = 64 * kMiB;
  const int64_t before = current_rss_bytes();
  std::unique_ptr<char[]> block(new char[static_cast<size_t>(bytes)]);
  std::memset(block.get(), 1, static_cast<size_t>(bytes));
  g_keep = block.get();
  const int64_t after = current_rss_bytes();
  std::printf("current RSS %lld -> %lld bytes: +%lld for a touched block of %lld\n", static_cast<long long>(before),
              static_cast<long long>(after), static_cast<long long>(after - before), static_cast<long long>(bytes));
  EXPECT_NEAR(static_cast<double>(after - before), static_cast<double>(bytes), 0.03 * static_cast<double>(bytes));
  EXPECT_GE(peak_rss_bytes(), after);
  EXPECT_GE(peak_rss_bytes(), before + bytes * 97 / 100);
}

TEST(Rss, PeakIsAtLeastCurrent) {
  const int64_t current = current_rss_bytes(), peak = peak_rss_bytes();
  EXPECT_GT(current, 0);
  EXPECT_GE(peak, current);
}

TEST(FitLinear, RecoversAnExactLine) {
  const std::vector<double> x = {4096, 65536, 1 << 20, 4 << 20};
  std::vector<double> t;
  for (double b : x) t.push_back(2e-5 + 1e-10 * b);
  const LinearFit f = fit_linear(x, t);
  EXPECT_NEAR(f.alpha_s, 2e-5, 1e-12);
  EXPECT_NEAR(f.beta_s_per_byte, 1e-10, 1e-17);
  EXPECT_NEAR(f.rms_rel_error, 0, 1e-9);
}

TEST(FitLinear, HoldsANegativeInterceptAtZero) {
  // The free fit is t = -8.3e-6 + 9.3e-10 x; with alpha >= 0 the best line goes through 0.
  const std::vector<double> x = {1e4, 2e4, 4e4}, t = {1e-6, 1e-5, 3e-5};
  const LinearFit f = fit_linear(x, t);
  EXPECT_EQ(f.alpha_s, 0);
  EXPECT_GT(f.beta_s_per_byte, 0);
  EXPECT_TRUE(std::isfinite(f.rms_rel_error));
}

TEST(FitLinear, NeedsTwoSizes) {
  EXPECT_THAT(error_of([] { fit_linear({4096, 4096}, {1e-5, 2e-5}); }),
              HasSubstr("error: fit_linear given 2 sizes and 2 times; it needs one time per size and at least two "
                        "different sizes"));
  EXPECT_THAT(error_of([] { fit_linear({1, 2}, {1e-5}); }), HasSubstr("given 2 sizes and 1 times"));
}

class CollectiveFit : public ::testing::TestWithParam<std::tuple<int, CollectiveKind>> {};

INSTANTIATE_TEST_SUITE_P(Ranks, CollectiveFit,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::ValuesIn(kCollectiveKinds)),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "ranks_" +
                                  collective_kind_name(std::get<1>(info.param));
                         });

TEST_P(CollectiveFit, IsFiniteNonNegativeAndTheSameOnEveryRank) {
  const auto [n, kind] = GetParam();
  std::vector<LinearFit> fits(static_cast<size_t>(n));
  expect_no_errors(run_ranks(n, 30, [&](Communicator& c) {
    fits[static_cast<size_t>(c.rank())] = measure_collective(c, kind, {4 << 10, 64 << 10, 256 << 10}, 3);
  }));
  const LinearFit& f = fits[0];
  std::printf("%s on %d in-process ranks: alpha %.3g s, beta %.3g s/byte, rms relative error %.2f\n",
              collective_kind_name(kind), n, f.alpha_s, f.beta_s_per_byte, f.rms_rel_error);
  for (int r = 0; r < n; ++r) {
    const LinearFit& g = fits[static_cast<size_t>(r)];
    EXPECT_TRUE(std::isfinite(g.alpha_s) && std::isfinite(g.beta_s_per_byte) && std::isfinite(g.rms_rel_error))
        << "rank " << r;
    EXPECT_GE(g.alpha_s, 0) << "rank " << r;
    EXPECT_GE(g.beta_s_per_byte, 0) << "rank " << r;
    EXPECT_GE(g.rms_rel_error, 0) << "rank " << r;
    // Bitwise: every rank fits the same gathered timings.
    EXPECT_EQ(g.alpha_s, f.alpha_s) << "rank " << r;
    EXPECT_EQ(g.beta_s_per_byte, f.beta_s_per_byte) << "rank " << r;
    EXPECT_EQ(g.rms_rel_error, f.rms_rel_error) << "rank " << r;
  }
}

TEST(CollectiveFitErrors, RepsBelowOne) {
  expect_no_errors(run_ranks(2, 5, [](Communicator& c) {
    EXPECT_THAT(error_of([&] { measure_collective(c, CollectiveKind::AllReduce, {4096, 8192}, 0); }),
                HasSubstr("error: measure_collective(all_reduce) with reps 0.\nlegal: reps >= 1."));
  }));
}

TEST(CollectiveFitErrors, NegativeSize) {
  expect_no_errors(run_ranks(2, 5, [](Communicator& c) {
    EXPECT_THAT(error_of([&] { measure_collective(c, CollectiveKind::AllGather, {4096, -8}, 2); }),
                HasSubstr("error: measure_collective(all_gather) given a size of -8 bytes.\nlegal: bytes >= 0."));
  }));
}

TEST(CollectiveFitErrors, SizesThatRoundToOne) {
  // 4096 and 4100 bytes over 4 ranks: both are 256 floats per block.
  expect_no_errors(run_ranks(4, 5, [](Communicator& c) {
    const std::string e = error_of([&] { measure_collective(c, CollectiveKind::AllToAll, {4096, 4100}, 2); });
    EXPECT_THAT(e, HasSubstr("error: measure_collective(all_to_all) needs at least two different sizes"));
    EXPECT_THAT(e, HasSubstr("got 2 size(s) of 4096 bytes (after rounding to 4 equal f32 blocks)"));
    EXPECT_THAT(e, HasSubstr("fix: pass sizes that differ"));
  }));
}

TEST(Bandwidth, IsPositive) {
  const double bw = measure_memory_bandwidth_bytes_per_s(2);
  std::printf("triad bandwidth with 2 threads: %.2f GB/s\n", bw / 1e9);
  EXPECT_TRUE(std::isfinite(bw));
  EXPECT_GT(bw, 0);
}

TEST(Bandwidth, ThreadsBelowOne) {
  EXPECT_THAT(error_of([] { measure_memory_bandwidth_bytes_per_s(0); }),
              HasSubstr("error: measure_memory_bandwidth_bytes_per_s(0) needs at least one thread.\nlegal: threads >= 1"));
}

void expect_machine_fields(const nlohmann::json& m, int ranks, int threads) {
  EXPECT_TRUE(m["cpu"].is_string() && !m["cpu"].get<std::string>().empty()) << m.dump();
  EXPECT_GE(m["cores"].get<int>(), 1);
  EXPECT_EQ(m["threads_per_rank"].get<int>(), threads);
  EXPECT_EQ(m["ranks"].get<int>(), ranks);
  EXPECT_GT(m["memory_bandwidth_bytes_per_s"].get<double>(), 0);
  EXPECT_GT(m["process_baseline_bytes"].get<int64_t>(), 0);
}

TEST(CalibrateMachine, OneRankHasNoCollectives) {
  const nlohmann::json m = calibrate_machine(nullptr, 1);
  std::printf("%s\n", m.dump().c_str());
  expect_machine_fields(m, 1, 1);
  EXPECT_FALSE(m.contains("collectives"));
}

TEST(CalibrateMachine, TwoRanksAgreeOnEverythingButTheirBaseline) {
  std::vector<nlohmann::json> got(2);
  expect_no_errors(run_ranks(2, 60, [&](Communicator& c) { got[static_cast<size_t>(c.rank())] = calibrate_machine(&c, 1); }));
  std::printf("%s\n", got[0].dump().c_str());
  for (int r = 0; r < 2; ++r) {
    nlohmann::json m = got[static_cast<size_t>(r)];
    expect_machine_fields(m, 2, 1);
    for (CollectiveKind k : kCollectiveKinds) {
      const char* kind = collective_kind_name(k);
      ASSERT_TRUE(m["collectives"].contains(kind)) << m.dump();
      EXPECT_GE(m["collectives"][kind]["alpha_s"].get<double>(), 0);
      EXPECT_GE(m["collectives"][kind]["beta_s_per_byte"].get<double>(), 0);
    }
    nlohmann::json mine = m, first = got[0];
    mine.erase("process_baseline_bytes");
    first.erase("process_baseline_bytes");
    EXPECT_EQ(mine, first) << "rank " << r;
  }
}

TEST(DescribePlan, PrintsEveryPrediction) {
  // In the generator's order, not sorted.
  const auto plan = nlohmann::ordered_json::parse(
      R"({"predicted_peak_bytes_per_rank": 43200000, "predicted_step_s": 0.0521,
          "memory_per_rank": {"params": 3250585, "arena": 21495808}, "other": "ignored"})");
  EXPECT_EQ(describe_plan(plan),
            "plan: predicted peak 41.2 MiB per rank (params: 3.1, arena: 20.5), predicted step 0.0521 s");
}

TEST(DescribePlan, LeavesOutMissingKeys) {
  EXPECT_EQ(describe_plan(nlohmann::ordered_json::parse(R"({"predicted_step_s": 12.5})")), "plan: predicted step 12.5 s");
  EXPECT_EQ(describe_plan(nlohmann::ordered_json::parse(R"({"predicted_peak_bytes_per_rank": 1048576})")),
            "plan: predicted peak 1.0 MiB per rank");
  EXPECT_EQ(describe_plan(nlohmann::ordered_json::parse(R"({"memory_per_rank": {"arena": 2097152}})")),
            "plan: predicted memory per rank in MiB (arena: 2.0)");
  EXPECT_EQ(describe_plan(nlohmann::ordered_json::parse(R"({"schedule": "ulysses"})")), "");
  EXPECT_EQ(describe_plan(nlohmann::ordered_json::object()), "");
}

TEST(DescribePlan, NamesAKeyThatIsNotANumber) {
  EXPECT_THAT(error_of([] { describe_plan(nlohmann::ordered_json::parse(R"({"predicted_step_s": "fast"})")); }),
              HasSubstr("error: the plan's \"predicted_step_s\" is \"fast\", not a number."));
  EXPECT_THAT(error_of([] { describe_plan(nlohmann::ordered_json::parse(R"({"memory_per_rank": [1, 2]})")); }),
              HasSubstr("error: the plan's \"memory_per_rank\" is [1,2], not an object."));
}

TEST(DescribeSchedule, SaysWhatIsRecomputedAndWhyAutoSPChoseIt) {
  const auto plan = nlohmann::ordered_json::parse(R"json({
    "schedule": "autosp",
    "schedule_spec": {"mesh": {"dp": 1, "sp": 4, "zero": 1}, "attention": [{"match": "*", "strategy": "ulysses"}],
                      "loss_seq_tile": 128,
                      "values": [{"match": "op:silu", "compute": "inline"},
                                 {"match": "model.layers.*.mlp.gate_proj op:contract", "keep": "save"},
                                 {"match": "model.layers.*.mlp.gate_proj op:contract", "keep": "recompute"},
                                 {"match": "model.layers.*.self_attn op:attention", "keep": "save"},
                                 {"match": "lm_head op:contract", "keep": "recompute"},
                                 {"match": "model.norm op:rms_norm", "keep": "save"},
                                 {"match": "model.norm op:mul", "keep": "recompute"}]},
    "autosp": {"ranks": 4, "memory_per_rank_bytes": 125829120, "plans_scored": 80, "seconds": 0.3,
               "one_rank_peak_bytes": {"default": 477102080, "checkpoint": 277872640},
               "rejected": [{"what": "ulysses at sp=2 (dp=2)", "reason": "181.0 MiB > 120.0 MiB per rank"}]}})json");
  EXPECT_EQ(describe_schedule(plan),
            "schedule \"autosp\": mesh dp=1 x sp=4, ZeRO-1; attention ulysses; sequence tiles: loss 128 tokens\n"
            "  recomputed in the backward: mlp.gate_proj, lm_head\n"
            "  partly recomputed: model.norm\n"
            "  kept from the forward: self_attn\n"
            "  chosen by AutoSP for 4 ranks x 120.0 MiB (80 plans scored in 0.3 s); one rank alone would need "
            "455.0 MiB saving everything, 265.0 MiB with every layer checkpointed\n"
            "  rejected: ulysses at sp=2 (dp=2): 181.0 MiB > 120.0 MiB per rank\n");
  EXPECT_EQ(describe_schedule(nlohmann::ordered_json::parse(R"({"schedule": "default"})")), "");
  EXPECT_THAT(describe_schedule(nlohmann::ordered_json::parse(
                  R"({"schedule": "s", "schedule_spec": {"seq_tile": 512, "loss_seq_tile": 64}})")),
              HasSubstr("sequence tiles: mlp 512 tokens, loss 64 tokens\n"));
  // Sequence tiles: the rule for every tile, then AutoSP's per module.
  auto tiled = [](const std::string& groups) {
    return describe_schedule(nlohmann::ordered_json::parse(
        R"({"schedule": "autosp", "schedule_spec": {"seq_tile": 64, "values": [)"
        R"({"match": "model.layers.*.self_attn op:attention", "keep": "save"},)"
        R"({"match": "seq_tiles", "keep": "recompute"})" + groups + "]}}"));
  };
  EXPECT_EQ(tiled(""), "schedule \"autosp\": ; attention on one rank; sequence tiles: mlp and loss 64 tokens\n"
                       "  recomputed in the backward: sequence tiles\n"
                       "  kept from the forward: self_attn\n");
  EXPECT_EQ(tiled(R"(, {"match": "model.layers.*.mlp.up_proj op:contract seq_tiles", "keep": "recompute"},)"
                  R"( {"match": "lm_head op:contract seq_tiles", "keep": "save"})"),
            "schedule \"autosp\": ; attention on one rank; sequence tiles: mlp and loss 64 tokens\n"
            "  recomputed in the backward: mlp.up_proj tiles\n"
            "  kept from the forward: self_attn, lm_head tiles\n");
}

}  // namespace
}  // namespace halyard::runtime
