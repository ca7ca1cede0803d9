// bf16 as generated kernels store it (generators/bf16.h): UInt(16) bits,
// decoded and encoded with integer operations. JIT-compiled for the host
// and checked bit for bit against torch's rounding (restated below) on every
// bf16 pattern, the f32 edge cases and a million f32 patterns of every
// exponent; then compiled for CUDA, where BFloat(16) would abort the compiler.
#include <gtest/gtest.h>

#include <HalideBuffer.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <random>
#include <vector>

#include "generators/bf16.h"
#include "runtime/safetensors.h"

namespace halyard {
namespace {

using namespace Halide;

// c10::BFloat16's round_to_nearest_even, written from its definition.
uint16_t torch_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

std::vector<uint16_t> encode(const std::vector<float>& xs) {
  Buffer<float> in(static_cast<int>(xs.size()));
  for (size_t i = 0; i < xs.size(); ++i) in(static_cast<int>(i)) = xs[i];
  Func enc("enc");
  Var i("i");
  enc(i) = bf16_encode(in(i));
  enc.vectorize(i, 8);
  Buffer<uint16_t> out = enc.realize({static_cast<int>(xs.size())});
  return std::vector<uint16_t>(out.begin(), out.end());
}

TEST(Bf16, DecodingEveryPatternIsExact) {
  Buffer<uint16_t> bits(65536);
  for (int i = 0; i < 65536; ++i) bits(i) = static_cast<uint16_t>(i);
  Func dec("dec");
  Var i("i");
  dec(i) = bf16_decode(bits(i));
  dec.vectorize(i, 8);
  Buffer<float> out = dec.realize({65536});
  int mismatches = 0;
  std::vector<float> decoded(65536);
  for (int k = 0; k < 65536; ++k) {
    const float want = runtime::bf16_to_f32(static_cast<uint16_t>(k));
    decoded[static_cast<size_t>(k)] = out(k);
    if (std::bit_cast<uint32_t>(out(k)) != std::bit_cast<uint32_t>(want)) ++mismatches;
  }
  EXPECT_EQ(mismatches, 0);
  // Encoding a decoded pattern gives it back (NaNs: the one quiet NaN).
  const std::vector<uint16_t> again = encode(decoded);
  for (int k = 0; k < 65536; ++k) {
    const bool nan = (k & 0x7fff) > 0x7f80;
    ASSERT_EQ(again[static_cast<size_t>(k)], nan ? 0x7fc0 : k) << "pattern " << k;
  }
}

TEST(Bf16, EncodingRoundsToNearestEvenAsTorchDoes) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                           std::bit_cast<float>(0x7f800001u),  // signalling NaN
                           std::bit_cast<float>(0xffc12345u),  // negative NaN with payload
                           std::numeric_limits<float>::max(),  // rounds to inf
                           std::bit_cast<float>(0x7f7f7fffu),  // just below the midpoint: largest bf16
                           std::bit_cast<float>(0x3f808000u),  // tie, kept half even: stays 0x3f80
                           std::bit_cast<float>(0x3f818000u),  // tie, kept half odd: up to 0x3f82
                           std::bit_cast<float>(0x3f808001u),  // past the tie: up
                           std::bit_cast<float>(0x00000001u),  // smallest subnormal
                           std::bit_cast<float>(0x00008000u),  // subnormal tie: down to 0
                           std::bit_cast<float>(0x00018000u),  // subnormal tie, odd: up
                           std::bit_cast<float>(0x807fffffu),  // largest negative subnormal
                           std::numeric_limits<float>::min(), 3.14159265f, -123.456f, 65504.0f, 1e-40f};
  const std::vector<uint16_t> want_edges = {0x0000, 0x8000, 0x3f80, 0xbf80, 0x7f80, 0xff80, 0x7fc0, 0x7fc0,
                                            0x7fc0, 0x7f80, 0x7f7f, 0x3f80, 0x3f82, 0x3f81, 0x0000, 0x0000,
                                            0x0002, 0x8080};
  std::mt19937 rng(1);
  for (int k = 0; k < (1 << 20); ++k) xs.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  const std::vector<uint16_t> got = encode(xs);
  for (size_t k = 0; k < want_edges.size(); ++k)
    EXPECT_EQ(got[k], want_edges[k]) << "edge case " << k << " (f32 bits 0x" << std::hex
                                     << std::bit_cast<uint32_t>(xs[k]) << ")";
  int mismatches = 0;
  for (size_t k = 0; k < xs.size(); ++k)
    if (got[k] != torch_bf16(xs[k]) && ++mismatches <= 5)
      ADD_FAILURE() << "f32 bits 0x" << std::hex << std::bit_cast<uint32_t>(xs[k]) << ": got 0x" << got[k]
                    << ", torch 0x" << torch_bf16(xs[k]);
  EXPECT_EQ(mismatches, 0) << "of " << xs.size();
}

// What a CUDA kernel of bf16 values compiles to: decode, compute in f32,
// encode, tiled over GPU blocks. Compiling is the check (with BFloat(16)
// LLVM's PTX backend aborts the process); nothing runs without a GPU.
TEST(Bf16, CompilesForCuda) {
  ImageParam x(UInt(16), 2, "x");
  Func y("y");
  Var i("i"), j("j"), bi("bi"), bj("bj"), ti("ti"), tj("tj");
  y(i, j) = bf16_encode(bf16_decode(x(i, j)) * 2.0f + 1.0f);
  y.gpu_tile(i, j, bi, bj, ti, tj, 16, 16);
  const Target t("host-cuda-cuda_capability_80");
  const auto dir = std::filesystem::temp_directory_path() / ("halyard_bf16_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  y.compile_to_static_library((dir / "bf16_cuda").string(), {x}, "bf16_cuda", t);
  EXPECT_TRUE(std::filesystem::exists(dir / "bf16_cuda.a"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace halyard
