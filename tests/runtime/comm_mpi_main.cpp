// The MPI communicator under mpirun, in three modes of one program:
//
//   mpirun -np 4 comm_mpi_main            GoogleTest suites on every rank (rank 0
//                                         prints; other ranks print failures only);
//                                         exits non-zero if any rank failed.
//   mpirun -np 4 comm_mpi_main --fault=M  rank 2 misbehaves before an
//                                         all_reduce_sum (M = stuck: sleeps;
//                                         killed: SIGKILLs itself); the others,
//                                         with a 5 s timeout, print the Error and
//                                         exit 1.
//   comm_mpi_main --check-fault=C         the ctest wrapper: runs mpirun on the
//                                         fault mode of case C, kills it if it runs
//                                         past 60 s, prints its output, and passes
//                                         only if the expected outcome appeared:
//     stuck            survivors report "all_reduce_sum ... timed out after 5 s
//                      waiting for rank 2"; mpirun exits non-zero.
//     killed           plain mpirun notices the dead rank itself and ends the job
//                      non-zero at once (survivors get no chance to report).
//     killed_recovery  mpirun --enable-recovery keeps the survivors running; they
//                      report the timeout naming the operation and rank 2.
//                      (OpenMPI 4.1's mpirun exits 0 in this mode whatever the
//                      ranks return, so only the output is checked.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "runtime/bf16.h"
#include "runtime/comm.h"
#include "runtime/error.h"
#include "tests/mpi_gtest.h"
#include "tests/mpi_launch.h"
#include "tests/uneven_exchange.h"

namespace halyard::runtime {
namespace {

using ::testing::HasSubstr;

Communicator* g_comm = nullptr;

using halyard::testing::element;

TEST(CommMpi, AllToAllVPermutesUnevenBlocksAndCountsBytes) {
  Communicator& c = *g_comm;
  const int n = c.size(), r = c.rank();
  const halyard::testing::UnevenExchange x(r, n);
  const auto& send_counts = x.send_counts;
  const auto& recv_counts = x.recv_counts;
  const auto& send = x.send;
  const int64_t expected_bytes = x.bytes_to_others;
  std::vector<float> recv(static_cast<size_t>(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0})));
  c.reset_all_to_all_bytes_sent();
  c.all_to_all_v(send.data(), send_counts.data(), recv.data(), recv_counts.data());
  size_t at = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t k = 0; k < recv_counts[p]; ++k, ++at) EXPECT_EQ(recv[at], element(p, r, k));
  EXPECT_EQ(c.all_to_all_bytes_sent(), expected_bytes);

  std::vector<int32_t> send_i(send.begin(), send.end()), recv_i(recv.size());
  c.all_to_all_v(send_i.data(), send_counts.data(), recv_i.data(), recv_counts.data());
  for (size_t i = 0; i < recv.size(); ++i) EXPECT_EQ(recv_i[i], static_cast<int32_t>(recv[i]));
  EXPECT_EQ(c.all_to_all_bytes_sent(), 2 * expected_bytes);
}

TEST(CommMpi, AllReduceSumIsExactAndIdenticalOnEveryRank) {
  Communicator& c = *g_comm;
  const int n = c.size(), r = c.rank();
  // 100000 and 100003 floats go round the ring (blocks of 25000, and of
  // 25000 and 25001 on 4 ranks); the rest through MPI_Iallreduce.
  for (int64_t len : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100000}, int64_t{100003}}) {
    std::vector<float> data(static_cast<size_t>(len));
    for (int64_t i = 0; i < len; ++i) data[i] = static_cast<float>(r + 1) + 0.5f * (i % 1000);
    c.all_reduce_sum(data.data(), len);
    for (int64_t i = 0; i < len; ++i) ASSERT_EQ(data[i], static_cast<float>(n * (n + 1) / 2) + 0.5f * (i % 1000) * n);
  }
  std::vector<float> noisy(40009);  // a ring's sum, in a different order on each block
  for (size_t i = 0; i < noisy.size(); ++i) noisy[i] = std::sin(1.0f + r * 7.0f + i) * 1e-3f + 1.0f / (r + 3);
  c.all_reduce_sum(noisy.data(), static_cast<int64_t>(noisy.size()));
  std::vector<float> everyone(noisy.size() * n);
  c.all_gather(noisy.data(), static_cast<int64_t>(noisy.size()), everyone.data());
  for (int p = 0; p < n; ++p)
    EXPECT_EQ(std::memcmp(everyone.data() + p * noisy.size(), noisy.data(), noisy.size() * 4), 0)
        << "rank " << p << " got a different sum";
  EXPECT_EQ(c.all_reduce_sum(1.5 * r), 1.5 * n * (n - 1) / 2);
  EXPECT_EQ(c.all_reduce_sum(int64_t{1} << (40 + r)), ((int64_t{1} << n) - 1) << 40);
}

