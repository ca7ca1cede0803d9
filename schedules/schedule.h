// A schedule as plain data: what a model's joint graph is lowered with.
//
// Like Halide's Schedule, it is a value that prints, compares, serializes and
// diffs; directives only edit it. This single-rank vocabulary says which cheap
// forward values the backward recomputes instead of reading saved copies, and
// whether kernels get Halyard's hand-written loop schedules or Halide's
// Adams2019 autoscheduler; and how the sequence is split over ranks
// (schedules/sharding.h). Sequence tiling extends it.
#pragma once

#include <functional>
#include <set>
#include <string>

#include "dsl/graph.h"

namespace halyard {

struct Schedule {
  std::string name = "default";
  // Ops whose forward outputs the backward recomputes (AutoSP's "cheap,
  // memory-heavy" class): any of rms_norm, rope, silu, mul.
  std::set<std::string> recompute;
  // "" for the hand-written loop schedules, or a Halide autoscheduler name.
  std::string autoscheduler;
  // Activation checkpointing: the backward recomputes every forward value
  // except the residual stream (adds, the embedding) and attention outputs,
  // AutoSP's policy at long sequence (matmuls are recomputed, attention is not).
  bool checkpoint = false;
  // split_sequence(sp): activations are split on seq over this mesh axis
  // ("" = one rank holds the whole sequence).
  std::string split_sequence;
  // redistribute_heads(<every attention>, strategy): how attention sees the
  // whole sequence when it is split. "ulysses": all-to-all from seq@sp to
  // heads@sp before attention and back after it. (ring and hybrid come later.)
  std::string redistribute_heads;
  // tile_sequence(T): the MLP and the LM head + loss run in tiles of T tokens
  // (schedules/tiling.h); 0 = whole sequence.
  int64_t seq_tile = 0;

  // The predicate grad() uses for checkpointing (empty when it is off).
  std::function<bool(const Node&)> rematerialize() const;

  bool recomputes(const std::string& op) const { return recompute.count(op) > 0; }
  bool operator==(const Schedule&) const = default;

  std::string to_json() const;
  std::string str() const;  // one line, for plan reports and generated headers

  // default | recompute | checkpoint | autoscheduled | tiled | ulysses | ulysses_checkpoint,
  // or a path to a schedule .json file.
  static Schedule named(const std::string& name_or_path);
  static Schedule parse(const std::string& json_text, const std::string& what);
};

}  // namespace halyard
