// The NCCL communicator's contract, one function per case, each run by
// every rank of a group on its own communicator: test_comm_nccl runs them
// under mpirun on GPUs, test_cuda_sim on ranks as threads over the
// simulated CUDA runtime and NCCL (tests/runtime/nccl_sim.cpp). Buffers are
// device memory of the rank's current CUDA device.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "runtime/error.h"
#include "tests/device_buffer.h"
#include "tests/uneven_exchange.h"

namespace halyard::testing::nccl_contract {

using ::testing::HasSubstr;
using runtime::Error;

inline void all_to_all_v_moves_uneven_blocks_and_counts_bytes(runtime::Communicator& c) {
  const int n = c.size(), r = c.rank();
  const UnevenExchange x(r, n);
  const auto& send_counts = x.send_counts;
  const auto& recv_counts = x.recv_counts;
  const auto& send = x.send;
  const int64_t expected_bytes = x.bytes_to_others;
  const size_t recv_total = static_cast<size_t>(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0}));
  DeviceBuffer<float> d_send(send), d_recv(recv_total);
  c.reset_all_to_all_bytes_sent();
  c.all_to_all_v(d_send.get(), send_counts.data(), d_recv.get(), recv_counts.data());
  const std::vector<float> recv = d_recv.host();
  size_t at = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t k = 0; k < recv_counts[p]; ++k, ++at) EXPECT_EQ(recv[at], element(p, r, k)) << "from rank " << p;
  EXPECT_EQ(c.all_to_all_bytes_sent(), expected_bytes);

  DeviceBuffer<int32_t> i_send(std::vector<int32_t>(send.begin(), send.end())), i_recv(recv_total);
  c.all_to_all_v(i_send.get(), send_counts.data(), i_recv.get(), recv_counts.data());
  const std::vector<int32_t> recv_i = i_recv.host();
  for (size_t i = 0; i < recv_total; ++i) EXPECT_EQ(recv_i[i], static_cast<int32_t>(recv[i]));
  EXPECT_EQ(c.all_to_all_bytes_sent(), 2 * expected_bytes);

  // Started in the background (a GPU step's Ulysses all-to-alls), the same.
  DeviceBuffer<float> late(recv_total);
  c.start_all_to_all_v(d_send.get(), send_counts.data(), late.get(), recv_counts.data())->wait();
  EXPECT_EQ(late.host(), recv);
  EXPECT_EQ(c.all_to_all_bytes_sent(), 3 * expected_bytes);
}

inline void all_reduce_sum_on_device_and_host_values(runtime::Communicator& c) {
  const int n = c.size(), r = c.rank();
  for (int64_t len : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100000}}) {
    std::vector<float> data(static_cast<size_t>(len));
    for (int64_t i = 0; i < len; ++i) data[i] = static_cast<float>(r + 1) + 0.5f * (i % 1000);
    DeviceBuffer<float> d(data);
    c.all_reduce_sum(d.get(), len);
    const std::vector<float> sum = d.host();
    for (int64_t i = 0; i < len; ++i)
      ASSERT_EQ(sum[i], static_cast<float>(n * (n + 1) / 2) + 0.5f * (i % 1000) * n) << "element " << i;
  }
  DeviceBuffer<double> d64(std::vector<double>(33, 0.25 * (r + 1)));
  c.all_reduce_sum(d64.get(), 33);
  EXPECT_EQ(d64.host(), std::vector<double>(33, 0.25 * n * (n + 1) / 2));

  // Host memory goes through the communicator's staging buffer.
  std::vector<float> on_host(5, 1.0f + r);
  c.all_reduce_sum(on_host.data(), 5);
  EXPECT_EQ(on_host, std::vector<float>(5, static_cast<float>(n + n * (n - 1) / 2)));
  EXPECT_EQ(c.all_reduce_sum(1.5 * r), 1.5 * n * (n - 1) / 2);
  EXPECT_EQ(c.all_reduce_sum(int64_t{1} << (40 + r)), ((int64_t{1} << n) - 1) << 40);
}

