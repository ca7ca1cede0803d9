// The NCCL communicator (runtime/comm_nccl.cpp, compiled as for GPUs), the
// collectives on device memory (runtime/collectives_cuda.cpp) and the
// offload copies' stream (CudaCopyStream, runtime/cuda_context.h) over a
// simulated CUDA runtime, driver, cuBLAS and NCCL (tests/runtime/cuda_sim.cpp),
// ranks as threads, each on a device of its own: their multi-rank logic
// checked on any machine. GPU nodes have one GPU and no MPI, so this is where
// NCCL's groupings, offsets, splits, background work, stream ordering and
// watchdog run with more than one rank. It runs the same contract as
// test_comm_nccl (tests/nccl_contract.h) on 1, 2 and 4 ranks; what only
// threads can arrange: a compute stream to order after, and ranks that never
// arrive (suite NcclSimFaults, label "faults"); and the step's collectives
// as a CUDA model over NCCL runs them (suite DeviceCollectivesSim): the plans
// of tests/collective_checks.h, and the gradient sums moved in bf16 with the
// collectives' kernels (emulated), against the host's bits; and the offload
// copies' ordering against the compute stream (suite CudaCopyStreamSim).
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/collectives.h"
#include "runtime/comm.h"
#include "runtime/comm_nccl_open.h"
#include "runtime/cuda_context.h"
#include "runtime/error.h"
#include "tests/collective_checks.h"
#include "tests/cuda_sim.h"
#include "tests/device_buffer.h"
#include "tests/in_process_ranks.h"
#include "tests/nccl_contract.h"
#include "tests/runtime_error_of.h"

namespace halyard::testing {
void register_emulated_collectives_kernels();  // (cuda_sim_kernels.cpp)
}  // namespace halyard::testing

namespace halyard::runtime {
namespace {

using ::testing::HasSubstr;
using halyard::testing::DeviceBuffer;
using halyard::testing::expect_no_errors;
namespace contract = halyard::testing::nccl_contract;

// fn on n ranks, rank r on simulated device devices[r] (r by default), each
// with its own NCCL communicator made as make_nccl_communicator makes it
// (one id for all, then open_nccl on the rank's device).
std::vector<std::string> run_nccl_ranks(int n, double timeout_s, const std::function<void(Communicator&)>& fn,
                                        std::vector<int> devices = {}) {
  for (int r = static_cast<int>(devices.size()); r < n; ++r) devices.push_back(r);
  ncclUniqueId id{};
  EXPECT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  return halyard::testing::run_threads(n, [&](int r) {
    halyard::testing::cuda_ok(cudaSetDevice(devices[static_cast<size_t>(r)]), "cudaSetDevice");
    auto c = unopened_nccl_communicator(r, n, timeout_s, nullptr);
    open_nccl(*c, devices[static_cast<size_t>(r)], id);
    fn(*c);
  });
}

// A communicator's calls on a stream of their own, after `compute`'s work
// (use_streams), for the scope; at its end `compute` has finished and the
// communicator is unbound. (`compute` null: a new stream, also the scope's.)
class BoundStreams {
 public:
  BoundStreams(Communicator& c, cudaStream_t compute) : c_(c), compute_(compute) {
    if (!compute_) compute_ = made_ = make();
    own_ = make();
    c_.use_streams(own_, compute_);
  }
  ~BoundStreams() {
    cudaStreamSynchronize(compute_);
    c_.use_streams(nullptr, nullptr);
    cudaStreamDestroy(own_);
    if (made_) cudaStreamDestroy(made_);
  }
  BoundStreams(const BoundStreams&) = delete;
  BoundStreams& operator=(const BoundStreams&) = delete;
  cudaStream_t compute() const { return compute_; }

