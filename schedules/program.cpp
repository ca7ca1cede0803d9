// The step program and its memory plan (see program.h).
#include "schedules/program.h"
#include "schedules/sharding.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <set>

#include "dsl/error.h"
#include "dsl/op_table.h"

namespace halyard {
namespace {

int64_t element_bytes(DType t) {
  switch (t) {
    case DType::f64: return 8;
    case DType::bf16: return 2;
    default: return 4;
  }
}

// Greedy placement: largest first, each at the lowest offset that overlaps
// no buffer placed before it whose live ranges (ranges[i] of buffer i) meet
// its own. Sets each one's `offset` member and returns the arena's size.
using Ranges = std::vector<std::pair<int, int>>;
int64_t place(std::vector<PlannedBuffer>& buffers, std::vector<int> order, const std::vector<Ranges>& ranges,
              int64_t PlannedBuffer::*offset) {
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return buffers[static_cast<size_t>(a)].bytes > buffers[static_cast<size_t>(b)].bytes;
  });
  auto meet = [](const Ranges& x, const Ranges& y) {
    for (auto [a0, a1] : x)
      for (auto [b0, b1] : y)
        if (a0 <= b1 && b0 <= a1) return true;
    return false;
  };
  // Each buffer's first and last call: most pairs are apart by those alone.
  std::vector<std::pair<int, int>> span(ranges.size(), {INT32_MAX, INT32_MIN});
  int t0 = INT32_MAX, t1 = INT32_MIN;
  for (int i : order) {
    auto& [lo, hi] = span[static_cast<size_t>(i)];
    for (auto [a0, a1] : ranges[static_cast<size_t>(i)]) lo = std::min(lo, a0), hi = std::max(hi, a1);
    if (lo <= hi) t0 = std::min(t0, lo), t1 = std::max(t1, hi);
  }
  // The placed buffers by the windows of calls their spans touch, and by
  // the window where each starts, so that a buffer looks only at those alive
  // near its own calls, each once: a span meets [first, last] when it holds
  // `first` (among those touching first's window) or starts after it, up to
  // `last` (among those starting in its windows). A scan of every placed one
  // (up to 650 a plan) took a fifth of the 8B --seq max search.
  constexpr int kWindow = 32;
  const int windows = t0 <= t1 ? (t1 - t0) / kWindow + 1 : 0;
  std::vector<std::vector<int>> touching(static_cast<size_t>(windows)), starting(touching);
  int64_t size_of_arena = 0;
  std::vector<std::pair<int64_t, int64_t>> busy;
  for (int i : order) {
    PlannedBuffer& b = buffers[static_cast<size_t>(i)];
    const int64_t size = arena_aligned(b.bytes);
    const auto [first, last] = span[static_cast<size_t>(i)];
    // its windows (none where it is never used)
    const int w0 = first <= last ? (first - t0) / kWindow : 0, w1 = first <= last ? (last - t0) / kWindow : -1;
    busy.clear();
    auto consider = [&](int j) {
      if (meet(ranges[static_cast<size_t>(i)], ranges[static_cast<size_t>(j)])) {
        const PlannedBuffer& o = buffers[static_cast<size_t>(j)];
        busy.push_back({o.*offset, o.*offset + arena_aligned(o.bytes)});
      }
    };
    if (w0 <= w1) {
      for (int j : touching[static_cast<size_t>(w0)])
        if (span[static_cast<size_t>(j)].first <= first && first <= span[static_cast<size_t>(j)].second) consider(j);
      for (int w = w0; w <= w1; ++w)
        for (int j : starting[static_cast<size_t>(w)])
          if (first < span[static_cast<size_t>(j)].first && span[static_cast<size_t>(j)].first <= last) consider(j);
    }
    // The lowest offset free of them: a pass moves `at` past every busy
    // range it meets, and never past the answer (a range that meets [at,
    // at + size) ends at or below every free offset above at). Buffers of
    // a 70B search settle in 2 to 5 passes, 18 at most; where passes keep
    // moving, a sweep in order of offset goes on from there. (Sorting every
    // list first took a third of that search.)
    int64_t at = 0;
    bool moved = true;
    for (int pass = 0; moved && pass < 32; ++pass) {
      moved = false;
      for (auto [lo, hi] : busy)
        if (lo < at + size && at < hi) at = hi, moved = true;
    }
    if (moved) {
      std::sort(busy.begin(), busy.end());
      for (auto [lo, hi] : busy) {
        if (at + size <= lo) break;
        at = std::max(at, hi);
      }
    }
    b.*offset = at;
    size_of_arena = std::max(size_of_arena, at + size);
    for (int w = w0; w <= w1; ++w) touching[static_cast<size_t>(w)].push_back(i);
    if (w0 <= w1) starting[static_cast<size_t>(w0)].push_back(i);
  }
  return size_of_arena;
}

