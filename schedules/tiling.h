// Sequence tiling: the MLP and the LM head + loss in tiles of seq, so that the
// wide activations [seq, ffn] and [seq, vocab] never exist whole (Arctic
// Long Sequence Training's tiled MLP and loss, as a schedule choice).
//
// tile_sequence() rebuilds a forward graph: every token-local op whose output
// is wide (has seq and ffn or vocab), every token-local consumer of such an
// op, and a token-local value that only such tiles read (the norm before
// the MLP or the LM head), is computed once per tile of `tile` tokens. A
// tiled value's inputs are read per tile (slice_seq of a whole value: free
// inside the consuming kernel); a whole value of a tiled op is its tiles back to back (concat_seq),
// or, for a loss, the sum of the tiles' losses (each is a sum over its tokens
// divided by the global token count, so their sum is the loss). Tiles are
// built tile-major (all of tile 0's chain, then tile 1's), so the memory plan
// reuses one tile's wide buffers for the next. The backward inherits the
// tiles from autodiff; the schedule's rule {seq_tiles: keep recompute}
// recomputes the wide values per tile there instead of saving all tiles, so
// the backward too holds one tile's worth.
#pragma once

#include <cstdint>
#include <memory>

#include "dsl/graph.h"
#include "schedules/sharding.h"

namespace halyard {

// True for a value that sequence tiling keeps from existing whole.
bool is_wide(const Node& n);
// One tile of such a value (what the schedule term "seq_tiles" names; a wide
// value left whole, the MLP's when only the loss is tiled, is not one).
bool is_wide_tile(const Node& n);

// Rebuilds `src` (forward only, up to `loss`) with the wide ops tiled: the
// MLP's (ffn-wide) chains in tiles of `mlp_tile` tokens, the LM head and loss
// (vocab-wide) in tiles of `loss_tile`. A tile <= 0, or >= the sequence,
// leaves that region whole.
RebuiltGraph tile_sequence(const Graph& src, int loss, int64_t mlp_tile, int64_t loss_tile);
RebuiltGraph tile_sequence(const Graph& src, int loss, int64_t tile);  // both regions alike

}  // namespace halyard
