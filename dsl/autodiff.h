// Reverse-mode autodiff over the graph IR.
//
// grad() appends the backward pass to the same graph, so the result is one
// joint forward+backward graph (what the scheduler sees). Each op's VJP rule
// (dsl/vjp.cpp) is written with the DSL's own builders; backward nodes are
// marked, and the forward values they read are the graph's residuals.
#pragma once

#include <map>
#include <vector>

#include "dsl/graph.h"

namespace halyard {

struct Gradients {
  std::map<int, Value> of;  // forward value id -> its gradient
  Value operator[](Value v) const;
};

// d loss / d wrt for each wrt (params or float inputs). A wrt value that does
// not influence the loss gets a zero gradient.
Gradients grad(Value loss, const std::vector<Value>& wrt);

// The VJP rule of one forward node: given the cotangent of its output, the
// cotangents of the inputs selected by `needed` (others left empty).
std::vector<Value> vjp(Graph& g, const Node& n, Value dout, const std::vector<bool>& needed);

}  // namespace halyard
