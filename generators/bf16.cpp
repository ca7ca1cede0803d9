#include "generators/bf16.h"

namespace halyard {

using namespace Halide;

namespace {
Expr u32(uint32_t v) { return Internal::make_const(UInt(32), static_cast<uint64_t>(v)); }
}  // namespace

Expr bf16_decode(const Expr& bits) { return reinterpret(Float(32), cast<uint32_t>(bits) << u32(16)); }

Expr bf16_encode(const Expr& f32) {
  const Expr u = reinterpret(UInt(32), cast<float>(f32));
  const Expr is_nan = (u & u32(0x7fffffff)) > u32(0x7f800000);
  // Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly
  // when the dropped half is past the midpoint, or at it with the kept half
  // odd; no non-NaN input wraps (the largest is -inf, 0xFF800000).
  const Expr rounded = (u + (u32(0x7fff) + ((u >> u32(16)) & u32(1)))) >> u32(16);
  return cast<uint16_t>(select(is_nan, u32(0x7fc0), rounded));
}

}  // namespace halyard
