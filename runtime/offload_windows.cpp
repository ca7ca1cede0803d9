// Copy windows of offloaded values (see offload_windows.h).
#include "runtime/offload_windows.h"

#include <algorithm>
#include <cstdint>

namespace halyard::runtime {
namespace {

// Arena byte ranges a buffer covers: [lo, hi), or empty (lo == hi) outside the arena.
struct Range {
  int64_t lo = 0, hi = 0;
  bool overlaps(const Range& o) const { return lo < o.hi && o.lo < hi; }
};

Range arena_range(const ProgramSpec& p, int b) {
  const BufferSpec& s = p.buffers[b];
  if (s.storage == Storage::Arena) return {s.offset, s.offset + buffer_bytes(s)};
  if (s.storage != Storage::View) return {};
  // A tile: rows [offset, offset + shape[dim]) of its buffer along dim,
  // with that buffer's strides; its first byte to one past its last.
  const Range of = arena_range(p, s.index);
  if (of.lo == of.hi) return {};
  const BufferSpec& base = p.buffers[s.index];
  int64_t row = elem_bytes(base.type);
  for (int d = s.dim + 1; d < base.rank; ++d) row *= base.shape[d];
  int64_t outer_stride = row * base.shape[s.dim], outer = 1;
  for (int d = 0; d < s.dim; ++d) outer *= base.shape[d];
  const int64_t first = of.lo + s.offset * row;
  const int64_t last = of.lo + (outer - 1) * outer_stride + (s.offset + s.shape[s.dim]) * row;
  return {first, last};
}

}  // namespace

std::vector<CopyWindow> copy_windows(const ProgramSpec& p) {
  std::vector<Range> range(static_cast<size_t>(p.num_buffers));
  for (int b = 0; b < p.num_buffers; ++b) range[static_cast<size_t>(b)] = arena_range(p, b);
  // Whether call c touches bytes of `r` through a buffer other than `self`.
  auto touches = [&](int c, const Range& r, int self, bool others_only) {
    const CallSpec& call = p.calls[c];
    if (call.kind == CallKind::Offload || call.kind == CallKind::Reload) return false;  // the copies themselves
    for (int a = 0; a < call.num_args; ++a) {
      const int b = call.args[a];
      if (others_only && b == self) continue;
      if (range[static_cast<size_t>(b)].overlaps(r)) return true;
    }
    return false;
  };
  std::vector<CopyWindow> out;
  std::vector<int> offloaded_at(static_cast<size_t>(p.num_buffers), -1);
  for (int c = 0; c < p.num_calls; ++c) {
    const CallSpec& call = p.calls[c];
    if (call.kind != CallKind::Offload && call.kind != CallKind::Reload) continue;
    const int b = call.args[0];
    const Range r = range[static_cast<size_t>(b)];
    CopyWindow w{c, c, p.num_calls};
    for (int k = c + 1; k < p.num_calls; ++k)
      if (touches(k, r, b, false)) {
        w.finish = k;
        break;
      }
    if (call.kind == CallKind::Offload) {
      offloaded_at[static_cast<size_t>(b)] = c;
    } else {
      const int from = offloaded_at[static_cast<size_t>(b)];
      w.start = from + 1;
      for (int k = c - 1; k > from; --k)
        if (touches(k, r, b, true)) {
          w.start = k + 1;
          break;
        }
    }
    out.push_back(w);
  }
  return out;
}

}  // namespace halyard::runtime
