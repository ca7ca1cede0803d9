// bf16 in generated kernels: stored as UInt(16), computed in f32.
//
// Halide 21's CUDA backend aborts inside LLVM on BFloat(16) arithmetic or
// casts (halide/Halide#8311), so kernels never use that type: a bf16 value
// is its 16 bits in a UInt(16) buffer, decoded to f32 on load and encoded
// back on store with integer operations only, which every target (CUDA
// included) compiles. The bits are the same as torch.bfloat16's.
#pragma once

#include <Halide.h>

namespace halyard {

// Exact: the 16 bits are the top half of the f32.
Halide::Expr bf16_decode(const Halide::Expr& bits);
// Rounds to nearest, ties to even, as torch does (c10::BFloat16): finite
// values past the largest bf16 become infinities, subnormals round like the
// rest, and every NaN becomes the quiet NaN 0x7FC0.
Halide::Expr bf16_encode(const Halide::Expr& f32);

}  // namespace halyard