TEST(CommMpi, AllGatherAndReduceScatter) {
  Communicator& c = *g_comm;
  const int n = c.size(), r = c.rank();
  const int64_t per = 6;
  std::vector<int32_t> ids(per), all_ids(per * n);
  for (int64_t k = 0; k < per; ++k) ids[k] = r * 10 + static_cast<int32_t>(k);
  c.all_gather(ids.data(), per, all_ids.data());
  for (int p = 0; p < n; ++p)
    for (int64_t k = 0; k < per; ++k) EXPECT_EQ(all_ids[p * per + k], p * 10 + k);

  for (int64_t block : {int64_t{0}, per, int64_t{50001}}) {
    std::vector<float> send(block * n), recv(block);
    for (int64_t i = 0; i < block * n; ++i) send[i] = static_cast<float>(i % 4096) + 1000.0f * r;
    c.reduce_scatter_sum(send.data(), recv.data(), block);
    for (int64_t k = 0; k < block; ++k)
      ASSERT_EQ(recv[k], static_cast<float>(n * ((r * block + k) % 4096)) + 1000.0f * n * (n - 1) / 2) << "k " << k;
  }
}

TEST(CommMpi, SumsFromBf16OverMpi) {
  Communicator& c = *g_comm;
  const int n = c.size(), r = c.rank();
  auto value = [](int p, int64_t i) { return std::sin(1.0f + 7.0f * p + 0.37f * i) / (p + 3) + 1e-3f * i; };
  const int64_t len = 1001;  // not a multiple of the ranks: padded inside
  std::vector<float> data(len);
  for (int64_t i = 0; i < len; ++i) data[i] = value(r, i);
  c.reset_all_to_all_bytes_sent();
  c.all_reduce_sum_bf16(data.data(), len);
  EXPECT_EQ(c.all_to_all_bytes_sent(), 2 * ((len + n - 1) / n) * (n - 1));
  for (int64_t i = 0; i < len; ++i) {
    float sum = 0;
    for (int p = 0; p < n; ++p) sum += bf16_value(bf16_bits(value(p, i)));
    ASSERT_EQ(data[i], sum) << "i " << i;
  }
}

TEST(CommMpi, SendRecvRingMatchesByTag) {
  Communicator& c = *g_comm;
  const int n = c.size(), r = c.rank();
  if (n == 1) GTEST_SKIP() << "a single rank has no peer";
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  std::vector<float> a(1 << 16, 1.0f * r), b = {-1.0f * r};  // a goes by rendezvous, b eagerly
  c.send(b.data(), 1, next, 2);
  std::vector<float> got_b(1), got_a(a.size());
  // Post the large send only after the peer can receive it: recv b first on odd
  // ranks so that the ring cannot deadlock on rendezvous sends.
  if (r % 2 == 0) {
    c.send(a.data(), static_cast<int64_t>(a.size()), next, 1);
    c.recv(got_a.data(), static_cast<int64_t>(a.size()), prev, 1);
  } else {
    c.recv(got_a.data(), static_cast<int64_t>(a.size()), prev, 1);
    c.send(a.data(), static_cast<int64_t>(a.size()), next, 1);
  }
  c.recv(got_b.data(), 1, prev, 2);
  EXPECT_EQ(got_a, std::vector<float>(a.size(), 1.0f * prev));
  EXPECT_EQ(got_b[0], -1.0f * prev);
}

TEST(CommMpi, ManyCollectivesInARowStayInStep) {
  Communicator& c = *g_comm;
  const int n = c.size();
  for (int it = 0; it < 200; ++it) {
    float x = static_cast<float>(c.rank() + it);
    c.all_reduce_sum(&x, 1);
    ASSERT_EQ(x, static_cast<float>(n * (n - 1) / 2 + n * it));
    if (it % 3 == 0) c.barrier();
  }
}

