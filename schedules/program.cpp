// The step program and its memory plan (see program.h).
#include "schedules/program.h"
#include "schedules/sharding.h"

#include <algorithm>
#include <functional>
#include <map>

#include "dsl/error.h"

namespace halyard {
namespace {

int64_t element_bytes(DType t) {
  switch (t) {
    case DType::f64: return 8;
    case DType::bf16: return 2;
    default: return 4;
  }
}

constexpr int64_t kAlign = 128;  // Halide's allocation alignment; kernels may rely on it

}  // namespace

Program plan_program(const Graph& g, const Partition& p, const std::vector<int>& params,
                     const std::vector<int>& grads, int loss) {
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
  // moves. (Ring passes are placed by the sharding itself: each starts when
  // the pass before it has arrived.)
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
  for (PlannedCall& c : calls) {
    const int call = static_cast<int>(prog.calls.size());
    for (int a : c.args)
      for (int v = a; v >= 0;) {  // a view keeps the buffer it shows alive
        PlannedBuffer& b = prog.buffers[static_cast<size_t>(v)];
        if (b.first < 0) b.first = call;
        b.last = call;
        v = b.kind == BufferKind::View ? b.index : -1;
      }
    prog.calls.push_back(std::move(c));
  }
  prog.reduce_grads = !grads.empty();  // a no-op on one rank
  prog.loss = buffer(loss);
  prog.buffers[static_cast<size_t>(prog.loss)].last = static_cast<int>(prog.calls.size());  // read after the step

  // Greedy placement: largest first, lowest offset that overlaps no buffer
  // alive at the same time.
  std::vector<int> order;
  for (size_t i = 0; i < prog.buffers.size(); ++i)
    if (prog.buffers[i].kind == BufferKind::Arena) order.push_back(static_cast<int>(i));
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return prog.buffers[static_cast<size_t>(a)].bytes > prog.buffers[static_cast<size_t>(b)].bytes; });
  std::vector<int> placed;
  for (int i : order) {
    PlannedBuffer& b = prog.buffers[static_cast<size_t>(i)];
    const int64_t size = (b.bytes + kAlign - 1) / kAlign * kAlign;
    std::vector<std::pair<int64_t, int64_t>> busy;
    for (int j : placed) {
      const PlannedBuffer& o = prog.buffers[static_cast<size_t>(j)];
      if (o.first <= b.last && b.first <= o.last) busy.push_back({o.offset, o.offset + (o.bytes + kAlign - 1) / kAlign * kAlign});
    }
    std::sort(busy.begin(), busy.end());
    int64_t at = 0;
    for (auto [lo, hi] : busy) {
      if (at + size <= lo) break;
      at = std::max(at, hi);
    }
    b.offset = at;
    prog.arena_bytes = std::max(prog.arena_bytes, at + size);
    placed.push_back(i);
  }
  return prog;
}

}  // namespace halyard
