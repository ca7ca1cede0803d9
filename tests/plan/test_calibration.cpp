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
#include "llama_micro_checkpoint.h"
#include "runtime/model.h"
#include "schedules/calibration.h"
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

// One profiled step of `spec`, paired with the plan the generator wrote.
void check_pairs(const runtime::ModelSpec& spec, const std::string& plan_path) {
  setenv("HALYARD_PROFILE", "1", 1);
  runtime::Model m(spec);
  m.init_params(1);
  const int64_t n = m.tokens();
  std::vector<int32_t> ids(static_cast<size_t>(n)), labels(ids.size()), pos(ids.size());
  for (int64_t t = 0; t < n; ++t) {
    ids[static_cast<size_t>(t)] = static_cast<int32_t>(t % 7);
    labels[static_cast<size_t>(t)] = static_cast<int32_t>((t + 1) % 7);
    pos[static_cast<size_t>(t)] = static_cast<int32_t>(t % spec.seq);
  }
  m.train_step(ids.data(), labels.data(), pos.data());
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
