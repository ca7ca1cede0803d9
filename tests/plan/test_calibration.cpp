// Fitting the time model to measured kernel calls (schedules/calibration.h):
// the fit recovers known coefficients, and a real step's profile pairs with
// every kernel stage of the plan that built its library, checkpointed
// (stages recomputed in the backward) or not. halyard-fit-kernels
// (tests/plan/fit_kernels_check.sh) and halyard-calibrate build on these.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "dsl/error.h"
#include "examples/llama/llama_builder.h"
#include "llama_micro_checkpoint.h"
#include "runtime/attention_cpu.h"
#include "runtime/model.h"
#include "runtime/scratch.h"
#include "schedules/calibration.h"
#include "schedules/plan.h"
#include "tiny_sp1_s128.h"

namespace halyard {
namespace {

std::string read(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(Calibration, FitRecoversTheCoefficients) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> flops(1e6, 1e10), bytes(1e4, 1e8);
  for (const KernelCoefficients want : {KernelCoefficients{2e-12, 5e-10, 7e-6}, KernelCoefficients{0, 1e-9, 3e-6},
                                        KernelCoefficients{1e-11, 0, 0}}) {
    std::vector<KernelSample> s;
    for (int i = 0; i < 40; ++i) {
      KernelSample x{flops(rng), bytes(rng), 0};
      x.t = want.s_per_flop * x.flops + want.s_per_byte * x.bytes + want.s_per_call;
      s.push_back(x);
    }
    double err = 1;
    const KernelCoefficients got = fit_kernel(s, &err);
    EXPECT_LT(err, 1e-9);
    EXPECT_NEAR(got.s_per_flop, want.s_per_flop, 1e-6 * want.s_per_flop + 1e-20);
    EXPECT_NEAR(got.s_per_byte, want.s_per_byte, 1e-6 * want.s_per_byte + 1e-20);
    EXPECT_NEAR(got.s_per_call, want.s_per_call, 1e-6 * want.s_per_call + 1e-15);
  }
}

// How far behind the other ranks are at a collective: the time the steps
// stood still beyond the plan, over every lag they waited for together.
TEST(Calibration, TheLagAccountsForWhatTheStepsStoodStillBeyondThePlan) {
  EXPECT_DOUBLE_EQ(fit_collective_lag({{0.05, 0.01, 10}, {0.02, 0.01, 5}}), (0.04 + 0.01) / 15);
  EXPECT_DOUBLE_EQ(fit_collective_lag({{0.01, 0.02, 10}}), 0) << "steps faster than planned lag no rank";
  EXPECT_DOUBLE_EQ(fit_collective_lag({{0.30, 0.01, 0}}), 0) << "one rank waits for no other";
  EXPECT_DOUBLE_EQ(fit_collective_lag({}), 0);
}

// A cluster file that lists only some kinds prices a missing one as the
// kind doing its work, as halyard-calibrate fills it in; only a kind with
// no stand-in falls back to the pointwise kernels' coefficients.
TEST(Calibration, AKindAClusterFileLacksIsPricedAsItsStandIn) {
  const Cluster c = Cluster::parse(R"({"name": "partial", "kernels": {
      "attention": {"s_per_flop": 3e-11}, "attention_grad_kv": {"s_per_flop": 5e-11},
      "contract": {"s_per_flop": 2e-11, "s_per_byte": 1e-10}, "pointwise": {"s_per_byte": 4e-10}}})",
                                   "partial");
  for (const auto& [kind, like] : std::vector<std::pair<std::string, std::string>>{
           {"attention_lse", "attention"}, {"attention_grad_q", "attention_grad_kv"}, {"contract_seq", "contract"},
           {"norm", "pointwise"}, {"copy", "pointwise"}}) {
    EXPECT_EQ(c.kernel_time(kind, 1e9, 1e6), c.kernel_time(like, 1e9, 1e6)) << kind;
  }
  EXPECT_GT(c.kernel_time("attention_lse", 1e9, 1e6), 10 * c.kernel_time("pointwise", 1e9, 1e6))
      << "a log-sum-exp costs its FLOPs, not only its bytes";
}

void train_step(runtime::Model& m, int64_t seq) {
  const int64_t n = m.tokens();
  std::vector<int32_t> ids(static_cast<size_t>(n)), labels(ids.size()), pos(ids.size());
  for (int64_t t = 0; t < n; ++t) {
    ids[static_cast<size_t>(t)] = static_cast<int32_t>(t % 7);
    labels[static_cast<size_t>(t)] = static_cast<int32_t>((t + 1) % 7);
    pos[static_cast<size_t>(t)] = static_cast<int32_t>(t % seq);
  }
  m.train_step(ids.data(), labels.data(), pos.data());
}

// Calls of one shape (the attention of every layer at one length) cannot
// tell FLOPs from bytes from calls: the fit charges the FLOPs, which carries
// to other lengths. Before, rounding chose, and some runs of
// halyard-calibrate charged the attention per call, the same at any length.
TEST(Calibration, CallsOfOneShapeAreChargedByTheirFlops) {
  int charged_otherwise = 0;
  for (int i = 0; i < 400; ++i) {
    const double flops = 1e8 * (1 + i % 20), t1 = 0.01 * (1 + i % 7), t2 = t1 * (0.95 + 0.1 * (i / 20) / 20);
    const std::vector<KernelSample> s = {{flops, 2e6, t1}, {flops, 2e6, t2}};
    double err = 1;
    const KernelCoefficients k = fit_kernel(s, &err);
    if (!(k.s_per_flop > 0 && k.s_per_byte == 0 && k.s_per_call == 0)) ++charged_otherwise;
    EXPECT_NEAR(k.s_per_flop * flops + k.s_per_byte * 2e6 + k.s_per_call, (t1 + t2) / 2, 0.05 * t1) << i;
  }
  EXPECT_EQ(charged_otherwise, 0) << "of 400 pairs of calls";
}

