// The collectives of a step program as plans (runtime/collectives.h), run on
// host memory over 1, 2 and 4 in-process ranks, against their layouts
// written out index by index (tests/collective_checks.h, which
// test_cuda_sim runs on device memory over NCCL): Ulysses' all-to-alls
// both ways (heads split over the ranks, and kv heads fewer than the ranks,
// replicated there and summed on the way back), the gather of token
// positions, and the sum over ranks; batch 1 (messages landing in place) and
// batch 2 (rows through the staging area).
#include "runtime/collectives.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "tests/collective_checks.h"
#include "tests/in_process_ranks.h"
#include "tests/runtime_error_of.h"

namespace halyard::runtime {
namespace {

using halyard::testing::error_of;
using halyard::testing::run_ranks;
using ::testing::HasSubstr;

namespace checks = halyard::testing::collective_checks;
using checks::spec;
using checks::value;

// In-process ranks, each with host memory.
std::vector<std::string> on_host(int p, const std::function<void(Communicator&, CollectiveMemory&)>& fn) {
  return run_ranks(p, 10, [&](Communicator& comm) {
    HostCollectiveMemory memory;
    fn(comm, memory);
  });
}

HALYARD_COLLECTIVE_CHECKS(Collectives, on_host)

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
