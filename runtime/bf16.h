// bf16 on the host: the high 16 bits of an f32. Rounding is to nearest, ties
// to even (what PyTorch's and Halide's conversions do); a NaN stays a NaN.
#pragma once

#include <bit>
#include <cstdint>

namespace halyard::runtime {

inline uint16_t bf16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_value(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

}  // namespace halyard::runtime
