// Sharding a model over ranks: what split_sequence and redistribute_heads mean.
//
// A model is built at one rank's slice of the sequence (seq / sp tokens per
// row). shard_sequence() rebuilds its forward graph for that rank: the inputs'
// seq axis becomes seq@sp, every value computed from them inherits the split
// (types print it: f32[batch=1, seq=4096@sp, model=256]), and the collectives
// the split implies are inserted where the math needs the whole sequence:
//
//   - each attention, by its strategy:
//     Ulysses: q, k, v go through seq_to_heads (seq@sp -> heads@sp, kv heads
//     fewer than sp replicated), positions are gathered, and the output
//     comes back through heads_to_seq. autodiff then mirrors the four
//     all-to-alls in the backward (they are each other's transposes);
//     ring: each rank keeps its queries; its k, v and their positions pass
//     around the ranks (sp - 1 ring_shifts), each block's attention gives a
//     partial output and row log-sum-exp, and attention_merge combines them
//     (online softmax). The backward runs each block's flash backward with
//     the merged statistics, and passes dK and dV back around the ring to
//     the rank that owns those keys. Any degree works, whatever the head
//     counts;
//     hybrid (ulysses_degree u): Ulysses over groups of u consecutive ranks
//     (mesh axis sp_u), then ring attention across the sp / u groups
//     (sp_r) on the heads each rank got;
//   - the token count and the loss are summed over the whole mesh (dp x sp),
//     so the loss is the global sum over real tokens divided by the global
//     count of real tokens. This happens at every degree: the data-parallel
//     degree is chosen at launch, not at build time.
//
// Weight gradients stay partial sums on each rank; the step program sums
// them over the mesh after the backward (schedules/program.h).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dsl/graph.h"
#include "schedules/schedule.h"

namespace halyard {

// The mesh axis name of collectives over every rank (data and sequence parallel).
inline constexpr const char* kWholeMesh = "dp,sp";

// The input a sharded graph gains for ring attention's mask: each of the
// rank's tokens' index in the whole row (i32[batch, seq@sp]). The runtime
// fills it from the rank and the sequence layout; the model never sees it.
inline constexpr const char* kTokenIndexInput = "token_index";

// A forward graph a schedule rebuilt (sharded here, tiled in tiling.h).
struct RebuiltGraph {
  std::unique_ptr<Graph> graph;
  Value loss;
  std::vector<Value> params;  // the source's parameters, in the same order
};

// Rebuilds `src` (built at seq / sp tokens per row) for one rank of sp ranks
// under schedule `s`. With sp == 1 or no split_sequence, only the loss's
// all-reduces are added. Throws UserError when the model cannot be split this way (heads
// not divisible by sp lists the legal degrees).
RebuiltGraph shard_sequence(const Graph& src, int loss, const Schedule& s, int64_t sp);

// The sp degrees Ulysses can split this model's attentions over (heads
// divisible by sp; kv_heads a multiple or a divisor of sp), up to `max`.
std::vector<int64_t> legal_sp_degrees(const Graph& g, int64_t max = 1024);

// Tokens per row on each rank, and the padded global length, for a global
// sequence of `seq` tokens over `sp` ranks: a length the ranks do not divide
// is padded at the end (the runtime masks padding out of loss and
// attention). Zigzag placement (Schedule::sequence_layout) cuts the sequence
// in 2*sp equal chunks, so it pads to a multiple of 2*sp.
inline int64_t local_seq(int64_t seq, int64_t sp, bool zigzag = false) {
  return zigzag && sp > 1 ? 2 * ((seq + 2 * sp - 1) / (2 * sp)) : (seq + sp - 1) / sp;
}
inline int64_t padded_seq(int64_t seq, int64_t sp, bool zigzag = false) { return local_seq(seq, sp, zigzag) * sp; }

}  // namespace halyard