inline void all_gather_puts_rank_p_at_offset_p_times_n(runtime::Communicator& c) {
  const int n = c.size(), r = c.rank();
  const int64_t per = 6;
  std::vector<int32_t> ids(per);
  for (int64_t k = 0; k < per; ++k) ids[k] = r * 10 + static_cast<int32_t>(k);
  DeviceBuffer<int32_t> d_ids(ids), d_all(per * n);
  c.all_gather(d_ids.get(), per, d_all.get());
  const std::vector<int32_t> all = d_all.host();
  for (int p = 0; p < n; ++p)
    for (int64_t k = 0; k < per; ++k) EXPECT_EQ(all[p * per + k], p * 10 + k);

  DeviceBuffer<float> f_send(std::vector<float>(3, 0.5f * r)), f_all(3 * n);
  c.all_gather(f_send.get(), 3, f_all.get());
  const std::vector<float> all_f = f_all.host();
  for (int p = 0; p < n; ++p)
    for (int k = 0; k < 3; ++k) EXPECT_EQ(all_f[p * 3 + k], 0.5f * p);
}

inline void reduce_scatter_sum_gives_each_rank_its_block(runtime::Communicator& c) {
  const int n = c.size(), r = c.rank();
  const int64_t per = 6;
  std::vector<float> send(per * n);
  for (int64_t i = 0; i < per * n; ++i) send[i] = static_cast<float>(i) + 1000.0f * r;
  DeviceBuffer<float> d_send(send), d_recv(per);
  c.reduce_scatter_sum(d_send.get(), d_recv.get(), per);
  const std::vector<float> recv = d_recv.host();
  for (int64_t k = 0; k < per; ++k)
    EXPECT_EQ(recv[k], static_cast<float>(n * (r * per + k)) + 1000.0f * n * (n - 1) / 2);
}

// (The group's size must be even.)
inline void send_recv_between_pairs_in_call_order(runtime::Communicator& c) {
  const int r = c.rank();
  const int peer = r ^ 1;
  DeviceBuffer<float> first(std::vector<float>(1 << 16, 1.0f * r)), second(std::vector<float>(3, -1.0f * r));
  DeviceBuffer<float> got_first(1 << 16), got_second(3);
  // NCCL sends complete only when received: even ranks send first.
  if (r % 2 == 0) {
    c.send(first.get(), 1 << 16, peer, 1);
    c.send(second.get(), 3, peer, 2);
    c.recv(got_first.get(), 1 << 16, peer, 1);
    c.recv(got_second.get(), 3, peer, 2);
  } else {
    c.recv(got_first.get(), 1 << 16, peer, 1);
    c.recv(got_second.get(), 3, peer, 2);
    c.send(first.get(), 1 << 16, peer, 1);
    c.send(second.get(), 3, peer, 2);
  }
  EXPECT_EQ(got_first.host(), std::vector<float>(1 << 16, 1.0f * peer));
  EXPECT_EQ(got_second.host(), std::vector<float>(3, -1.0f * peer));
}

// A host buffer beside a device one is a mistake; host buffers on both sides
// of a gather are staged through the device (split() gathers its group's
// world ranks so).
inline void host_buffer_is_a_user_mistake_and_leaves_the_communicator_usable(runtime::Communicator& c) {
  const int n = c.size(), r = c.rank();
  std::vector<float> send(4, 1.0f * r), recv(4 * n);
  DeviceBuffer<float> on_device(4 * n);
  try {
    c.all_gather(send.data(), 4, on_device.get());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("error: all_gather on rank " + std::to_string(r) + " of " + std::to_string(n) +
                                    ": send is host memory, but the NCCL backend moves device memory."));
  }
  EXPECT_STREQ(c.backend(), "NCCL");
  for (int i = 0; i < 50; ++i) c.barrier();
  c.all_gather(send.data(), 4, recv.data());
  for (int p = 0; p < n; ++p)
    for (int k = 0; k < 4; ++k) EXPECT_EQ(recv[static_cast<size_t>(p * 4 + k)], 1.0f * p) << "from rank " << p;
}

}  // namespace halyard::testing::nccl_contract
