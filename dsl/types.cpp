// Named axes, dtypes and tensor types (see types.h).
#include "dsl/types.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "dsl/error.h"

namespace halyard {

void internal_error(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: %s\n(this is a bug in Halyard, not in your model)\n",
               file, line, what.c_str());
  std::abort();
}

int64_t parse_count(const std::string& flag, const std::string& text) {
  size_t used = 0;
  long long n = 0;
  try {
    n = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size() || n < 1 || text[0] < '0' || text[0] > '9')
    throw UserError("error: " + flag + " \"" + text + "\" is not a whole number >= 1.");
  return n;
}

int64_t parse_integer(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
  size_t used = 0;
  long long n = 0;
  bool ok = !text.empty() && (std::isdigit(static_cast<unsigned char>(text[0])) || (text[0] == '-' && lo < 0));
  if (ok) {
    try {
      n = std::stoll(text, &used);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  if (!ok || used != text.size() || n < lo || n > hi)
    throw UserError("error: " + flag + " \"" + text + "\" is not a whole number from " + std::to_string(lo) + " to " +
                    std::to_string(hi) + ".");
  return n;
}

double parse_real(const std::string& flag, const std::string& text, double lo, bool lo_inclusive) {
  size_t used = 0;
  double x = 0;
  bool ok = !text.empty() && !std::isspace(static_cast<unsigned char>(text[0]));
  if (ok) {
    try {
      x = std::stod(text, &used);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  if (!ok || used != text.size() || !std::isfinite(x) || x < lo || (!lo_inclusive && x == lo)) {
    std::ostringstream bound;
    bound << (lo_inclusive ? ">= " : "> ") << lo;
    throw UserError("error: " + flag + " \"" + text + "\" is not a finite number " + bound.str() + ".");
  }
  return x;
}

const std::vector<std::string>& known_axes() {
  static const std::vector<std::string> axes = {
      "batch", "seq", "kv_seq", "heads", "kv_heads", "head_dim", "model", "ffn", "vocab"};
  return axes;
}

bool is_known_axis(std::string_view name) {
  const auto& axes = known_axes();
  return std::find(axes.begin(), axes.end(), name) != axes.end();
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
  }
  return "?";
}

bool is_float(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16; }

int64_t TensorType::numel() const {
  int64_t n = 1;
  for (const Axis& a : axes) n *= a.size;
  return n;
}

int TensorType::index_of(std::string_view name) const {
  for (size_t i = 0; i < axes.size(); ++i)
    if (axes[i].name == name) return static_cast<int>(i);
  return -1;
}

int64_t TensorType::size(std::string_view name) const {
  int i = index_of(name);
  HALYARD_CHECK(i >= 0, "axis " << name << " not in " << str());
  return axes[i].size;
}

std::vector<std::string> TensorType::axis_names() const {
  std::vector<std::string> names;
  for (const Axis& a : axes) names.push_back(a.name);
  return names;
}

std::vector<int64_t> TensorType::shape() const {
  std::vector<int64_t> s;
  for (const Axis& a : axes) s.push_back(a.size);
  return s;
}

// (No stream: the partition keys every stage by these strings, and AutoSP
// partitions thousands of plans.)
std::string TensorType::str() const {
  std::string s(dtype_name(dtype));
  s += '[';
  for (size_t i = 0; i < axes.size(); ++i) {
    const Axis& a = axes[i];
    if (i) s += ", ";
    s += a.name;
    s += '=';
    s += std::to_string(a.sharded() ? a.global : a.size);
    if (a.sharded()) {
      s += '@';
      s += a.shard;
    }
  }
  s += ']';
  return s;
}

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

TensorType make_type(DType dtype, std::vector<Axis> axes, const std::string& what) {
  TensorType t{dtype, std::move(axes)};
  for (size_t i = 0; i < t.axes.size(); ++i) {
    const Axis& a = t.axes[i];
    if (!is_known_axis(a.name))
      throw UserError("error: " + what + " " + t.str() + "\nunknown axis \"" + a.name +
                      "\".\nlegal axes: " + join(known_axes()));
    for (size_t j = 0; j < i; ++j)
      if (t.axes[j].name == a.name)
        throw UserError("error: " + what + " " + t.str() + "\naxis \"" + a.name +
                        "\" appears twice; each axis may appear once in a tensor.\n"
                        "give the second one another name (e.g. kv_seq for keys' sequence).");
    if (a.size <= 0)
      throw UserError("error: " + what + " " + t.str() + "\naxis \"" + a.name + "\" has size " +
                      std::to_string(a.size) + "; sizes must be positive.");
  }
  return t;
}

}  // namespace halyard