 private:
  static cudaStream_t make() {
    cudaStream_t s = nullptr;
    halyard::testing::cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return s;
  }
  Communicator& c_;
  cudaStream_t compute_, made_ = nullptr, own_ = nullptr;
};

// Every address counts as device memory for the scope (tests/cuda_sim.h).
struct HostCountsAsDevice {
  HostCountsAsDevice() { halyard::testing::treat_host_memory_as_device(true); }
  ~HostCountsAsDevice() { halyard::testing::treat_host_memory_as_device(false); }
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

class NcclSim : public ::testing::TestWithParam<int> {};

INSTANTIATE_TEST_SUITE_P(Ranks, NcclSim, ::testing::Values(1, 2, 4), [](const auto& info) {
  return std::to_string(info.param) + "ranks";
});

TEST_P(NcclSim, AllToAllVMovesUnevenBlocksAndCountsBytes) {
  expect_no_errors(run_nccl_ranks(GetParam(), 10, contract::all_to_all_v_moves_uneven_blocks_and_counts_bytes));
}

TEST_P(NcclSim, AllReduceSumOnDeviceAndHostValues) {
  expect_no_errors(run_nccl_ranks(GetParam(), 10, contract::all_reduce_sum_on_device_and_host_values));
}

TEST_P(NcclSim, AllGatherPutsRankPAtOffsetPTimesN) {
  expect_no_errors(run_nccl_ranks(GetParam(), 10, contract::all_gather_puts_rank_p_at_offset_p_times_n));
}

TEST_P(NcclSim, ReduceScatterSumGivesEachRankItsBlock) {
  expect_no_errors(run_nccl_ranks(GetParam(), 10, contract::reduce_scatter_sum_gives_each_rank_its_block));
}

TEST_P(NcclSim, SendRecvBetweenPairsInCallOrder) {
  if (GetParam() % 2 != 0) GTEST_SKIP() << "pairs need an even number of ranks";
  expect_no_errors(run_nccl_ranks(GetParam(), 10, contract::send_recv_between_pairs_in_call_order));
}

TEST_P(NcclSim, HostBufferIsAUserMistakeAndLeavesTheCommunicatorUsable) {
  expect_no_errors(
      run_nccl_ranks(GetParam(), 10, contract::host_buffer_is_a_user_mistake_and_leaves_the_communicator_usable));
}

// Ring attention's passes: several in flight on one stream at once, each a
// grouped send and receive, finished in another order than they started.
TEST_P(NcclSim, RingPassesInFlightTogetherEachGetTheirBlock) {
  const int n = GetParam();
  if (n == 1) GTEST_SKIP() << "a single rank has no peer";
  expect_no_errors(run_nccl_ranks(n, 10, [&](Communicator& c) {
    const int r = c.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
    DeviceBuffer<float> k(std::vector<float>{1.0f * r, 2.0f * r}), v(std::vector<float>{-3.0f * r});
    DeviceBuffer<int32_t> pos(std::vector<int32_t>{r, r + 10, r + 20});
    DeviceBuffer<float> got_k(2), got_v(1);
    DeviceBuffer<int32_t> got_pos(3);
    auto ek = c.start_exchange(k.get(), got_k.get(), 2, next, prev, 11);
    auto ev = c.start_exchange(v.get(), got_v.get(), 1, next, prev, 12);
    auto ep = c.start_exchange(pos.get(), got_pos.get(), 3, next, prev, 13);
    ep->wait();
    ek->wait();
    ev->wait();
    EXPECT_EQ(got_k.host(), (std::vector<float>{1.0f * prev, 2.0f * prev}));
    EXPECT_EQ(got_v.host(), (std::vector<float>{-3.0f * prev}));
    EXPECT_EQ(got_pos.host(), (std::vector<int32_t>{prev, prev + 10, prev + 20}));
    EXPECT_EQ(c.p2p_bytes_sent(), (2 + 1 + 3) * 4);
  }));
}

// Gradient buckets: sums queued in the background, a blocking call between,
// each finished by its wait().
TEST_P(NcclSim, SumsStartedEarlyFinishAtTheirWait) {
  const int n = GetParam();
  expect_no_errors(run_nccl_ranks(n, 10, [&](Communicator& c) {
    const float r = static_cast<float>(c.rank());
    DeviceBuffer<float> a(std::vector<float>{r, 1.f}), b(std::vector<float>{2 * r});
    auto sa = c.start_all_reduce_sum(a.get(), 2);
    auto sb = c.start_all_reduce_sum(b.get(), 1);
    const double count = c.all_reduce_sum(1.0);
    sa->wait();
    sb->wait();
    sb->wait();
    const float ranks = static_cast<float>(n), sum = ranks * (ranks - 1) / 2;
    EXPECT_EQ(count, n);
    EXPECT_EQ(a.host(), (std::vector<float>{sum, ranks}));
    EXPECT_EQ(b.host(), (std::vector<float>{2 * sum}));
  }));
}

// Hybrid steps split the sequence group (ncclCommSplit): colors make the
// groups, keys order them, and the parent still works.
TEST_P(NcclSim, SplitMakesSubgroupsRankedByKey) {
  const int n = GetParam();
  expect_no_errors(run_nccl_ranks(n, 10, [&](Communicator& c) {
    const int r = c.rank();
    auto sub = c.split(r % 2, -r);  // evens and odds, each in reverse rank order
    const int members = (n + 1 - r % 2) / 2;
    ASSERT_EQ(sub->size(), members);
    EXPECT_EQ(sub->rank(), members - 1 - r / 2);
    EXPECT_STREQ(sub->backend(), "NCCL");
    DeviceBuffer<float> x(std::vector<float>{static_cast<float>(r)});
    sub->all_reduce_sum(x.get(), 1);
    float want = 0;
    for (int p = r % 2; p < n; p += 2) want += static_cast<float>(p);
    EXPECT_EQ(x.host(), std::vector<float>{want});
    EXPECT_EQ(c.all_reduce_sum(1.0), n);
  }));
}

// use_streams: the calls run on the given stream, after the work queued so
// far on the compute stream (by an event, not by the host waiting). Here the
// compute stream's "kernel" writes the buffer late; the sum must see it.
struct LateWrite {
  float* device;
  float value;
};

void write_late(void* p) {
  auto* w = static_cast<LateWrite*>(p);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  *w->device = w->value;  // (simulated device memory is host memory)
}

TEST_P(NcclSim, CallsRunAfterTheComputeStreamsWork) {
  const int n = GetParam();
  expect_no_errors(run_nccl_ranks(n, 10, [&](Communicator& c) {
    DeviceBuffer<float> x(std::vector<float>{0.f});
    LateWrite w{x.get(), 1.0f + c.rank()};
    BoundStreams streams(c, nullptr);
    halyard::testing::cuda_ok(cudaLaunchHostFunc(streams.compute(), write_late, &w), "cudaLaunchHostFunc");
    c.all_reduce_sum(x.get(), 1);
    EXPECT_EQ(x.host(), std::vector<float>{static_cast<float>(n * (n + 1) / 2)});
  }));
}
TEST(NcclSim, SingleRankFactoryMakesAGroupOfOne) {
  auto c = make_nccl_single_rank(10);
  EXPECT_EQ(c->size(), 1);
  EXPECT_STREQ(c->backend(), "NCCL");
  DeviceBuffer<float> x(std::vector<float>{2.5f});
  c->all_reduce_sum(x.get(), 1);
  EXPECT_EQ(x.host(), std::vector<float>{2.5f});
}

TEST(NcclSim, NoDeviceIsAClearError) {
  halyard::testing::set_simulated_devices(0);
  std::string why;
  EXPECT_EQ(count_cuda_devices(3, why), 0);
  halyard::testing::set_simulated_devices(4);
  EXPECT_EQ(why, "error: NCCL communicator on rank 3: no CUDA device (cudaGetDeviceCount: no CUDA-capable device is "
                 "detected); fix: run on GPU nodes or use make_mpi_communicator()");
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the probe left a sticky error";
}

// ---------------------------------------------------------------------------
// Faults: the watchdog. Work that waits for a peer never ends by itself on
// the (simulated) GPU; the communicator must give up at its timeout, abort,
// and say what it waited for.

TEST(NcclSimFaults, TwoRanksOnOneDeviceNameTheFix) {
  auto errors = run_nccl_ranks(2, 5, [](Communicator&) {}, {0, 0});
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[r], HasSubstr("error: make_nccl_communicator on rank " + std::to_string(r) +
                                     " of 2: ncclCommInitRankConfig on CUDA device 0 failed: invalid usage"));
    EXPECT_THAT(errors[r], HasSubstr("NCCL needs one GPU per rank; fix: run at most as many ranks per node as it "
                                     "has GPUs."));
  }
}

TEST(NcclSimFaults, MissingRankMakesTheOthersTimeOutAndAbort) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<double> elapsed(4);
  std::vector<std::string> later(4);
  auto errors = run_nccl_ranks(4, 0.5, [&](Communicator& c) {
    const int r = c.rank();
    if (r == 2) return;  // stuck elsewhere
    DeviceBuffer<float> send(8), recv(8);
    std::vector<int64_t> counts(4, 2);
    try {
      c.all_to_all_v(send.get(), counts.data(), recv.get(), counts.data());
    } catch (const Error&) {
      elapsed[static_cast<size_t>(r)] = seconds_since(start);
      try {
        c.barrier();
      } catch (const Error& e) {
        later[static_cast<size_t>(r)] = e.what();
      }
      throw;
    }
  });
  EXPECT_EQ(errors[2], "");
  for (int r : {0, 1, 3}) {
    EXPECT_THAT(errors[r], HasSubstr("error: all_to_all_v on rank " + std::to_string(r) +
                                     " of 4 timed out after 0.5 s waiting for a peer (dead or stuck?)"));
    EXPECT_THAT(errors[r], HasSubstr("ncclGroupEnd was still running on the GPU; the NCCL communicator was aborted "
                                     "(ncclCommAbort)."));
    EXPECT_GE(elapsed[static_cast<size_t>(r)], 0.45) << "rank " << r;
    EXPECT_LT(elapsed[static_cast<size_t>(r)], 3.0) << "rank " << r;
    EXPECT_THAT(later[static_cast<size_t>(r)], HasSubstr("the communicator is broken by an earlier failure"));
  }
}