// The inputs whose bytes the stage's kernel may write its last output
// over, where one has the output's type: every op it computes reads such an
// input only at the position it writes. So every node on the way from the
// output to it is elementwise and on the output's axes, in its order (an op
// indexes its operands by axis name: another order would read elsewhere).
// A tile padded to the sequence reads its own input at other rows: that
// input is not one. Halide's pointwise kernels read an element before
// writing it, and their vector tails are guarded, never shifted back over
// elements already written (generators/schedule_cpu.cpp, schedule_gpu.cpp).
// A ring block's library backward reads the running dQ sum it adds to one
// row of one head at a time, just before writing that row
// (runtime/attention_cpu.h).
// (What the stage inlines only for operands its ops never read, such as
// RoPE of q for ring attention's merge, is never computed: not checked.)
std::vector<int> may_write_over(const Graph& g, const Stage& st) {
  if (st.dq_sum_in >= 0) return {st.dq_sum_in};
  if (st.kernel < 0 || st.library || st.gemm || !st.extra_outputs.empty()) return {};
  const TensorType& out = g.node(st.root).type;
  const std::set<int> inlined(st.inlined.begin(), st.inlined.end());
  auto operands = [&](const Node& n, std::vector<int>& todo, std::set<int>& seen) {
    const OpInfo& info = op_info(n.op);
    for (size_t k = 0; k < n.inputs.size(); ++k)
      if (!(info.unread_operand && info.unread_operand(k, n.inputs.size())) && seen.insert(n.inputs[k]).second)
        todo.push_back(n.inputs[k]);
  };
  std::set<int> seen = {st.root}, elsewhere;  // the latter: read at other rows, through a pad
  for (std::vector<int> todo = {st.root}; !todo.empty();) {
    const Node& n = g.node(todo.back());
    todo.pop_back();
    if (!inlined.count(n.id) && n.id != st.root) continue;  // a buffer
    if (n.op == Op::PadSeq && n.id != st.root) {
      for (std::vector<int> below = {n.id}; !below.empty();) {
        const Node& x = g.node(below.back());
        below.pop_back();
        if (inlined.count(x.id) || x.id == n.id) operands(x, below, elsewhere);
      }
      continue;
    }
    if (!op_info(n.op).elementwise || n.type.axes != out.axes) return {};
    operands(n, todo, seen);
  }
  std::vector<int> over;
  for (int i : st.inputs)
    if (!elsewhere.count(i)) over.push_back(i);
  return over;
}

// The rows of seq where the stage's output may differ from `input`, which
// it writes over: a running sum adding a tile padded to the sequence adds
// zero outside the tile's rows. [0, INT64_MAX): everywhere.
std::pair<int64_t, int64_t> rows_changed(const Graph& g, const Stage& st, int input) {
  const Node& r = g.node(st.root);
  if (r.op == Op::Add && st.dq_sum_in < 0)
    for (size_t k = 0; k < 2; ++k) {
      const Node& other = g.node(r.inputs[1 - k]);
      if (r.inputs[k] == input && other.op == Op::PadSeq &&
          std::find(st.inlined.begin(), st.inlined.end(), other.id) != st.inlined.end())
        return {other.attrs.offset, other.attrs.offset + g.node(other.inputs[0]).type.size("seq")};
    }
  return {0, INT64_MAX};
}

}  // namespace

std::vector<std::pair<int, int>> PlannedBuffer::device_ranges() const {
  if (evict < 0) return {{first, last}};
  return {{first, evict}, {reload, last}};
}

std::vector<std::pair<int, int>> PlannedBuffer::held_ranges() const {
  std::vector<std::pair<int, int>> r = device_ranges();
  if (in_place_of >= 0) ++r.front().first;
  if (handed_over >= 0)
    for (auto& x : r) x.second = std::min(x.second, handed_over);
  std::erase_if(r, [](const std::pair<int, int>& x) { return x.first > x.second; });
  return r;
}

