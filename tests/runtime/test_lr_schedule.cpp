// The warmup + cosine learning-rate schedule and the per-rank thread count.
#include <gtest/gtest.h>

#include <cstdlib>

#include "runtime/lr_schedule.h"

namespace halyard::runtime {
namespace {

TEST(LrSchedule, WarmupThenCosineToTheFloor) {
  EXPECT_DOUBLE_EQ(warmup_cosine_lr(1, 100, 10, 1.0), 0.1);
  EXPECT_DOUBLE_EQ(warmup_cosine_lr(10, 100, 10, 1.0), 1.0);
  EXPECT_NEAR(warmup_cosine_lr(55, 100, 10, 1.0), 0.55, 1e-12);  // halfway: (1 + 0.1) / 2
  EXPECT_NEAR(warmup_cosine_lr(100, 100, 10, 1.0), 0.1, 1e-12);
  EXPECT_NEAR(warmup_cosine_lr(150, 100, 10, 1.0), 0.1, 1e-12);  // past the end: stays at the floor
  EXPECT_DOUBLE_EQ(warmup_cosine_lr(1, 1, 0, 2.0), 0.2);         // no warmup, one step: the floor
}

TEST(LrSchedule, ThreadsShareTheCoresAmongLocalRanks) {
  unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int all = default_threads_per_rank();
  EXPECT_GE(all, 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1000", 1);
  EXPECT_EQ(default_threads_per_rank(), 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1", 1);
  EXPECT_EQ(default_threads_per_rank(), all);
  unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
}

}  // namespace
}  // namespace halyard::runtime
