// Reverse-mode autodiff over the graph IR.
//
// grad() appends the backward pass to the same graph, so the result is one
// joint forward+backward graph (what the scheduler sees). Each op's VJP rule
// (dsl/vjp.cpp) is written with the DSL's own builders; backward nodes are
// marked, and the forward values they read are the graph's residuals.
#pragma once

#include <functional>
#include <map>
#include <vector>

#include "dsl/graph.h"
#include "dsl/op_table.h"

namespace halyard {

struct Gradients {
  std::map<int, Value> of;  // forward value id -> its gradient
  Value operator[](Value v) const;
};

struct GradOptions {
  // Forward values the backward recomputes from their inputs instead of
  // reading them (activation checkpointing): each VJP that reads such a value
  // reads a clone built in the backward, computed again from the nearest
  // values the predicate keeps. Cheap-op recompute is the partition's job;
  // this is for whole subgraphs, matmuls included.
  std::function<bool(const Node&)> rematerialize;
};

// d loss / d wrt for each wrt (params or float inputs). A wrt value that does
// not influence the loss gets a zero gradient.
Gradients grad(Value loss, const std::vector<Value>& wrt, const GradOptions& options = {});

// The VJP rule of one forward node: given the cotangent of its output, the
// cotangents of the inputs selected by `needed` (others left empty).
std::vector<Value> vjp(Graph& g, const Node& n, Value dout, const std::vector<bool>& needed, const ForwardValue& fwd);

}  // namespace halyard