Program plan_program(const Graph& g, const Partition& p, const std::vector<int>& params,
                     const std::vector<int>& grads, int loss, const std::function<bool(const Node&)>& offload) {
  Program prog;
  std::map<int, int> buffer_of;  // node -> buffer
  std::function<int(int)> buffer = [&](int node) -> int {
    if (auto it = buffer_of.find(node); it != buffer_of.end()) return it->second;
    const Node& n = g.node(node);
    PlannedBuffer b;
    b.node = node;
    b.bytes = n.type.numel() * element_bytes(n.type.dtype);
    if (n.op == Op::Input) {
      b.kind = BufferKind::Input;
      if (n.name == "input_ids") b.index = 0;
      else if (n.name == "position_ids") b.index = 1;
      else if (n.name == "labels") b.index = 2;
      else if (n.name == kTokenIndexInput) b.index = 3;
      else throw UserError("error: model input \"" + n.name + "\" is not one the runtime feeds.\n"
                           "legal inputs: input_ids, position_ids, labels.");
    } else if (n.op == Op::Param) {
      b.kind = BufferKind::Param;
      b.index = static_cast<int>(std::find(params.begin(), params.end(), node) - params.begin());
      HALYARD_CHECK(b.index < static_cast<int>(params.size()), "unlisted parameter " << n.name);
    } else if (n.op == Op::SliceSeq) {
      b.kind = BufferKind::View;
      b.bytes = 0;
      b.offset = n.attrs.offset;
      b.dim = n.type.index_of("seq");
      b.index = buffer(n.inputs[0]);
    } else if (auto it = std::find(grads.begin(), grads.end(), node); it != grads.end()) {
      b.kind = BufferKind::Grad;
      b.index = static_cast<int>(it - grads.begin());
    }
    prog.buffers.push_back(b);
    return buffer_of[node] = static_cast<int>(prog.buffers.size()) - 1;
  };
  std::vector<PlannedCall> calls;
  std::vector<size_t> started;  // calls of background collectives whose wait is not placed yet
  auto reads = [](const PlannedCall& c, int buffer, size_t outputs) {
    return std::find(c.args.begin(), c.args.end() - static_cast<std::ptrdiff_t>(outputs), buffer) !=
           c.args.end() - static_cast<std::ptrdiff_t>(outputs);
  };
  // Collectives that run in the background: started at their place (a
  // Ulysses all-to-all as soon as its input is computed, below), finished
  // just before their output's first reader.
  auto background = [&](const Stage& st) {
    const Op op = g.node(st.root).op;
    return op == Op::RingShift || op == Op::SeqToHeads || op == Op::HeadsToSeq;
  };
  // A Ulysses all-to-all starts right after the kernel that computes its
  // input, so that the projections after it (k, v after q) run while it
  // moves; a backward's all-to-all of a value the forward computed stays
  // in the backward (hoisted into the forward, its output would live
  // through both, as if it were saved). (Ring passes are placed by the
  // sharding itself: each starts when the pass before it has arrived.)
  std::vector<size_t> stage_order;
  {
    std::map<int, size_t> producer;  // node -> stage writing it
    for (size_t s = 0; s < p.stages.size(); ++s) {
      producer[p.stages[s].root] = s;
      for (int x : p.stages[s].extra_outputs) producer[x] = s;
    }
    std::map<size_t, std::vector<size_t>> after;  // stage -> all-to-alls hoisted to just after it
    std::vector<bool> hoisted(p.stages.size(), false);
    for (size_t s = 0; s < p.stages.size(); ++s) {
      const Op op = g.node(p.stages[s].root).op;
      if (op != Op::SeqToHeads && op != Op::HeadsToSeq) continue;
      auto it = producer.find(p.stages[s].inputs.at(0));
      if (it == producer.end() || is_runtime_op(g.node(p.stages[it->second].root).op)) continue;
      if (g.node(p.stages[it->second].root).backward != g.node(p.stages[s].root).backward) continue;
      after[it->second].push_back(s);
      hoisted[s] = true;
    }
    for (size_t s = 0; s < p.stages.size(); ++s) {
      if (hoisted[s]) continue;
      stage_order.push_back(s);
      for (size_t h : after[s]) stage_order.push_back(h);
    }
  }
  auto place_wait = [&](size_t k) {
    PlannedCall w = calls[started[k]];
    w.wait = true;
    calls.push_back(std::move(w));
    started.erase(started.begin() + static_cast<std::ptrdiff_t>(k));
  };
  for (size_t s : stage_order) {
    const Stage& st = p.stages[s];
    PlannedCall c;
    c.stage = static_cast<int>(s);
    for (int in : st.inputs) c.args.push_back(buffer(in));
    c.args.push_back(buffer(st.root));
    for (int x : st.extra_outputs) c.args.push_back(buffer(x));
    for (size_t k = 0; k < started.size();)  // in the order they started
      if (reads(c, calls[started[k]].args.back(), 1 + st.extra_outputs.size())) place_wait(k);
      else ++k;
    if (background(st)) started.push_back(calls.size());
    calls.push_back(std::move(c));
  }
  while (!started.empty()) place_wait(started.size() - 1);
  const int loss_buffer = buffer(loss);

  // Each buffer's uses, in call order (a view's uses keep its buffer alive).
  auto uses_of = [&](const std::vector<PlannedCall>& cs) {
    std::vector<std::vector<int>> uses(prog.buffers.size());
    for (size_t c = 0; c < cs.size(); ++c)
      for (int a : cs[c].args)
        for (int v = a; v >= 0;) {
          const PlannedBuffer& b = prog.buffers[static_cast<size_t>(v)];
          if (uses[static_cast<size_t>(v)].empty() || uses[static_cast<size_t>(v)].back() != static_cast<int>(c))
            uses[static_cast<size_t>(v)].push_back(static_cast<int>(c));
          v = b.kind == BufferKind::View ? b.index : -1;
        }
    return uses;
  };
  // Offloaded values: out after their last use up to the loss, back in
  // before their first use after it.
  std::map<int, std::vector<PlannedCall>> before, after;  // call -> moves placed there
  if (offload) {
    const std::vector<std::vector<int>> uses = uses_of(calls);
    int loss_call = -1;
    for (size_t c = 0; c < calls.size(); ++c) {
      const size_t outputs = 1 + p.stages[static_cast<size_t>(calls[c].stage)].extra_outputs.size();
      if (!calls[c].wait && std::find(calls[c].args.end() - static_cast<std::ptrdiff_t>(outputs), calls[c].args.end(),
                                      loss_buffer) != calls[c].args.end())
        loss_call = static_cast<int>(c);
    }
    for (size_t b = 0; b < prog.buffers.size(); ++b) {
      const PlannedBuffer& pb = prog.buffers[b];
      if (pb.kind != BufferKind::Arena || static_cast<int>(b) == loss_buffer || !offload(g.node(pb.node))) continue;
      const std::vector<int>& u = uses[b];
      const auto next = std::upper_bound(u.begin(), u.end(), loss_call);
      if (next == u.begin() || next == u.end() || *next - *(next - 1) < 2) continue;  // nothing between to lend its bytes to
      PlannedCall out, in;
      out.args = in.args = {static_cast<int>(b)};
      out.move = PlannedCall::Move::Evict;
      in.move = PlannedCall::Move::Reload;
      after[*(next - 1)].push_back(out);
      before[*next].push_back(in);
    }
  }
  std::vector<PlannedCall> ordered;
  for (size_t c = 0; c < calls.size(); ++c) {
    for (PlannedCall& m : before[static_cast<int>(c)]) ordered.push_back(std::move(m));
    ordered.push_back(std::move(calls[c]));
    for (PlannedCall& m : after[static_cast<int>(c)]) ordered.push_back(std::move(m));
  }
  const std::vector<std::vector<int>> uses = uses_of(ordered);
  for (size_t b = 0; b < prog.buffers.size(); ++b)
    if (!uses[b].empty()) prog.buffers[b].first = uses[b].front(), prog.buffers[b].last = uses[b].back();
  for (size_t c = 0; c < ordered.size(); ++c) {
    PlannedBuffer& b = prog.buffers[static_cast<size_t>(ordered[c].args.front())];
    if (ordered[c].move == PlannedCall::Move::Evict) b.evict = static_cast<int>(c);
    if (ordered[c].move == PlannedCall::Move::Reload) b.reload = static_cast<int>(c);
  }
  prog.calls = std::move(ordered);
  prog.reduce_grads = !grads.empty();  // a no-op on one rank
  prog.loss = loss_buffer;
  prog.buffers[static_cast<size_t>(prog.loss)].last = static_cast<int>(prog.calls.size());  // read after the step

  // Outputs written over an input that dies at their call, or whose later
  // reads, and those of every buffer whose bytes it holds, are of rows the
  // call leaves as they were (a sum adding each tile's part to a running
  // sum over the residual stream's gradient, while later tiles read their
  // rows of it). (Values that leave the device keep bytes of their own.)
  struct Read {
    int call;
    int64_t lo, hi;  // rows of seq
    bool view;
  };
  std::vector<std::vector<Read>> reads_of(prog.buffers.size());
  for (size_t c = 0; c < prog.calls.size(); ++c)
    for (int a : prog.calls[c].args) {
      Read r{static_cast<int>(c), 0, INT64_MAX, false};
      for (int v = a; prog.buffers[static_cast<size_t>(v)].kind == BufferKind::View;) {
        const PlannedBuffer& view = prog.buffers[static_cast<size_t>(v)];
        if (!r.view) r.hi = g.node(view.node).type.size("seq"), r.lo = 0, r.view = true;
        r.lo += view.offset, r.hi += view.offset;
        a = v = view.index;
      }
      reads_of[static_cast<size_t>(a)].push_back(r);
    }
  for (size_t c = 0; c < prog.calls.size(); ++c) {
    const PlannedCall& call = prog.calls[c];
    if (call.wait || call.move != PlannedCall::Move::None) continue;
    PlannedBuffer& out = prog.buffers[static_cast<size_t>(call.args.back())];
    if (out.kind != BufferKind::Arena || out.first != static_cast<int>(c) || out.evict >= 0) continue;
    const Stage& st = p.stages[static_cast<size_t>(call.stage)];
    const std::vector<int> over = may_write_over(g, st);
    for (auto a = call.args.begin(); a + 1 < call.args.end(); ++a) {
      PlannedBuffer& in = prog.buffers[static_cast<size_t>(*a)];
      if (std::find(over.begin(), over.end(), in.node) == over.end()) continue;
      if (in.kind != BufferKind::Arena || in.evict >= 0 || *a == prog.loss || g.node(in.node).type != g.node(out.node).type)
        continue;
      const auto [lo, hi] = rows_changed(g, st, in.node);
      bool clear = true;
      for (int b = *a; b >= 0 && clear; b = prog.buffers[static_cast<size_t>(b)].in_place_of)
        for (const Read& r : reads_of[static_cast<size_t>(b)])
          if ((r.call > static_cast<int>(c) && r.lo < hi && lo < r.hi) ||
              (r.call == static_cast<int>(c) && (b != *a || r.view)))
            clear = false;
      if (clear) {
        out.in_place_of = *a;
        in.handed_over = static_cast<int>(c);
        break;
      }
    }
  }

  // The device arena by each buffer's device live ranges, a buffer written
  // in place together with those it took over; the host arena of offloaded
  // values by their time away, from offload to reload.
  std::vector<int> arena, offloaded;
  std::vector<Ranges> on_device(prog.buffers.size()), away(prog.buffers.size());
  auto owner = [&](size_t i) {
    while (prog.buffers[i].in_place_of >= 0) i = static_cast<size_t>(prog.buffers[i].in_place_of);
    return i;
  };
  for (size_t i = 0; i < prog.buffers.size(); ++i) {
    const PlannedBuffer& b = prog.buffers[i];
    if (b.kind == BufferKind::Arena) {
      const size_t o = owner(i);
      if (o == i) arena.push_back(static_cast<int>(i));
      for (auto r : b.device_ranges()) on_device[o].push_back(r);
    }
    if (b.evict >= 0) offloaded.push_back(static_cast<int>(i)), away[i] = {{b.evict, b.reload}};
  }
  prog.arena_bytes = place(prog.buffers, arena, on_device, &PlannedBuffer::offset);
  for (size_t i = 0; i < prog.buffers.size(); ++i)
    if (prog.buffers[i].kind == BufferKind::Arena) prog.buffers[i].offset = prog.buffers[owner(i)].offset;
  prog.offload_bytes = place(prog.buffers, offloaded, away, &PlannedBuffer::host_offset);
  return prog;
}

}  // namespace halyard
