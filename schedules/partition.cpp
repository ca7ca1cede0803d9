// Partitioning a joint graph into stages (see partition.h).
#include "schedules/partition.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "dsl/error.h"
#include "dsl/op_table.h"

namespace halyard {

bool is_heavy(Op op) {
  const OpClass c = op_info(op).cls;
  return c == OpClass::Heavy || c == OpClass::Runtime;
}

namespace {

std::string attrs_key(const Node& n) {
  switch (n.op) {  // (most ops have none: no stream for them, see TensorType::str)
    case Op::Fill:
    case Op::RmsNorm:
    case Op::RmsNormGradX:
    case Op::RmsNormGradW:
    case Op::Rope:
    case Op::TokenCount:
    case Op::CrossEntropy:
    case Op::CrossEntropyGrad:
    case Op::EmbeddingGrad:
    case Op::PadSeq: break;
    case Op::Attention:
    case Op::AttentionLse:
    case Op::AttentionGradQ:
    case Op::AttentionGradK:
    case Op::AttentionGradV: return n.attrs.bf16 ? "bf16" : "";
    default: return {};
  }
  std::ostringstream os;
  os.precision(17);
  const Attrs& a = n.attrs;
  switch (n.op) {
    case Op::Fill: os << "v=" << a.value; break;
    case Op::RmsNorm:
    case Op::RmsNormGradX:
    case Op::RmsNormGradW: os << "eps=" << a.eps << ",axis=" << a.axis; break;
    case Op::Rope:
      os << "theta=" << a.theta << ",inv=" << a.inverse << ",s=" << a.rope_scaling.factor << "/"
         << a.rope_scaling.low_freq_factor << "/" << a.rope_scaling.high_freq_factor << "/"
         << a.rope_scaling.original_max_position_embeddings;
      break;
    case Op::TokenCount:
    case Op::CrossEntropy:
    case Op::CrossEntropyGrad: os << "ignore=" << a.ignore_index; break;
    case Op::EmbeddingGrad: os << "vocab=" << a.size; break;
    case Op::PadSeq: os << "at=" << a.offset; break;  // inside the kernel (a slice is a view of the buffer it reads)
    default: break;
  }
  return os.str();
}

}  // namespace

ContractLayout contract_layout(const Graph& g, const Node& n, const std::vector<int>& stage_inputs) {
  ContractLayout L;
  if (n.type.rank() == 0) return L;
  auto is_input = [&](int id) { return std::find(stage_inputs.begin(), stage_inputs.end(), id) != stage_inputs.end(); };
  const std::string inner = n.type.axes.back().name;
  const TensorType &ta = g.node(n.inputs[0]).type, &tb = g.node(n.inputs[1]).type;
  L.b = tb.has(inner) && !ta.has(inner) ? 1 : 0;
  const TensorType &b = L.b ? tb : ta, &a = L.b ? ta : tb;
  for (const Axis& ax : b.axes)
    if (!n.type.has(ax.name)) L.b_order.push_back(ax.name);
  for (const Axis& ax : n.type.axes)
    if (b.has(ax.name)) L.b_order.push_back(ax.name);
  const bool along_a = !a.axes.empty() && !n.type.has(a.axes.back().name);
  const int64_t cols = b.size(inner);
  bool a_kept = false;  // rows of the register tile come from A
  for (const Axis& ax : a.axes) a_kept = a_kept || n.type.has(ax.name);
  L.b_panels = along_a && a_kept && cols % 32 == 0;
  L.b_copied = L.b_panels || L.b_order != b.axis_names() || !is_input(n.inputs[static_cast<size_t>(L.b)]);
  L.a_staged = !is_input(n.inputs[static_cast<size_t>(1 - L.b)]);
  return L;
}

bool weight_grad_form(const Graph& g, const Node& n, WeightGradForm* form) {
  if (n.op != Op::Contract || n.type.rank() == 0 || n.type.dtype != DType::f32) return false;
  const TensorType &t0 = g.node(n.inputs[0]).type, &t1 = g.node(n.inputs[1]).type;
  if (t0.dtype != DType::f32 || t1.dtype != DType::f32) return false;
  const int b = t1.has(n.type.axes.back().name) && !t0.has(n.type.axes.back().name) ? 1 : 0, a = 1 - b;
  const TensorType &ta = a ? t1 : t0, &tb = b ? t1 : t0;
  // Splits an operand's axes into summed (outermost) then kept.
  auto split = [&](const TensorType& t, std::vector<std::string>& summed, std::vector<std::string>& kept) {
    for (const Axis& ax : t.axes) {
      const bool k = n.type.has(ax.name);
      if (!k && !kept.empty()) return false;
      (k ? kept : summed).push_back(ax.name);
    }
    return true;
  };
  std::vector<std::string> sa, ka, sb, kb;
  if (!split(ta, sa, ka) || !split(tb, sb, kb) || sa.empty() || sa != sb || sa.size() > 3 || ka.empty()) return false;
  std::vector<std::string> expect = ka;
  expect.insert(expect.end(), kb.begin(), kb.end());
  if (expect != n.type.axis_names()) return false;  // (an axis in both operands is in neither group's place)
  if (form) {
    form->a = a, form->b = b;
    form->a_dims = static_cast<int>(ka.size()), form->b_dims = static_cast<int>(kb.size());
    form->tokens.clear();
    for (auto it = sa.rbegin(); it != sa.rend(); ++it) form->tokens.push_back(ta.size(*it));
  }
  return true;
}

bool gemm_form(const Graph& g, const Node& n, GemmForm* form) {
  if (n.op != Op::Contract || n.type.rank() == 0 || n.type.dtype != DType::f32) return false;
  const TensorType &t0 = g.node(n.inputs[0]).type, &t1 = g.node(n.inputs[1]).type;
  if (t0.dtype != DType::f32 || t1.dtype != DType::f32) return false;
  const std::vector<std::string> out = n.type.axis_names();
  // A holds the output's outermost axis; its kept axes are the output's first run.
  const int a = t0.has(out.front()) ? 0 : 1, b = 1 - a;
  const TensorType &ta = a ? t1 : t0, &tb = b ? t1 : t0;
  size_t m = 0;
  while (m < out.size() && ta.has(out[m]) && !tb.has(out[m])) ++m;
  for (size_t i = m; i < out.size(); ++i)
    if (!tb.has(out[i]) || ta.has(out[i])) return false;
  const std::vector<std::string> kept_a(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(m)),
      kept_b(out.begin() + static_cast<std::ptrdiff_t>(m), out.end());
  // An operand's axes as its kept run and its summed run, either first.
  auto runs = [&](const TensorType& t, const std::vector<std::string>& kept, std::vector<std::string>& summed,
                  bool& summed_inner) {
    std::vector<std::string> k, names = t.axis_names();
    for (const std::string& x : names) (n.type.has(x) ? k : summed).push_back(x);
    if (k != kept || summed.empty()) return false;
    std::vector<std::string> kept_first = kept, summed_first = summed;
    kept_first.insert(kept_first.end(), summed.begin(), summed.end());
    summed_first.insert(summed_first.end(), kept.begin(), kept.end());
    summed_inner = names == kept_first;
    return summed_inner || names == summed_first;
  };
  std::vector<std::string> sa, sb;
  bool a_k_inner = false, b_k_inner = false;
  if (kept_a.empty() || kept_b.empty() || !runs(ta, kept_a, sa, a_k_inner) || !runs(tb, kept_b, sb, b_k_inner) ||
      sa != sb)
    return false;
  if (kept_a.size() > 3 || kept_b.size() > 3 || sa.size() > 3) return false;
  if (form) {
    form->a = a, form->b = b;
    form->m_dims = static_cast<int>(kept_a.size()), form->n_dims = static_cast<int>(kept_b.size());
    form->k_dims = static_cast<int>(sa.size());
    form->a_k_inner = a_k_inner, form->b_k_inner = b_k_inner;
    form->k.clear();
    for (auto it = sa.rbegin(); it != sa.rend(); ++it) form->k.push_back(ta.size(*it));
  }
  return true;
}

GpuSumSplit gpu_sum_split(int64_t outputs, int64_t summed) {
  // 2^16 outputs fill a GPU; the chunks are at least 64 long (so the tiny
  // Llama's 256 tokens split, which the device tests of test_cuda.cpp then
  // check against the CPU), and at most 2^18 partial sums are kept (some
  // 2^18 threads, an H100's 132 SMs full).
  constexpr int64_t kFull = int64_t{1} << 16, kMinLength = 64, kMaxPartials = int64_t{1} << 18;
  GpuSumSplit split;
  if (outputs < 1 || outputs >= kFull || summed < 2 * kMinLength) return split;
  const int64_t wanted = std::min((summed + kMinLength - 1) / kMinLength, std::max<int64_t>(2, kMaxPartials / outputs));
  split.length = (summed + wanted - 1) / wanted;
  split.chunks = (summed + split.length - 1) / split.length;
  return split;
}

GpuSumSplit gpu_sum_split(const Graph& g, const Node& n) {
  if (n.op != Op::RmsNormGradW && n.op != Op::BiasAddGrad && n.op != Op::TokenCount && n.op != Op::CrossEntropy) return {};
  // The summed axes: what the reduced operand has and the output does not
  // (the loss sums over its labels' axes).
  const Node& reduced = g.node(n.inputs[n.op == Op::CrossEntropy ? 1 : 0]);
  int64_t summed = 1;
  for (const Axis& a : reduced.type.axes)
    if (!n.type.has(a.name)) summed = std::max(summed, a.size);
  return gpu_sum_split(n.type.numel(), summed);
}

int gpu_index_overflow(const Graph& g, const Stage& st) {
  if (is_runtime_op(g.node(st.root).op)) return -1;  // a collective
  std::vector<int> halide = st.inlined;  // what Halide computes, and the buffers of a Halide kernel
  if (!st.library && !st.gemm) {
    halide.insert(halide.end(), st.inputs.begin(), st.inputs.end());
    halide.push_back(st.root);
    halide.insert(halide.end(), st.extra_outputs.begin(), st.extra_outputs.end());
  }
  for (int id : halide)
    if (g.node(id).type.numel() > kMax32Bit) return id;
  return -1;
}

Partition partition(const Graph& g, const std::vector<int>& outputs, const Schedule& s) {
  const int n = g.size();
  // Nodes the outputs depend on, and their consumers among those.
  std::vector<bool> needed(static_cast<size_t>(n), false);
  for (int o : outputs) needed[static_cast<size_t>(o)] = true;
  for (int id = n - 1; id >= 0; --id)
    if (needed[static_cast<size_t>(id)])
      for (int i : g.node(id).inputs) needed[static_cast<size_t>(i)] = true;
  std::vector<int> consumers(static_cast<size_t>(n), 0);
  std::vector<bool> feeds_runtime(static_cast<size_t>(n), false);  // the runtime moves buffers, not expressions
  for (int id = 0; id < n; ++id)
    if (needed[static_cast<size_t>(id)])
      for (int i : g.node(id).inputs) {
        ++consumers[static_cast<size_t>(i)];
        if (is_runtime_op(g.node(id).op) || g.node(id).op == Op::SliceSeq) feeds_runtime[static_cast<size_t>(i)] = true;
      }

  Partition p;
  p.materialized.assign(static_cast<size_t>(n), false);
  std::vector<bool> is_output(static_cast<size_t>(n), false);
  for (int o : outputs) is_output[static_cast<size_t>(o)] = true;
  // A buffer, or a tile of one padded to the whole sequence.
  auto stored_part = [&](int id) {
    const Node& x = g.node(id);
    return p.materialized[static_cast<size_t>(id)] ||
           (x.op == Op::PadSeq && p.materialized[static_cast<size_t>(x.inputs[0])]);
  };
  for (int id = 0; id < n; ++id) {
    if (!needed[static_cast<size_t>(id)]) continue;
    const Node& node = g.node(id);
    bool root;
    if (node.op == Op::Input || node.op == Op::Param) root = true;
    else if (is_output[static_cast<size_t>(id)] || is_heavy(node.op) || feeds_runtime[static_cast<size_t>(id)]) root = true;
    // A tile is a view of its (materialized) input: no copy, and one kernel
    // serves every tile, whatever its offset.
    else if (node.op == Op::SliceSeq) root = true;
    // A constant; an index remap; a bf16 copy decoded by each reader (schedules/precision.h).
    else if (node.op == Op::Fill || node.op == Op::PadSeq || node.op == Op::LoadBf16) root = false;
    // A gradient summed from parts (a weight's over sequence tiles; a tile's
    // input over its gate and up projections; dQ over a ring's blocks; a
    // whole value's over the tiles that read it, each part a tile's rows):
    // keep the running sum, so that each part dies once added instead of
    // all living until the last one. A sequence-long sum whose parts are
    // computed inside it costs nothing to keep inline.
    else if (node.backward && node.op == Op::Add &&
             (!node.type.has("seq") || (stored_part(node.inputs[0]) && stored_part(node.inputs[1]))))
      root = true;
    else if (consumers[static_cast<size_t>(id)] <= 1) root = false;
    else root = s.compute(node) == Compute::Root;
    p.materialized[static_cast<size_t>(id)] = root;
  }

  // When the backward needs an attention's row statistics (log-sum-exp),
  // the attention's kernel writes them too: it computes them anyway, and a
  // kernel of their own would compute the scores once more.
  std::map<int, int> lse_of;
  {
    // (Either may come first: ring attention makes each block's statistics
    // before its output, and one kernel per block computed its scores twice.)
    std::map<std::vector<int>, int> attention_on;  // (q, k, positions[, token indices]) -> the forward attention
    for (int id = 0; id < n; ++id) {
      const Node& x = g.node(id);
      if (!needed[static_cast<size_t>(id)] || x.op != Op::Attention) continue;
      std::vector<int> key{x.inputs[0], x.inputs[1]};
      key.insert(key.end(), x.inputs.begin() + 3, x.inputs.end());
      attention_on[key] = id;
    }
    for (int id = 0; id < n; ++id) {
      const Node& x = g.node(id);
      if (needed[static_cast<size_t>(id)] && x.op == Op::AttentionLse)
        if (auto it = attention_on.find(x.inputs); it != attention_on.end()) lse_of[it->second] = id;
    }
  }

  // dK and dV of one attention recompute the same probabilities over the
  // same key tiles: one kernel writes both. The library's backward writes
  // dQ too (FlashAttention-2's single pass).
  std::map<int, int> dv_of, dq_of;  // dK node -> its dV, its dQ (library kernels)
  std::set<int> fused;
  {
    std::map<std::vector<int>, int> grad_v_on, grad_q_on;  // operands -> an unpaired dV, dQ
    for (int id = 0; id < n; ++id) {
      if (!needed[static_cast<size_t>(id)]) continue;
      if (g.node(id).op == Op::AttentionGradV) grad_v_on.emplace(g.node(id).inputs, id);
      if (g.node(id).op == Op::AttentionGradQ && s.library_attention()) grad_q_on.emplace(g.node(id).inputs, id);
    }
    for (int id = 0; id < n; ++id) {
      const Node& x = g.node(id);
      if (!needed[static_cast<size_t>(id)] || x.op != Op::AttentionGradK) continue;
      if (auto it = grad_v_on.find(x.inputs); it != grad_v_on.end()) {
        dv_of[id] = it->second;
        fused.insert(it->second);
        grad_v_on.erase(it);
        if (auto q = grad_q_on.find(x.inputs); q != grad_q_on.end()) {
          dq_of[id] = q->second;
          fused.insert(q->second);
          grad_q_on.erase(q);
        }
      }
    }
  }
  for (const auto& [attn, lse] : lse_of) fused.insert(lse);

  // A ring's dQ sums one part per key block (dsl/vjp.cpp): the library
  // backward of a block adds its part to the running sum of the blocks
  // before, where that sum is a buffer already written (an earlier node),
  // and writes the Add itself. The part is never stored, and the Add's
  // kernel of its own is gone.
  struct DqSum {
    int sum = -1, running = -1;  // the Add written, the sum it reads
  };
  std::map<int, DqSum> dq_sum_of;  // dK node -> the sum its kernel writes in its dQ's place
  {
    std::map<int, int> dk_of_dq;
    for (const auto& [dk, dq] : dq_of)
      if (is_ring_block(g.node(dk)) && consumers[static_cast<size_t>(dq)] == 1 && !is_output[static_cast<size_t>(dq)])
        dk_of_dq[dq] = dk;
    for (int id = 0; id < n && !dk_of_dq.empty(); ++id) {
      const Node& a = g.node(id);
      if (!needed[static_cast<size_t>(id)] || a.op != Op::Add || !p.materialized[static_cast<size_t>(id)]) continue;
      for (size_t k = 0; k < 2; ++k) {
        auto it = dk_of_dq.find(a.inputs[k]);
        if (it == dk_of_dq.end()) continue;
        const int running = a.inputs[1 - k], dk = it->second;
        if (running < dk && p.materialized[static_cast<size_t>(running)] && g.node(running).type == a.type &&
            g.node(it->first).type == a.type) {
          dq_sum_of[dk] = {id, running};
          fused.insert(id);
          p.materialized[static_cast<size_t>(it->first)] = false;
          break;
        }
      }
    }
  }

  for (int id = 0; id < n; ++id) {
    const Node& node = g.node(id);
    if (!needed[static_cast<size_t>(id)] || !p.materialized[static_cast<size_t>(id)]) continue;
    if (node.op == Op::Input || node.op == Op::Param || node.op == Op::SliceSeq) continue;  // buffers, not stages
    if (fused.count(id)) continue;  // written by its dK's (or its attention's) kernel
    Stage st;
    st.root = id;
    // Walk the inlined producers; buffers become inputs in first-use order.
    // The key is written into one string: a value met again repeats the
    // span it wrote the first time (no string per value: the search
    // partitions thousands of plans).
    std::string& key = st.signature;
    std::map<int, std::pair<size_t, size_t>> span_of;
    std::function<void(int)> sig = [&](int v) {
      if (auto it = span_of.find(v); it != span_of.end()) {
        key += std::string(key, it->second.first, it->second.second);
        return;
      }
      const size_t start = key.size();
      const Node& x = g.node(v);
      if (v != id && p.materialized[static_cast<size_t>(v)]) {
        auto it = std::find(st.inputs.begin(), st.inputs.end(), v);
        size_t k = static_cast<size_t>(it - st.inputs.begin());
        if (it == st.inputs.end()) st.inputs.push_back(v);
        key += "in" + std::to_string(k) + ":";
        key += x.type.str();
      } else {
        key += op_name(x.op);
        key += "[" + attrs_key(x) + "](";
        for (size_t k = 0; k < x.inputs.size(); ++k) {
          if (k) key += ",";
          sig(x.inputs[k]);
        }
        key += ")->";
        key += x.type.str();
        if (v != id) st.inlined.push_back(v);
      }
      span_of[v] = {start, key.size() - start};
    };
    sig(id);
    if (auto it = dv_of.find(id); it != dv_of.end()) {
      st.extra_outputs.push_back(it->second);
      st.signature += "+dv:" + g.node(it->second).type.str();
    }
    if (auto it = dq_of.find(id); it != dq_of.end()) {
      if (auto sum = dq_sum_of.find(id); sum != dq_sum_of.end()) {
        st.dq_part = it->second, st.dq_sum_in = sum->second.running;
        st.inputs.push_back(st.dq_sum_in);
        st.extra_outputs.push_back(sum->second.sum);
        st.signature += "+dq_added_to_in" + std::to_string(st.inputs.size() - 1);
      } else {
        st.extra_outputs.push_back(it->second);
      }
      st.signature += "+dq:" + g.node(it->second).type.str();
      st.library = true;
    }
    if ((node.op == Op::Attention || node.op == Op::AttentionLse) && s.library_attention()) st.library = true;
    // The library reads its operands from buffers: one computed inline is
    // computed once, whole, into a copy (the plan counts it as scratch).
    if (s.library_weight_grad() && weight_grad_form(g, node)) st.library = true;
    if (st.library) st.signature += "+library";
    st.gemm = !st.library && s.contract_kernel == "cublas" && gemm_form(g, node);
    if (st.gemm) st.signature += "+gemm";
    if (auto it = lse_of.find(id); it != lse_of.end()) {
      st.extra_outputs.push_back(it->second);
      st.signature += "+lse:" + g.node(it->second).type.str();
    }
    // (A library call writes the root and the extra outputs into one buffer.)
    int64_t written = value_bytes(node.type);
    for (int v : st.extra_outputs) written += value_bytes(g.node(v).type);
    st.large_buffers = written > kMax32Bit;
    for (const std::vector<int>* vs : {&st.inputs, &st.inlined})
      for (int v : *vs) st.large_buffers = st.large_buffers || value_bytes(g.node(v).type) > kMax32Bit;
    std::sort(st.inlined.begin(), st.inlined.end());
    p.stages.push_back(std::move(st));
  }

  // Execution order: each stage after the stages whose roots it reads (node
  // order already is, except for a value written by a later node's kernel).
  std::map<int, size_t> stage_of;
  for (size_t s2 = 0; s2 < p.stages.size(); ++s2) {
    stage_of[p.stages[s2].root] = s2;
    for (int x : p.stages[s2].extra_outputs) stage_of[x] = s2;
  }
  for (int id = 0; id < n; ++id)  // a view is ready when the buffer it shows is
    if (needed[static_cast<size_t>(id)] && g.node(id).op == Op::SliceSeq)
      if (auto it = stage_of.find(g.node(id).inputs[0]); it != stage_of.end()) stage_of[id] = it->second;
  std::vector<Stage> ordered;
  std::vector<bool> done(p.stages.size(), false);
  std::function<void(size_t)> emit = [&](size_t s2) {
    if (done[s2]) return;
    done[s2] = true;
    for (int in : p.stages[s2].inputs)
      if (auto it = stage_of.find(in); it != stage_of.end()) emit(it->second);
    ordered.push_back(std::move(p.stages[s2]));  // (done: never read again)
  };
  for (size_t s2 = 0; s2 < p.stages.size(); ++s2) emit(s2);
  p.stages = std::move(ordered);

  std::map<std::string, int> kernel_of;
  for (size_t s2 = 0; s2 < p.stages.size(); ++s2) {
    if (is_runtime_op(g.node(p.stages[s2].root).op)) continue;  // performed by the runtime, no kernel
    auto [it, fresh] = kernel_of.emplace(p.stages[s2].signature, static_cast<int>(p.kernels.size()));
    if (fresh) p.kernels.push_back(static_cast<int>(s2));
    p.stages[s2].kernel = it->second;
  }
  return p;
}

int bf16_copy_read(const Graph& g, const Stage& st, int id) {
  const Node& x = g.node(id);
  if (x.op != Op::LoadBf16) return -1;
  const bool buffer = std::find(st.inputs.begin(), st.inputs.end(), x.inputs[0]) != st.inputs.end();
  return buffer ? x.inputs[0] : -1;
}

int attention_reads_copy(const Graph& g, const Stage& st, size_t k) {
  const Node& n = g.node(st.root);
  const bool operand = k <= 2 || (k == 4 && n.op == Op::AttentionGradK);  // (the log-sum-exp alone: q, k, positions)
  return operand && k < n.inputs.size() ? bf16_copy_read(g, st, n.inputs[k]) : -1;
}

bool attention_copies_bf16(const Graph& g, const Stage& st, size_t k) {
  const Node& n = g.node(st.root);
  return n.attrs.bf16 && k < (n.op == Op::AttentionLse ? 2u : 3u);  // (the log-sum-exp alone: q, k, positions)
}

}  // namespace halyard
