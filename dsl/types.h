// Named axes, dtypes and tensor types.
//
// Axes are named, never positional: a tensor's type is a dtype plus an ordered
// list of (name, size) pairs, printed as `f32[seq=4096, model=512]`. The order
// is the memory layout (row-major, last axis fastest); the names carry the
// meaning. Axis names come from one fixed vocabulary so that schedules can
// speak about `seq` or `heads` of any tensor.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace halyard {

// The axis vocabulary, in a stable order used by error messages.
const std::vector<std::string>& known_axes();
bool is_known_axis(std::string_view name);

enum class DType { f32, f64, bf16, i32 };

std::string_view dtype_name(DType t);
// f32 and f64 are computed in; bf16 is a storage type only (planned).
bool is_float(DType t);

// An axis may be sharded over a mesh axis (schedules/sharding.h): then `size`
// is this rank's extent (what kernels see), `shard` names the mesh axis and
// `global` is the extent over all ranks, padding included. A tensor is
// printed with global sizes: f32[seq=65536@sp, model=4096].
struct Axis {
  Axis() = default;
  Axis(std::string n, int64_t sz, std::string sh = "", int64_t gl = 0)
      : name(std::move(n)), size(sz), shard(std::move(sh)), global(gl) {}
  std::string name;
  int64_t size = 0;
  std::string shard;   // "" = whole on every rank
  int64_t global = 0;  // sharded axes: the extent over the mesh axis
  bool sharded() const { return !shard.empty(); }
  bool operator==(const Axis&) const = default;
};

struct TensorType {
  DType dtype = DType::f32;
  std::vector<Axis> axes;

  int rank() const { return static_cast<int>(axes.size()); }
  int64_t numel() const;
  // Position of an axis in the layout, or -1 when the tensor has no such axis.
  int index_of(std::string_view name) const;
  bool has(std::string_view name) const { return index_of(name) >= 0; }
  int64_t size(std::string_view name) const;  // the axis must exist
  std::vector<std::string> axis_names() const;
  std::vector<int64_t> shape() const;
  std::string str() const;  // f32[seq=4096, model=512]

  bool operator==(const TensorType&) const = default;
};

// Checks a user-written type: every axis known, none twice, sizes positive.
// `what` names the tensor in the error ("parameter \"model.norm.weight\"").
TensorType make_type(DType dtype, std::vector<Axis> axes, const std::string& what);

std::string join(const std::vector<std::string>& parts, std::string_view sep = ", ");

}  // namespace halyard