TEST(NcclSimFaults, SendNobodyReceivesSaysWhy) {
  auto errors = run_nccl_ranks(2, 0.5, [](Communicator& c) {
    DeviceBuffer<float> x(4);
    if (c.rank() == 1) c.send(x.get(), 4, 0, 7);  // rank 0 never receives
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_THAT(errors[1], HasSubstr("send on rank 1 of 2 timed out after 0.5 s"));
  EXPECT_THAT(errors[1], HasSubstr("rank 0 did not receive the message (4 f32, tag 7); NCCL sends complete only when "
                                   "the peer receives"));
}

TEST(NcclSimFaults, RingPassWaitTimesOutNamingItsPeers) {
  auto errors = run_nccl_ranks(2, 0.5, [](Communicator& c) {
    DeviceBuffer<float> x(4), y(4);
    if (c.rank() == 1) c.start_exchange(x.get(), y.get(), 4, 0, 0, 9)->wait();  // rank 0 never passes
  });
  EXPECT_THAT(errors[1], HasSubstr("the pass of 4 f32 (tag 9) to rank 0 and from rank 0 did not finish."));
}

TEST(NcclSimFaults, SplitThatAPeerSkipsTimesOut) {
  auto errors = run_nccl_ranks(2, 0.5, [](Communicator& c) {
    if (c.rank() == 0) c.split(0, 0);
  });
  EXPECT_THAT(errors[0], HasSubstr("ncclCommSplit was still in progress; every rank must split in the same order."));
  EXPECT_EQ(errors[1], "");
}

// ---------------------------------------------------------------------------
// The step's collectives as a CUDA model over NCCL runs them: each rank's
// plan on its device memory (make_cuda_collective_memory: copies and sums
// queued on the runtime's compute stream, one for all ranks here as on one
// GPU), the transfer over its NCCL communicator.

// Ranks over NCCL, each with CUDA collective memory; the host vectors of
// collective_checks.h count as device memory, and every copy has landed
// when a rank returns. As in a Model over NCCL (check_communicators), the
// calls run after the compute stream's work (use_streams). Each rank has a
// compute stream and a communication stream of its own, as each process
// has on GPUs: ranks that shared one would queue behind each other's waits
// (a rank's copies joined to its transfer would hold up the copies its
// peers' transfers wait for).
std::vector<std::string> on_simulated_gpus(int p, const std::function<void(Communicator&, CollectiveMemory&)>& fn) {
  HostCountsAsDevice host_counts;
  return run_nccl_ranks(p, 10, [&](Communicator& c) {
    BoundStreams streams(c, nullptr);
    auto memory = make_cuda_collective_memory(streams.compute());
    fn(c, *memory);
  });
}

HALYARD_COLLECTIVE_CHECKS(DeviceCollectivesSim, on_simulated_gpus)

// Without use_streams the transfer would not wait for the copies before it:
// an error that names the fix, before anything is queued.
TEST(DeviceCollectivesSim, ACommunicatorNotOrderedAfterTheCopiesIsAClearError) {
  HostCountsAsDevice host_counts;
  using halyard::testing::collective_checks::spec;
  const BufferSpec x = spec("x", ElemType::F32, {1, 2, 4, 2}), y = spec("y", ElemType::F32, {1, 4, 2, 2});
  auto errors = run_nccl_ranks(2, 10, [&](Communicator& c) {
    auto memory = make_cuda_collective_memory();
    std::vector<float> in(16), out(16), sums(5);
    EXPECT_THAT(halyard::testing::error_of([&] {
                  run_collective(CallKind::SeqToHeads, x, in.data(), y, out.data(), c, *memory);
                }),
                HasSubstr("whose calls do not wait for the stream its copies run on"));
    const std::string e = halyard::testing::error_of([&] { all_reduce_sum_bf16_on_device(sums.data(), 5, c, *memory); });
    EXPECT_THAT(e, HasSubstr("error: a collective on device memory over NCCL (rank " + std::to_string(c.rank()) +
                             " of 2) whose calls do not wait"));
    EXPECT_THAT(e, HasSubstr("fix: comm.use_streams(runtime_cuda_context().comm_stream, runtime_cuda_context().stream)"));
  });
  expect_no_errors(errors);
}

// A Ulysses all-to-all started and finished on the device (as a CUDA step
// with overlap runs it) never makes the host wait for the peers: the copies
// out of the staging wait for the transfer by an event. Here rank 1 comes
// late; rank 0 queues everything at once, and only settle() waits.
TEST(DeviceCollectivesSim, AnAllToAllStartedAndFinishedOnTheDeviceLeavesTheHostFree) {
  using halyard::testing::collective_checks::spec;
  // (Two rows: the blocks received are copied out of the staging, after the transfer.)
  const BufferSpec x = spec("x", ElemType::F32, {2, 3, 4, 2}), y = spec("y", ElemType::F32, {2, 6, 2, 2});
  std::vector<double> queued(2), settled(2);
  std::vector<std::vector<float>> outs(2);
  expect_no_errors(on_simulated_gpus(2, [&](Communicator& c, CollectiveMemory& memory) {
    const size_t r = static_cast<size_t>(c.rank());
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(400));
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> in(48);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(100 * r + i);
    outs[r].assign(48, -1.f);
    StartedPlan s = start_plan(plan_collective(CallKind::SeqToHeads, x, y, 2, "NCCL"), in.data(), outs[r].data(), &c, memory);
    finish_plan(s, memory);
    queued[r] = seconds_since(t0);
    memory.settle();
    settled[r] = seconds_since(t0);
  }));
  EXPECT_LT(queued[0], 0.2) << "rank 0 waited for its late peer while queueing";
  EXPECT_GE(settled[0], 0.3) << "settle() returned before the late peer sent its blocks";
  for (size_t r = 0; r < 2; ++r)
    for (int i = 0; i < 2; ++i)
      for (int q = 0; q < 2; ++q)
        for (int t = 0; t < 3; ++t)
          for (int j = 0; j < 4; ++j)  // rank r's 2 heads of 4: elements 4r..4r+3 of each token
            EXPECT_EQ(outs[r][static_cast<size_t>(((i * 2 + q) * 3 + t) * 4 + j)],
                      static_cast<float>(100 * q + (i * 3 + t) * 8 + 4 * static_cast<int>(r) + j))
                << "rank " << r << " row " << i << " from rank " << q << " token " << t;
}

// A peer that never starts its all-to-all: the host of the others does not
// hang in a synchronize; settle() is the communicator's timeout.
TEST(NcclSimFaults, AnAllToAllJoinedOnTheDeviceTimesOutAtSettle) {
  HostCountsAsDevice host_counts;
  using halyard::testing::collective_checks::spec;
  const BufferSpec x = spec("x", ElemType::F32, {1, 3, 4, 2}), y = spec("y", ElemType::F32, {1, 6, 2, 2});
  auto errors = run_nccl_ranks(2, 0.5, [&](Communicator& c) {
    if (c.rank() == 1) return;  // stuck elsewhere
    BoundStreams streams(c, nullptr);
    auto memory = make_cuda_collective_memory(streams.compute());
    std::vector<float> in(24), out(24);
    StartedPlan s = start_plan(plan_collective(CallKind::SeqToHeads, x, y, 2, "NCCL"), in.data(), out.data(), &c, *memory);
    finish_plan(s, *memory);
    memory->settle();
  });
  EXPECT_THAT(errors[0], HasSubstr("error: all_to_all_v on rank 0 of 2 timed out after 0.5 s waiting for a peer"));
  EXPECT_THAT(errors[0], HasSubstr("the all-to-all of 24 f32 started in the background did not finish."));
  EXPECT_EQ(errors[1], "");
}

// Gradients summed over the ranks moved in bf16 (--grad-reduce bf16), on the
// device: the same bits as the host's Communicator::all_reduce_sum_bf16 and
// reduce_scatter_sum_bf16 (ZeRO-1's), over lengths the ranks do not divide.
TEST(DeviceCollectivesSim, Bf16SumsOnTheDeviceAreTheHostsBits) {
#ifndef HALYARD_TEST_CUDA_KERNELS
  GTEST_SKIP() << "this runtime was built without its CUDA kernels (no nvcc, or HALYARD_CUDA_KERNELS=OFF)";
#endif
  halyard::testing::register_emulated_collectives_kernels();
  auto value = [](int r, int64_t i) { return std::sin(1.0f + 7.0f * r + 0.37f * i) / (r + 3) + 1e-3f * i; };
  for (int p : {1, 2, 4})
    for (int64_t n : {int64_t{1}, int64_t{257}, int64_t{1000}}) {
      std::vector<std::vector<float>> host(static_cast<size_t>(p)), device(static_cast<size_t>(p));
      std::vector<std::vector<float>> host_rs(static_cast<size_t>(p)), device_rs(static_cast<size_t>(p));
      auto fill = [&](int r, int64_t len) {
        std::vector<float> v(static_cast<size_t>(len));
        for (int64_t i = 0; i < len; ++i) v[static_cast<size_t>(i)] = value(r, i);
        return v;
      };
      expect_no_errors(halyard::testing::run_ranks(p, 10, [&](Communicator& c) {
        const size_t r = static_cast<size_t>(c.rank());
        host[r] = fill(c.rank(), n);
        c.all_reduce_sum_bf16(host[r].data(), n);
        const std::vector<float> send = fill(c.rank(), n * p);
        host_rs[r].resize(static_cast<size_t>(n));
        c.reduce_scatter_sum_bf16(send.data(), host_rs[r].data(), n);
      }));
      expect_no_errors(on_simulated_gpus(p, [&](Communicator& c, CollectiveMemory& memory) {
        const size_t r = static_cast<size_t>(c.rank());
        device[r] = fill(c.rank(), n);
        all_reduce_sum_bf16_on_device(device[r].data(), n, c, memory);
        const std::vector<float> send = fill(c.rank(), n * p);
        device_rs[r].assign(static_cast<size_t>(n), -1.f);
        reduce_scatter_sum_bf16_on_device(send.data(), device_rs[r].data(), n, c, memory);
        halyard::testing::cuda_ok(cudaStreamSynchronize(static_cast<cudaStream_t>(memory.stream())),
                                  "cudaStreamSynchronize");  // (before `send` goes)
      }));
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(device[static_cast<size_t>(r)], host[static_cast<size_t>(r)]) << p << " ranks, n " << n << ", rank " << r;
        EXPECT_EQ(device_rs[static_cast<size_t>(r)], host_rs[static_cast<size_t>(r)])
            << "reduce-scatter: " << p << " ranks, n " << n << ", rank " << r;
      }
    }
}

