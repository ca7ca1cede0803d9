// The reference interpreter: evaluates any graph, forward and backward, on the
// CPU with Eigen, in f32 or f64.
//
// It is the oracle every later stage (generated kernels, sharded schedules) is
// checked against, so it favours clarity over speed: every value is kept, each
// op is computed directly from its definition, and tensors are dense row-major
// arrays in their type's axis order. bf16 values are computed as T.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dsl/graph.h"

namespace halyard {

template <class T>
class Interpreter {
 public:
  explicit Interpreter(const Graph& g);

  // Binds a float input or parameter by name (size must match its type).
  void set(const std::string& name, std::vector<T> data);
  // Binds an integer input (token ids, labels, positions) by name.
  void set_int(const std::string& name, std::vector<int32_t> data);

  // Evaluates nodes 0..last (all when last < 0). Throws UserError on unbound
  // inputs or out-of-range ids/labels, naming the tensor and the position.
  void run(int last = -1);

  const std::vector<T>& value(int id) const;
  const std::vector<T>& value(Value v) const { return value(v.id); }
  T scalar(Value v) const;

 private:
  void eval(const Node& n);

  const Graph& g_;
  std::vector<std::vector<T>> f_;
  std::vector<std::vector<int32_t>> i_;
  std::vector<bool> bound_;
};

extern template class Interpreter<float>;
extern template class Interpreter<double>;

}  // namespace halyard
