// The collectives' CUDA kernels (runtime/collectives_cuda.cu) run on the CPU
// through the emulator (tests/runtime/cuda_emulation.h), against the host's
// arithmetic of a gradient sum moved in bf16: runtime/bf16.h's rounding, bit
// for bit (ties, NaN, infinities, signed zeros, subnormals), and
// Communicator::reduce_scatter_sum_bf16's f32 sums in rank order.
#include "tests/runtime/cuda_emulation.h"

#include "runtime/collectives_cuda.cu"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "runtime/bf16.h"

namespace halyard::runtime {
namespace {

using collectives_cuda::kThreads;

unsigned blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

TEST(CollectivesCudaEmulated, RoundingToBf16IsTheHostsBitForBit) {
  std::vector<float> x = {0.f, -0.f, 1.f, -1.f, std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::max(), std::numeric_limits<float>::min()};
  // Exact ties (the low 16 bits 0x8000) of even and odd high halves.
  for (uint32_t hi : {0x3f80u, 0x3f81u, 0xbf80u, 0xbf81u, 0x7f7fu}) {
    const uint32_t u = hi << 16 | 0x8000u;
    float f;
    std::memcpy(&f, &u, 4);
    x.push_back(f);
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mag(-30.f, 30.f);
  while (x.size() < 1000) x.push_back(std::ldexp(mag(rng) / 30.f, static_cast<int>(mag(rng))));
  const int64_t n = static_cast<int64_t>(x.size()), padded = 1100;
  std::vector<uint16_t> out(static_cast<size_t>(padded), 0xffffu);
  cuda_emulation::launch(halyard_round_bf16, blocks(padded), 1, 1, kThreads,
                         collectives_cuda::RoundArgs{x.data(), out.data(), 1, n, n, padded});
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(out[static_cast<size_t>(i)], bf16_bits(x[static_cast<size_t>(i)])) << "element " << i << " = " << x[static_cast<size_t>(i)];
  for (int64_t i = n; i < padded; ++i) ASSERT_EQ(out[static_cast<size_t>(i)], 0) << "padding " << i;
  // Rows of a reduce-scatter's chunk: columns [3, 3 + 5) of 4 blocks of 250,
  // each row padded to 6.
  std::vector<uint16_t> rows(24, 0xffffu);
  cuda_emulation::launch(halyard_round_bf16, blocks(24), 1, 1, kThreads,
                         collectives_cuda::RoundArgs{x.data() + 3, rows.data(), 4, 5, 250, 6});
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 6; ++i)
      ASSERT_EQ(rows[static_cast<size_t>(6 * r + i)], i < 5 ? bf16_bits(x[static_cast<size_t>(250 * r + 3 + i)]) : 0)
          << "row " << r << " column " << i;
}

TEST(CollectivesCudaEmulated, SumsAreTheHostsF32SumsInRankOrder) {
  const int ranks = 3;
  const int64_t n = 600;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> value(-4.f, 4.f);
  std::vector<uint16_t> in(static_cast<size_t>(ranks * n));
  for (uint16_t& b : in) b = bf16_bits(value(rng));
  std::vector<float> out(static_cast<size_t>(n), -1.f);
  cuda_emulation::launch(halyard_sum_bf16, blocks(n), 1, 1, kThreads,
                         collectives_cuda::SumArgs{in.data(), out.data(), n, ranks});
  for (int64_t i = 0; i < n; ++i) {
    float want = 0.f;
    for (int p = 0; p < ranks; ++p) want += bf16_value(in[static_cast<size_t>(p * n + i)]);
    ASSERT_EQ(out[static_cast<size_t>(i)], want) << "element " << i;
  }
}

}  // namespace
}  // namespace halyard::runtime