// ---------------------------------------------------------------------------
// Offload copies (CudaCopyStream, runtime/cuda_context.h) on the runtime's
// communication stream beside its compute stream: a copy starts after the
// compute work queued before it, and compute work queued after
// compute_waits(ticket) starts after the copy. Late work on either stream
// (host functions that sleep) would be overtaken if an event were missing.

void sleep_a_while(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(30)); }

struct Reader {
  const float* at;
  float seen = -1.f;
};

void read_now(void* p) {
  auto* r = static_cast<Reader*>(p);
  r->seen = *r->at;
}

uint64_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

TEST(CudaCopyStreamSim, CopiesRunBetweenTheComputeWorkTheyAreOrderedAgainst) {
  const RuntimeCudaContext& ctx = runtime_cuda_context();
  ASSERT_NE(ctx.context, nullptr) << ctx.error;
  const auto compute = static_cast<cudaStream_t>(ctx.stream), comm = static_cast<cudaStream_t>(ctx.comm_stream);
  CudaCopyStream copies;
  ASSERT_EQ(copies.error(), "");
  DeviceBuffer<float> value(std::vector<float>{0.f}), back(std::vector<float>{0.f});
  for (int step = 0; step < 3; ++step) {  // (tickets and events start over after each reset)
    // Offload: the kernel that writes the value is late; the copy home waits for it.
    LateWrite kernel{value.get(), 10.f + step};
    halyard::testing::cuda_ok(cudaLaunchHostFunc(compute, write_late, &kernel), "cudaLaunchHostFunc");
    float home = -1.f;
    const int out = copies.copy_to_host(&home, address(value.get()), 4);
    // Reload: the copy up is late (the communication stream is busy); the
    // kernel that reads it waits for its ticket.
    halyard::testing::cuda_ok(cudaLaunchHostFunc(comm, sleep_a_while, nullptr), "cudaLaunchHostFunc");
    const float up = 20.f + step;
    const int in = copies.copy_to_device(address(back.get()), &up, 4);
    EXPECT_EQ(in, out + 1);
    copies.compute_waits(in);
    Reader reader{back.get()};
    halyard::testing::cuda_ok(cudaLaunchHostFunc(compute, read_now, &reader), "cudaLaunchHostFunc");
    copies.reset();
    halyard::testing::cuda_ok(cudaStreamSynchronize(compute), "cudaStreamSynchronize");
    EXPECT_EQ(home, 10.f + step) << "step " << step << ": the copy home did not wait for the kernel before it";
    EXPECT_EQ(reader.seen, 20.f + step) << "step " << step << ": the kernel did not wait for the copy up";
    EXPECT_EQ(out, 0) << "tickets count from 0 after reset()";
  }
}

}  // namespace
}  // namespace halyard::runtime
