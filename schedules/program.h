// The step program: kernel calls in order, and the static memory plan.
//
// Every stage root that is not a gradient the caller receives lives in one
// activation arena. Its live range runs from the call that writes it to the
// last call that reads it; offsets are assigned greedily (largest first, at
// the lowest offset free during that range), so peak memory is known before
// anything runs and equals the arena size. An elementwise stage's output
// takes over the bytes of an input that dies there (PlannedBuffer::
// in_place_of), and a running sum adding one tile's rows takes over the
// sum before it even while later tiles still read their own rows there. A
// tile of a sequence (slice_seq) is a view of its buffer, not a copy:
// reading it keeps that buffer alive.
//
// A value the schedule offloads (keep "offload", GPU targets) leaves the
// arena between the forward and the backward: after its last forward use an
// Offload call copies it to host memory, and before its first backward use a
// Reload call copies it back to the same arena offset. The arena holds it
// only while it is on the device (two live ranges); the host copies live in
// a second, host-side arena planned the same way (offload_bytes).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dsl/graph.h"
#include "schedules/partition.h"

namespace halyard {

// Every arena offset is a multiple of this: Halide's allocation alignment,
// which kernels may rely on. The planner's memory model rounds the same way.
constexpr int64_t kArenaAlignment = 128;
inline int64_t arena_aligned(int64_t bytes) { return (bytes + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment; }

enum class BufferKind { Input, Param, Grad, Arena, View };

struct PlannedBuffer {
  int node = -1;
  BufferKind kind = BufferKind::Arena;
  int index = -1;       // Input: 0 ids, 1 positions, 2 labels; Param/Grad: param index; View: its buffer
  int64_t offset = 0;   // Arena: bytes; View: first row of the tile
  int dim = 0;          // View: the row-major dimension tiled (seq)
  int64_t bytes = 0;
  int first = -1, last = -1;  // live range in calls (Arena)
  // Offloaded (Arena): the calls that copy it out and back in; its arena
  // bytes are free in between, and its host copy lives at host_offset of
  // the offload arena. -1 when it stays on the device.
  int evict = -1, reload = -1;
  int64_t host_offset = -1;
  // Arena: the buffer whose bytes it takes over, or -1. An elementwise
  // stage (every op OpInfo::elementwise, on the output's axes) writes its
  // output over an input of its type that dies at that call: the running
  // sum of a gradient's parts, say; a ring block's library backward, its
  // dQ sum over the running sum it adds to (Stage::dq_sum_in). They share
  // an offset, and their live ranges meet only at that call, except that a
  // sum adding one tile's rows (x + pad_seq(t)) may take over x while later
  // calls still read other tiles' rows of x, or of a buffer x took over:
  // views of rows that no write in between changed.
  int in_place_of = -1;
  // Arena: the call where a later buffer takes over its bytes, or -1; it
  // holds them up to there (views may read them after: above).
  int handed_over = -1;
  // Its live ranges on the device: [first, last], or [first, evict] and [reload, last].
  std::vector<std::pair<int, int>> device_ranges() const;
  // The calls where its bytes are its own: its device ranges, from the
  // call after the handover when written in place (empty ranges dropped).
  std::vector<std::pair<int, int>> held_ranges() const;
};

struct PlannedCall {
  int stage = -1;
  std::vector<int> args;  // buffer indices: inputs, then the output(s)
  // The finish of a collective that an earlier call of the same stage
  // started (a ring shift, a Ulysses all-to-all): placed just before the
  // first call that reads its output, so the kernels between run while the
  // data moves. Its input stays alive until here.
  bool wait = false;
  // An offloaded value's copy to the host (Evict: args = {buffer}) or back
  // to its arena bytes (Reload); stage -1.
  enum class Move { None, Evict, Reload } move = Move::None;
};

struct Program {
  std::vector<PlannedBuffer> buffers;
  std::vector<PlannedCall> calls;
  int64_t arena_bytes = 0;
  int64_t offload_bytes = 0;  // the host arena of offloaded values
  int loss = -1;
  // A train step's gradients are partial sums over the ranks of a dp x sp
  // mesh: the step ends by summing them over the mesh.
  bool reduce_grads = false;
};

// params[i] and grads[i] (grad node of param i, or -1) fix the caller's
// buffers; inputs are found by name (input_ids, position_ids, labels).
// `offload` says which values the schedule offloads: such a value is, if it
// is used both up to the call that writes the loss and after it.
Program plan_program(const Graph& g, const Partition& p, const std::vector<int>& params,
                     const std::vector<int>& grads, int loss,
                     const std::function<bool(const Node&)>& offload = {});

}  // namespace halyard