// One profiled step of `spec`, paired with the plan the generator wrote.
void check_pairs(const runtime::ModelSpec& spec, const std::string& plan_path) {
  setenv("HALYARD_PROFILE", "1", 1);
  runtime::Model m(spec);
  m.init_params(1);
  train_step(m, spec.seq);
  const std::string plan = read(plan_path), profile = m.profile();
  const auto samples = pair_profile(plan, profile, spec.name);
  size_t paired = 0;
  double held = 0;
  for (const auto& [kind, calls] : samples) {
    paired += calls.size();
    for (const KernelSample& x : calls) {
      EXPECT_GT(x.t, 0) << kind;
      EXPECT_GT(x.bytes, 0) << kind;
      held = std::max(held, x.scratch);
    }
  }
  // The most scratch any call held, as the profile's lines state it.
  double most = 0;
  for (size_t at = profile.find("  scratch "); at != std::string::npos; at = profile.find("  scratch ", at + 1))
    most = std::max(most, std::atof(profile.c_str() + at + 10));
  EXPECT_GT(most, 0);
  EXPECT_EQ(held, most);
  EXPECT_EQ(paired, nlohmann::json::parse(plan)["stages"].size()) << spec.name;
  EXPECT_GT(samples.count("contract"), 0u);
  EXPECT_GT(samples.count("attention"), 0u);
  std::printf("  %s: %zu calls paired over %zu kinds\n", spec.name, paired, samples.size());
}

TEST(Calibration, AStepsProfilePairsWithEveryStageOfItsPlan) {
  check_pairs(halyard_models::tiny_sp1_s128(), HALYARD_TEST_BINARY_DIR "/tiny_sp1_s128.generated/tiny_sp1_s128.plan.json");
  check_pairs(halyard_models::llama_micro_checkpoint(),
              HALYARD_TEST_BINARY_DIR "/llama_micro_checkpoint.generated/llama_micro_checkpoint.plan.json");
}

// What the threads' scratch stacks keep over a step (runtime/scratch.h) is
// what the plan counts as kernel scratch on a rank of 2 threads: the calling
// thread's deepest kernel plus the most one task holds on the other thread.
// The plan sizes the library kernels' blocks for the largest host (an L2 of
// 2 MiB, AVX-512), so a host with less keeps less; it leaves out Halide's
// per-task blocks of a few KiB and the stacks' 128-byte headers, which only
// a model as small as llama_micro notices (1% there). Whether the other
// thread runs any task is the pool's choice: on a loaded machine (ctest -j2)
// the calling thread ran them all in some runs and kept 390 of 755 KiB. So
// the least it must keep is half of what a rank of one thread holds (each
// kernel's shared blocks and one task's, on whichever threads) with the
// attention blocks this host's kernels take: on a Zen 3 (an L2 of 512 KiB,
// 128 queries a block) llama_micro kept 173 KiB, under half of the 353 KiB
// counted at 256 queries.
TEST(Calibration, TheThreadsKeepTheScratchThePlanCounts) {
  if (!runtime::scratch::stacks_enabled()) GTEST_SKIP() << "this build serves kernel scratch from malloc (ASan)";
  Cluster two = Cluster::named("local-cpu");
  two.ranks = two.ranks_per_node = 1;
  two.cores_per_node = 2;
  Cluster one = two;
  one.cores_per_node = 1;
  runtime::Model::set_num_threads(2);
  for (const runtime::ModelSpec& spec : {halyard_models::tiny_sp1_s128(), halyard_models::llama_micro_checkpoint()}) {
    unsetenv("HALYARD_PROFILE");
    runtime::Model m(spec);
    m.init_params(1);
    train_step(m, spec.seq);  // the threads and their stacks exist
    runtime::scratch::trim();
    train_step(m, spec.seq);
    const int64_t kept = runtime::scratch::resident();
    const nlohmann::json summary = nlohmann::json::parse(spec.plan_json);
    const ModelRequest ms{summary.at("config").get<std::string>(), spec.batch, spec.seq};
    const Schedule sched = Schedule::parse(summary.at("schedule_spec").dump(), spec.name);
    Schedule here = sched;
    if (here.kernel_tiles.attention_queries == 0)
      here.kernel_tiles.attention_queries = runtime::attention_cpu::default_query_block();
    const Plan p = plan(llama::llama_builder(), ms, sched, two), p1 = plan(llama::llama_builder(), ms, here, one);
    std::printf("  %s: the stacks kept %.1f KiB; the plan counts %.1f KiB on 2 threads, %.1f KiB on one at %d queries a block\n",
                spec.name, kept / 1024.0, p.memory.kernel_scratch / 1024.0, p1.memory.kernel_scratch / 1024.0,
                here.kernel_tiles.attention_queries);
    EXPECT_LE(kept, p.memory.kernel_scratch * 21 / 20) << spec.name;
    EXPECT_GE(kept, p1.memory.kernel_scratch / 2) << spec.name;
  }
}

TEST(Calibration, AProfileOfAnotherLibraryIsAClearError) {
  const std::string plan = read(HALYARD_TEST_BINARY_DIR "/tiny_sp1_s128.generated/tiny_sp1_s128.plan.json");
  try {
    pair_profile(plan, "  0.5 ms  other_k0  embedding %4 model.embed_tokens\n", "other.profile.txt");
    FAIL() << "expected an error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("other.profile.txt: the profile has no call of stage"), std::string::npos) << e.what();
  }
  try {
    pair_profile(R"({"schedule": "default"})", "", "summary.json");
    FAIL() << "expected an error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("the plan has no \"stages\""), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace halyard
