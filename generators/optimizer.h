// The optimizer's kernels for a GPU library, so that AdamW runs where the
// parameters live (runtime::Model::adamw_step): halyard_aot compiles them
// next to the step's kernels for GPU targets. The update is the formula of
// runtime/adamw.cpp (adamw_update), element by element in f32; the gradient
// norm's squares are summed in f64, as runtime::global_grad_norm sums them.
#pragma once

#include <Halide.h>

namespace halyard {

// One parameter's update, in place: arguments (w, g, m, v: f32 [n];
// b1, b2, lr_over_c1, inv_c2, eps, grad_scale, decay: f32), outputs (w, m, v)
// which the runtime passes as the same buffers as the inputs (each element
// is read before it is written, by the same thread).
Halide::Module adamw_module(const Halide::Target& target, const std::string& fn);

// Sums of squares of one gradient in chunks: argument (g: f32 [n], chunk:
// i32), output (f64 [ceil(n / chunk)]): element j is the sum over
// g[j * chunk, (j + 1) * chunk), each chunk summed in order by one thread.
Halide::Module grad_sumsq_module(const Halide::Target& target, const std::string& fn);

}  // namespace halyard
