// Sequence parallelism of the Qwen2 example over in-process ranks (threads):
// Ulysses on 2 ranks, and on 4 ranks (kv_heads 2 fewer than ranks, a
// sequence of 126 that 4 does not divide, activation checkpointing, MLP and
// loss in sequence tiles), give the single-rank loss and every gradient
// within 1e-5 relative. The q/k/v bias gradients sum over the tokens of
// each rank and are completed by the step's gradient all-reduce, like every
// weight gradient; this is where that is checked.
#include <gtest/gtest.h>

#include <cstdio>

#include "qwen2_sp1_s126.h"
#include "qwen2_sp1_s128.h"
#include "qwen2_sp2_s128.h"
#include "qwen2_sp4_s126_tiled.h"
#include "tests/generators/sp_check.h"
#include "tests/in_process_ranks.h"

namespace halyard {
namespace {

constexpr double kTolerance = 1e-5;

void expect_equivalent(const runtime::ModelSpec& reference, const runtime::ModelSpec& sharded, int ranks) {
  ASSERT_EQ(sharded.sp, ranks);
  ASSERT_EQ(reference.seq, sharded.seq);
  const sp_check::StepResult ref = sp_check::run_step(reference, nullptr);
  auto comms = runtime::make_in_process_group(ranks, 120);
  std::vector<sp_check::StepResult> got(static_cast<size_t>(ranks));
  const std::vector<std::string> errors = halyard::testing::run_threads(ranks, [&](int r) {
    got[static_cast<size_t>(r)] = sp_check::run_step(sharded, comms[static_cast<size_t>(r)].get());
  });
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    const auto& g = got[static_cast<size_t>(r)];
    ASSERT_EQ(g.grads.size(), ref.grads.size());
    const sp_check::Comparison c = sp_check::compare(sharded, g, ref);
    double worst_bias = 0;
    int biases = 0;
    for (size_t i = 0; i < ref.grads.size(); ++i)
      if (std::string(sharded.params[i].name).find("_proj.bias") != std::string::npos)
        worst_bias = std::max(worst_bias, sp_check::rel_error(g.grads[i], ref.grads[i])), ++biases;
    std::printf("%s rank %d/%d: loss %.9g vs %.9g (rel %.2e), forward %.2e, worst gradient %.2e (%s), "
                "worst q/k/v bias gradient %.2e\n",
                sharded.name, r, ranks, g.loss, ref.loss, c.loss, c.forward_loss, c.worst_grad, c.worst_param.c_str(),
                worst_bias);
    EXPECT_LE(c.loss, kTolerance) << "rank " << r;
    EXPECT_LE(c.forward_loss, kTolerance) << "rank " << r;
    EXPECT_LE(c.worst_grad, kTolerance) << "rank " << r << " " << c.worst_param;
    EXPECT_EQ(biases, 6) << "q/k/v biases of 2 layers";
    EXPECT_EQ(g.grads, got[0].grads) << "rank " << r << ": ranks hold different gradients";
  }
}

TEST(Qwen2SequenceParallel, TwoRanksBatchTwoMatchOneRank) {
  expect_equivalent(halyard_models::qwen2_sp1_s128(), halyard_models::qwen2_sp2_s128(), 2);
}

TEST(Qwen2SequenceParallel, FourRanksPaddedCheckpointedAndTiledMatchOneRank) {
  ASSERT_NE(halyard_models::qwen2_sp4_s126_tiled().seq % 4, 0);
  expect_equivalent(halyard_models::qwen2_sp1_s126(), halyard_models::qwen2_sp4_s126_tiled(), 4);
}

}  // namespace
}  // namespace halyard
