// GoogleTest under mpirun: rank 0 prints as usual, the other ranks print only
// their failed assertions, each prefixed with the rank.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>

namespace halyard::testing {

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.message());
  }

 private:
  int rank_;
};

// Call after InitGoogleTest: quiets every rank but rank 0.
inline void print_failures_only_off_rank_zero(int rank) {
  if (rank == 0) return;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new FailurePrinter(rank));
}

}  // namespace halyard::testing
