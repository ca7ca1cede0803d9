// Storage precision of saved values: what a schedule's `store` rules mean.
//
// The backward reads some forward values (the residuals: attention's inputs
// and output, the residual stream, what a matmul's weight gradient needs).
// A value the schedule saves, and a rule says {"store": "bf16"} for, is
// kept for the backward as a bf16 copy instead: a store_bf16 stage right
// after the value is computed writes its 16-bit copy, the f32 value dies
// with its last forward reader, and every backward reader decodes the copy
// inside its own kernel (load_bf16, inlined). The backward computes the
// gradient at the saved values rounded to bf16 (nearest, ties to even), what
// PyTorch's saved-tensor hooks do when they pack activations in bf16. The
// forward computes as before, except attention: it reads the copies of its
// operands too, because the backward recomputes its probabilities from the
// saved q and k and the row statistics the forward kernel wrote, and those
// must agree. Saved activations take half the bytes, and so do offloaded
// ones (keep "offload" moves the copy).
//
// It runs after autodiff, on the joint graph, so gradients, recompute
// clones and sequence tiles are already there; recomputed values (read by
// no backward node) and values computed inline (re-derived by each reader)
// are not stored.
#pragma once

#include <memory>
#include <vector>

#include "dsl/graph.h"
#include "schedules/schedule.h"

namespace halyard {

struct StoredGraph {
  std::unique_ptr<Graph> graph;  // null when no saved value is stored in bf16
  std::vector<int> id_of;        // a source node's id in `graph`
};

// Rebuilds the joint graph `src` with the bf16 copies `s` asks for.
StoredGraph store_saved(const Graph& src, const Schedule& s);

// Contractions in bf16 (Schedule::contract_precision "bf16", mixed
// precision): every contraction, forward and backward, reads each f32
// operand as load_bf16 of a store_bf16 copy, and sums in f32 into an f32
// output, what a bf16 GEMM with f32 accumulation computes (cuBLAS on
// tensor cores). One copy per value, shared by every contraction reading
// it: an activation's copy serves its projection and its weight gradient,
// so the backward reads the copy and the f32 value can die in the forward.
// A weight is rounded once in the forward and once in the backward (for
// its input gradient), so that no copy of it lives through the step. A
// value stored in bf16 already (store_saved, run before this) is read
// through its copy: a value has one copy, whoever made it.
// The gradient is the gradient at the rounded operands (the rounding's own
// derivative taken as 1, as autocast's casts do). Attention and its
// gradients multiply in bf16 too (Attrs::bf16, dsl/graph.h: what SDPA
// computes under autocast): their rounding is inside their kernels.
StoredGraph round_contractions(const Graph& src, const Schedule& s);

}  // namespace halyard