TEST(CommMpi, UserMistakesThrowAndLeaveTheCommunicatorUsable) {
  Communicator& c = *g_comm;
  float x = 0;
  try {
    c.send(&x, 1, c.size(), 0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("error: send on rank " + std::to_string(c.rank()) + " of " +
                                    std::to_string(c.size()) + ": peer " + std::to_string(c.size()) +
                                    " is not a rank."));
  }
  EXPECT_STREQ(c.backend(), "MPI");
  c.barrier();
}

int run_tests(int argc, char** argv) {
  auto comm = make_mpi_communicator(20);
  g_comm = comm.get();
  ::testing::InitGoogleTest(&argc, argv);
  halyard::testing::print_failures_only_off_rank_zero(comm->rank());
  int failed = RUN_ALL_TESTS() != 0;
  int64_t ranks_failed = comm->all_reduce_sum(int64_t{failed});
  if (comm->rank() == 0)
    std::printf("comm_mpi: %s (%d ranks)\n",
                ranks_failed ? (std::to_string(ranks_failed) + " rank(s) FAILED").c_str() : "all ranks passed",
                comm->size());
  g_comm = nullptr;
  comm.reset();
  return ranks_failed ? 1 : 0;
}

// --fault=stuck|killed, under mpirun.
int run_fault(const std::string& mode) {
  auto comm = make_mpi_communicator(5);
  comm->barrier();  // everyone is up
  if (comm->rank() == 2) {
    if (mode == "killed") raise(SIGKILL);
    std::this_thread::sleep_for(std::chrono::seconds(120));  // stuck; mpirun ends it
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<float> grads(1 << 16, 1.0f);  // 256 KiB: the ring, as the gradients' sums go
  try {
    comm->all_reduce_sum(grads.data(), static_cast<int64_t>(grads.size()));
  } catch (const Error& e) {
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "[rank %d after %.1f s] %s\n", comm->rank(), s, e.what());
    std::fflush(stderr);
    std::exit(1);
  }
  std::fprintf(stderr, "[rank %d] all_reduce_sum returned without rank 2\n", comm->rank());
  return 3;
}

// --check-fault=CASE: the ctest wrapper (no MPI in this process).
int check_fault(const std::string& which) {
  const bool recovery = which == "killed_recovery";
  const std::string mode = which == "stuck" ? "stuck" : "killed";
  if (which != "stuck" && which != "killed" && !recovery) {
    std::fprintf(stderr, "unknown case %s; cases: stuck, killed, killed_recovery\n", which.c_str());
    return 2;
  }
  std::vector<std::string> args = {HALYARD_MPIEXEC, "--allow-run-as-root", "--oversubscribe"};
  if (recovery) args.push_back("--enable-recovery");
  for (const std::string& a : {std::string("-np"), std::string("4"), halyard::testing::self_path()}) args.push_back(a);
  args.push_back("--fault=" + mode);
  const halyard::testing::Launch run = halyard::testing::launch(args, 60);
  const std::string& log = run.log;
  const bool hung = run.hung;
  const int rc = run.rc;
  const double elapsed = run.seconds;

  std::vector<std::string> problems;
  if (hung) problems.push_back("mpirun was still running after 60 s: something hung");
  const std::string ours = "timed out after 5 s waiting for rank 2 (dead or stuck?)";
  if (which == "stuck" || recovery) {
    if (log.find("error: all_reduce_sum on rank ") == std::string::npos || log.find(ours) == std::string::npos)
      problems.push_back("no survivor reported \"error: all_reduce_sum on rank r of 4 " + ours + "\"");
    if (log.find("returned without rank 2") != std::string::npos)
      problems.push_back("a survivor's all_reduce_sum completed without rank 2");
  }
  if (!recovery && rc == 0) problems.push_back("mpirun exited 0 though ranks failed");
  if (which == "killed" && log.find("rank 2") == std::string::npos)
    problems.push_back("mpirun's output does not name rank 2");
  for (const auto& p : problems) std::printf("FAILED: %s\n", p.c_str());
  if (problems.empty()) std::printf("PASSED: %s, the failure reported in %.1f s\n", which.c_str(), elapsed);
  return problems.empty() ? 0 : 1;
}

}  // namespace
}  // namespace halyard::runtime

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--check-fault=", 0) == 0) return halyard::runtime::check_fault(a.substr(14));
    if (a.rfind("--fault=", 0) == 0) return halyard::runtime::run_fault(a.substr(8));
  }
  return halyard::runtime::run_tests(argc, argv);
}
