// The plan and its cost and memory model (see plan.h).
#include "schedules/plan.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "dsl/autodiff.h"
#include "dsl/error.h"
#include "dsl/op_table.h"
#include "schedules/precision.h"
#include "schedules/sharding.h"
#include "schedules/tiling.h"

namespace halyard {
namespace {

double mib(int64_t b) { return static_cast<double>(b) / (1 << 20); }


std::string collective_kind(Op op) {
  switch (op) {
    case Op::SeqToHeads:
    case Op::HeadsToSeq: return "all_to_all";
    case Op::GatherSeq: return "all_gather";
    case Op::RingShift: return "ring_shift";
    default: return "all_reduce";
  }
}

bool is_buffer(const Stage& st, int id) { return std::find(st.inputs.begin(), st.inputs.end(), id) != st.inputs.end(); }

// What a kernel's temporaries hold. On the CPU they come from each thread's
// scratch stack (runtime/scratch.h), which keeps its high water: the calling
// thread's stack holds at most the largest kernel's shared blocks with its own
// task's, and each other thread's the most one task holds. On a GPU the plan
// keeps the host allocator's rule (not measured on a device yet): blocks
// below 32 MiB from a heap that keeps what is freed, larger ones mapped afresh
// each time, so the most any kernel kept on the heap and the most any kernel
// mapped add up even when the kernels never run together.
constexpr int64_t kMapThreshold = int64_t{32} << 20;

struct Scratch {
  int64_t heap = 0, mapped = 0;  // held once (on the CPU, by the calling thread)
  int64_t per_task = 0;          // held by each of `tasks` threads at once
  int64_t tasks = 0;
  void add(int64_t bytes) { (bytes >= kMapThreshold ? mapped : heap) += bytes; }
  void add_per_task(int64_t bytes, int64_t threads) { per_task += bytes, tasks = std::max(tasks, threads); }
  int64_t held() const { return heap + mapped + per_task * tasks; }  // by the kernel while it runs
};

// By stage: whether the program finishes it at a later Wait (a collective
// that runs on while the kernels after it go on).
std::vector<bool> finished_later(const Program& program, size_t stages) {
  std::vector<bool> waited(stages, false);
  for (const PlannedCall& call : program.calls)
    if (call.wait) waited[static_cast<size_t>(call.stage)] = true;
  return waited;
}

// The staging of a step's collectives (runtime::Model). On the host they
// run one at a time, in one area as large as the largest. On a GPU an
// all-to-all waited for later (a Ulysses all-to-all under the kernels
// before its Wait) stages in a slot of its own until then (a gather is
// done where it stands): the lowest slot free, grown to the largest plan
// it holds, every slot kept.
int64_t staging_bytes(const Program& program, const std::vector<int64_t>& staging_of,
                      const std::vector<bool>& in_background, bool gpu) {
  if (!gpu) return staging_of.empty() ? 0 : *std::max_element(staging_of.begin(), staging_of.end());
  const std::vector<bool> waited = finished_later(program, staging_of.size());
  std::vector<int64_t> slots;
  std::vector<int> held_by;  // the stage in flight in each slot, or -1
  for (const PlannedCall& call : program.calls) {
    if (call.stage < 0 || staging_of[static_cast<size_t>(call.stage)] == 0) continue;
    if (call.wait) {
      std::replace(held_by.begin(), held_by.end(), call.stage, -1);
      continue;
    }
    const size_t slot = static_cast<size_t>(std::find(held_by.begin(), held_by.end(), -1) - held_by.begin());
    if (slot == slots.size()) slots.push_back(0), held_by.push_back(-1);
    slots[slot] = std::max(slots[slot], staging_of[static_cast<size_t>(call.stage)]);
    if (waited[static_cast<size_t>(call.stage)] && in_background[static_cast<size_t>(call.stage)]) held_by[slot] = call.stage;
  }
  return std::accumulate(slots.begin(), slots.end(), int64_t{0});
}

// Host memory a sum of `bytes` of f32 gradients over `ranks` stages while
// the whole arena is resident (runtime/comm_mpi.cpp, runtime/comm.cpp): a
// ring (the reduce-scatter, a large all-reduce) stages one rank's block, kept
// for the next step. Summed from bf16, it goes in chunks of 2^20 elements
// (of all ranks; runtime/comm.cpp: kBf16SumChunk) whose rounded copies go
// out and come in (2 + 2 bytes an element) and, without ZeRO, whose f32
// sums are padded and gathered (4 + 4 / ranks more).
int64_t grad_sum_staging(const Schedule& schedule, int64_t bytes, int64_t ranks) {
  const int64_t n = bytes / 4;
  if (schedule.grad_reduce_precision != "bf16") return (n + ranks - 1) / ranks * 4;
  constexpr int64_t kBf16SumChunk = int64_t{1} << 20;
  const int64_t per_rank = std::max<int64_t>(1, kBf16SumChunk / ranks);
  if (schedule.mesh.zero) return 4 * ranks * std::min(n / ranks, per_rank);
  const int64_t segment = std::min(per_rank * ranks, (n + ranks - 1) / ranks * ranks);
  return 8 * segment + 4 * (segment / ranks);
}

// The step on two tracks, as runtime::Model runs it: the kernels one after
// another; the collectives one after another on the communication thread
// (host) or stream (GPU). A collective the program finishes at a later Wait
// (a Ulysses all-to-all, a ring pass) runs under the kernels up to there;
// any other is waited for where it stands. With `buckets` the gradients'
// sum over the mesh goes out in buckets during the backward, each once the
// kernels have finished its gradients; otherwise it runs whole after the
// backward. What follows it (ZeRO's all-gathers), the update and the
// offload copies come after, one after the other. Sets each stage's and
// collective's start, communication_s (every collective's time),
// exposed_communication_s (what the kernels wait for) and step_s. Returns
// the largest bucket's bytes (f32 gradients), 0 without buckets.
int64_t lay_out_step(Plan& p, const Cluster& cluster, bool buckets) {
  const Program& prog = p.train_program;
  const size_t n = p.train.stages.size();
  // The gradients' sum (its halves, summed from bf16) goes in buckets; the
  // parameters' gathers (ZeRO) follow it whole. Both are added to
  // p.collectives at the end (the pointers below stay valid).
  std::vector<CollectiveCost> sums, after, sent;
  for (const CollectiveCost& c : p.collectives)
    if (c.stage < 0) (buckets && c.op.ends_with("_grads") ? sums : after).push_back(c);
  std::erase_if(p.collectives, [](const CollectiveCost& c) { return c.stage < 0; });
  std::vector<StageCost*> kernel(n, nullptr);
  std::vector<CollectiveCost*> collective(n, nullptr);
  for (StageCost& s : p.stages) kernel[static_cast<size_t>(s.stage)] = &s;
  for (CollectiveCost& c : p.collectives) collective[static_cast<size_t>(c.stage)] = &c;
  const std::vector<bool> waited = finished_later(prog, n);
  // runtime/model.cpp: a bucket goes once its gradients (f32, from the
  // last parameter down) come to 4 MiB, or reach the first parameter.
  constexpr int64_t kGradBucketBytes = 4 << 20;
  const size_t params = p.param_ids.size();
  std::vector<int64_t> grad_bytes(params, 0);
  for (size_t i = 0; i < params; ++i) grad_bytes[i] = 4 * p.model.graph->node(p.param_ids[i]).type.numel();
  const double all_grads = std::max<double>(1, static_cast<double>(std::accumulate(grad_bytes.begin(), grad_bytes.end(), int64_t{0})));
  std::vector<std::vector<size_t>> final_after(prog.calls.size());
  for (size_t b = 0; b < prog.buffers.size(); ++b)
    if (prog.buffers[b].kind == BufferKind::Grad && prog.buffers[b].last >= 0 &&
        prog.buffers[b].last < static_cast<int>(prog.calls.size()))
      final_after[static_cast<size_t>(prog.buffers[b].last)].push_back(static_cast<size_t>(prog.buffers[b].index));
  std::vector<bool> final_grad(params, false);
  size_t lo = params, hi = params;  // gradients [lo, hi) final and not yet sent
  int64_t pending = 0;              // their bytes
  int64_t largest = 0;              // of the buckets sent

  double t = 0, comm = 0;  // when the kernels' track and the communication's are next free
  std::vector<double> lands(n, 0);
  // Where the kernels' track waits on a collective over other ranks, they
  // may still be behind (Cluster::collective_lag_s).
  p.collective_waits = 0;
  p.collective_lags = 0;
  auto wait_for = [&](double done, const CollectiveCost& c) {
    const double share = Cluster::lag_share(c.kind, c.degree);
    if (share == 0) return done;  // (over one rank: no other to wait on)
    ++p.collective_waits;
    p.collective_lags += share;
    return done + share * cluster.collective_lag_s;
  };
  auto send = [&](CollectiveCost& c) {
    c.start_s = std::max(t, comm);
    comm = c.start_s + c.time_s;
    return comm;
  };
  auto send_bucket = [&] {
    largest = std::max(largest, pending);
    for (CollectiveCost c : sums) {
      c.bytes_per_rank = static_cast<int64_t>(static_cast<double>(c.bytes_per_rank) * static_cast<double>(pending) / all_grads);
      c.time_s = cluster.collective_time(c.kind, static_cast<double>(c.bytes_per_rank), c.degree);
      send(c);
      sent.push_back(c);
    }
    hi = lo, pending = 0;
  };
  for (size_t k = 0; k < prog.calls.size(); ++k) {
    const PlannedCall& call = prog.calls[k];
    if (call.stage < 0) continue;  // an offload copy: counted after the step
    const size_t s = static_cast<size_t>(call.stage);
    if (CollectiveCost* c = collective[s]) {
      if (call.wait) t = wait_for(std::max(t, lands[s]), *c);
      else if (waited[s]) lands[s] = send(*c);
      else t = wait_for(send(*c), *c);
      continue;
    }
    if (StageCost* sc = kernel[s]) sc->start_s = t, t += sc->time_s;
    if (sums.empty()) continue;
    for (size_t i : final_after[k]) final_grad[i] = true;
    while (lo > 0 && final_grad[lo - 1]) pending += grad_bytes[--lo];
    if (lo < hi && (lo == 0 || pending >= kGradBucketBytes)) send_bucket();
  }
  if (!sums.empty() && hi > 0) {  // the rest at the step's end, where the program sums the gradients
    while (lo > 0) pending += grad_bytes[--lo];
    send_bucket();
  }
  t = std::max(t, comm);
  if (!sent.empty()) t = wait_for(t, sent.front());
  for (CollectiveCost& c : after) t = wait_for(send(c), c);
  p.collectives.insert(p.collectives.end(), sent.begin(), sent.end());
  p.collectives.insert(p.collectives.end(), after.begin(), after.end());
  std::stable_sort(p.collectives.begin(), p.collectives.end(),
                   [](const CollectiveCost& a, const CollectiveCost& b) { return a.start_s < b.start_s; });
  p.communication_s = 0;
  for (const CollectiveCost& c : p.collectives) p.communication_s += c.time_s;
  p.exposed_communication_s = std::max(0.0, t - p.compute_s);
  p.step_s = t + p.optimizer_s + p.offload_s;
  return largest;
}

// The temporaries the CPU lowering (generators/lower.cpp) allocates while a
// kernel runs: copies of operands it reads in another order or computes once
// from an inlined expression, and row panels of an inlined operand per
// thread; all alive at once. (RoPE's tables are freed before the copies
// they feed are made.) It mirrors the lowering's choices; halyard-calibrate
// prints it next to what each kernel held (HALYARD_CALIBRATE_VERBOSE=1).
Scratch kernel_scratch(const Graph& g, const Stage& st, int threads, const KernelTiles& tiles, bool gpu) {
  const Node& n = g.node(st.root);
  auto bytes_of = [&](size_t k) { return value_bytes(g.node(n.inputs[k]).type); };
  Scratch s;
  auto copy_unless_buffer = [&](size_t k) {
    if (!is_buffer(st, n.inputs[k])) s.add(bytes_of(k));
  };
  if (gpu) {
    // generators/lower.cpp's per-token values, which schedule_gpu.cpp
    // computes at root: a norm's sum of squares and scale (and its input
    // gradient's sum of w dy x), RoPE's tables, the loss's max, sum of
    // exps, log-sum-exp (and its total); and the partial sums of a long
    // sum's chunks.
    std::vector<int> nodes = st.inlined;
    nodes.push_back(st.root);
    nodes.insert(nodes.end(), st.extra_outputs.begin(), st.extra_outputs.end());
    for (int id : nodes) {
      const Node& x = g.node(id);
      s.heap += 4 * x.type.numel() * gpu_sum_split(g, x).chunks;
      if (x.op == Op::RmsNorm || x.op == Op::RmsNormGradX || x.op == Op::RmsNormGradW) {
        const TensorType& t = g.node(x.inputs[0]).type;
        const std::string axis = x.op == Op::RmsNormGradW ? x.attrs.axis : g.node(x.inputs[1]).type.axes[0].name;
        s.heap += 4 * (t.numel() / t.size(axis)) * (x.op == Op::RmsNormGradX ? 3 : 2);
      } else if (x.op == Op::Rope) {  // cos and sin at each position and frequency
        s.heap += 2 * 4 * g.node(x.inputs[1]).type.numel() * (g.node(x.inputs[0]).type.size("head_dim") / 2);
      } else if (x.op == Op::CrossEntropy || x.op == Op::CrossEntropyGrad) {
        s.heap += 4 * 3 * g.node(x.inputs[1]).type.numel() + (x.op == Op::CrossEntropy ? 4 : 0);
      }
    }
  }
  if (gpu && !st.library && (n.op == Op::Attention || n.op == Op::AttentionLse || n.op == Op::AttentionGradQ ||
              n.op == Op::AttentionGradK || n.op == Op::AttentionGradV)) {
    // generators/schedule_gpu.cpp keeps at root the operands computed inline,
    // k (and for dP, v) transposed, and per query row and head the max and
    // sum (forward) or rowsum(dO * O) (backward); nothing per key. Device
    // temporaries come from Halide's reuse pool, which keeps what is freed:
    // the heap's rule.
    const TensorType& q = g.node(n.inputs[0]).type;
    const int64_t row_stat = 4 * q.size("seq") * q.size("heads") * q.size("batch");
    const bool fwd = n.op == Op::Attention || n.op == Op::AttentionLse;
    for (size_t k : n.op == Op::AttentionLse ? std::vector<size_t>{0, 1}
                    : fwd                    ? std::vector<size_t>{0, 1, 2}
                                             : std::vector<size_t>{0, 1, 2, 4, 5})
      if (!is_buffer(st, n.inputs[k])) s.heap += bytes_of(k);
    s.heap += bytes_of(1) + (n.op == Op::AttentionGradQ || n.op == Op::AttentionGradK ? bytes_of(2) : 0);
    s.heap += (fwd ? 2 : 1) * row_stat;
    return s;
  }
  if (st.library && n.op == Op::Contract) {  // runtime/gemm_cpu_impl.h and the copies of its operands
    WeightGradForm form;
    weight_grad_form(g, n, &form);
    copy_unless_buffer(static_cast<size_t>(form.a));
    copy_unless_buffer(static_cast<size_t>(form.b));
    // B's packed block on each thread: 256 tokens x its columns, at most 1 MiB
    // (half of a 2 MiB L2; gemm_cpu::weight_grad sizes it from the host's L2)
    const TensorType& b = g.node(n.inputs[static_cast<size_t>(form.b)]).type;
    int64_t cols = 1;
    for (const Axis& ax : b.axes)
      if (n.type.has(ax.name)) cols *= ax.size;
    s.add_per_task(256 * 4 * std::min<int64_t>(cols + 32, (int64_t{1} << 20) / (4 * 256)), threads);
    return s;
  }
  if (st.gemm) {  // runtime/gemm.h: an operand computed inline is copied whole first; the call writes the output
    GemmForm form;
    gemm_form(g, n, &form);
    const size_t a = static_cast<size_t>(form.a), b = static_cast<size_t>(form.b);
    if (bf16_copy_read(g, st, n.inputs[a]) >= 0 && bf16_copy_read(g, st, n.inputs[b]) >= 0) return s;  // both read in place
    copy_unless_buffer(a);
    copy_unless_buffer(b);
    return s;
  }
  if (st.library) {  // runtime/attention_cpu_impl.h and the copies of its operands (generators/lower.cpp)
    const TensorType& q = g.node(n.inputs[0]).type;
    const int64_t S = q.size("seq"), D = q.size("head_dim"), Dp = (D + 15) / 16 * 16, rows = q.size("batch");
    const int64_t H = q.size("heads"), KV = g.node(n.inputs[1]).type.size("kv_heads");
    const bool lse_alone = n.op == Op::AttentionLse, fwd = n.op == Op::Attention || lse_alone, ring = is_ring_block(n);
    for (size_t k = 0; k < (lse_alone ? 3u : fwd ? 4u : 7u); ++k)  // (a bf16 copy is read in place)
      if (attention_reads_copy(g, st, k) < 0 && !is_buffer(st, n.inputs[k]))
        s.add(bytes_of(k) / (attention_copies_bf16(g, st, k) ? 2 : 1));
    if (ring) copy_unless_buffer(n.inputs.size() - 2), copy_unless_buffer(n.inputs.size() - 1);  // the token indices
    // runtime/attention_cuda.cu holds its tiles in shared memory and registers.
    if (gpu) return s;
    // Per task (attention_cpu_impl.h: forward_head, backward_group): k and v
    // packed over the keys padded to whole blocks (k twice and v once more
    // in the backward, with dK and dV accumulators where D is not a whole
    // vector), a query block's rows, scores and statistics, and the forward's
    // log-sum-exp where nothing else takes it; the log-sum-exp alone packs
    // no v and keeps no output block; a ring block, its keys' indices
    // padded to whole blocks. As the runtime sizes them on a
    // host with an L2 of 1 MiB or more (256 queries a block, cpu_kernels.cpp)
    // and 16-float vectors (AVX-512); other hosts hold less.
    const int64_t Br = tiles.attention_queries > 0 ? tiles.attention_queries : 256;
    const int64_t Bc = ((tiles.attention_keys > 0 ? tiles.attention_keys : 128) + 31) / 32 * 32;
    const int64_t Sp = (S + Bc - 1) / Bc * Bc;
    const int64_t statistics = D * Sp + Br * Dp + Br * Bc + Br + 16 * Br;  // k, q, scores, max, lane sums
    const int64_t per_task =
        (ring ? Sp : 0) +
        (lse_alone ? statistics
         : fwd     ? statistics + Sp * Dp + Br * Dp + (st.extra_outputs.empty() ? S : 0)  // v, the output block
                   : 2 * D * Sp + Sp * Dp + 3 * Br * Dp + 2 * Br * Bc + 2 * Br + (D == Dp ? 0 : 2 * Sp * Dp));
    const int64_t tasks = rows * (fwd ? H : KV);
    s.add_per_task(4 * per_task, std::min<int64_t>(threads, tasks));
    return s;
  }
  switch (n.op) {
    case Op::Contract: {
      if (n.type.rank() == 0) break;
      const ContractLayout L = contract_layout(g, n, st.inputs);
      const size_t bop = static_cast<size_t>(L.b);
      if (L.b_copied) s.add(value_bytes(g.node(n.inputs[bop]).type));  // B, reordered or in panels, once
      if (L.a_staged) {  // A, staged per panel of 64 rows on each thread
        int64_t reduced = 1;
        for (const Axis& ax : g.node(n.inputs[1 - bop]).type.axes)
          if (!n.type.has(ax.name)) reduced *= ax.size;
        s.add_per_task(64 * reduced * 4, threads);
      }
      break;
    }
    // q and k computed once when they are inlined expressions (RoPE of a
    // projection), k (and v, dO) transposed so products vectorize over keys.
    case Op::Attention:
      copy_unless_buffer(0), copy_unless_buffer(1), s.add(bytes_of(1)), s.add(bytes_of(2));
      break;
    case Op::AttentionLse:
      copy_unless_buffer(0), copy_unless_buffer(1), s.add(bytes_of(1));
      break;
    case Op::AttentionGradQ:
      copy_unless_buffer(0), copy_unless_buffer(1), s.add(bytes_of(1)), s.add(bytes_of(5)), s.add(bytes_of(6));
      break;
    case Op::AttentionGradK:
    case Op::AttentionGradV: {
      copy_unless_buffer(0), copy_unless_buffer(1), s.add(bytes_of(1)), s.add(bytes_of(5));
      s.add(bytes_of(2)), s.add(bytes_of(2)), s.add(bytes_of(6));
      // and per thread, a tile of keys' probabilities and their cotangents against every query
      const int64_t key_tile = tiles.attention_keys ? tiles.attention_keys : 16;
      s.add_per_task(2 * key_tile * g.node(n.inputs[0]).type.size("seq") * 4, threads);
      break;
    }
    default: break;
  }
  return s;
}

}  // namespace

std::string layer_of(const std::string& name) {
  const std::string p = "model.layers.";
  if (name.rfind(p, 0) != 0) return name;
  const size_t dot = name.find('.', p.size());
  return dot == std::string::npos ? name : name.substr(0, dot);
}

std::string stage_kind(const Graph& g, const Node& root) {
  switch (root.op) {
    case Op::Contract:  // summing over tokens (weight gradients) runs at another speed than over features
      return g.node(root.inputs[0]).type.has("seq") && !root.type.has("seq") ? "contract_seq" : "contract";
    // Each attention kernel does different work per (query, key) pair: its own kind.
    case Op::Attention: return "attention";
    case Op::AttentionLse: return "attention_lse";
    case Op::AttentionGradQ: return "attention_grad_q";
    case Op::AttentionGradK:
    case Op::AttentionGradV: return "attention_grad_kv";
    case Op::RmsNormGradX:
    case Op::RmsNormGradW: return "norm";
    case Op::Embedding:
    case Op::EmbeddingGrad: return "embedding";
    case Op::TokenCount:
    case Op::CrossEntropy:
    case Op::CrossEntropyGrad: return "loss";
    case Op::ConcatSeq: return "copy";
    default: return "pointwise";
  }
}

int64_t MemoryBreakdown::total() const {
  int64_t t = 0;
  for (const auto& [k, v] : items()) t += v;
  return t;
}

std::vector<std::pair<std::string, int64_t>> MemoryBreakdown::items() const {
  return {{"parameters", parameters},         {"gradients", gradients},
          {"optimizer_state", optimizer_state}, {"activations", activations},
          {"kernel_scratch", kernel_scratch},   {"collective_buffers", collective_buffers},
          {"data", data},                       {"runtime_baseline", runtime_baseline}};
}

double Plan::flops() const {
  double f = 0;
  for (const StageCost& s : stages) f += s.flops;
  return f;
}

double Plan::model_flops() const {
  const Graph& g = *model.graph;
  double f = 0;
  for (const Stage& st : forward.stages) {
    if (is_collective(g.node(st.root).op)) continue;
    f += op_flops(g, g.node(st.root));
    for (int id : st.inlined) f += op_flops(g, g.node(id));
    for (int x : st.extra_outputs) f += extra_output_flops(g, g.node(x));
  }
  return 3 * f;
}

std::vector<double> Plan::attention_flops_per_rank() const {
  const Graph& g = *model.graph;
  const int64_t sp = std::max<int64_t>(schedule.mesh.sp, 1);
  std::vector<double> out(static_cast<size_t>(sp), 0.0);
  for (const Stage& st : train.stages) {
    for (int id : [&] {
           std::vector<int> ids{st.root};
           for (int x : st.extra_outputs) ids.push_back(st.computes(x));
           return ids;
         }()) {
      const Node& n = g.node(id);
      const std::string kind = stage_kind(g, n);
      if (kind.rfind("attention", 0) != 0 || (id != st.root && extra_output_flops(g, n) == 0)) continue;
      // the op table counts a ring block on its busiest rank; each rank's own here
      const double own = id == st.root ? op_flops(g, n) : extra_output_flops(g, n);
      for (int64_t r = 0; r < sp; ++r)
        out[static_cast<size_t>(r)] += !is_ring_block(n) ? own
                                       : st.library      ? ring_block_visible_flops(g, n, r, id != st.root)
                                                         : ring_block_flops(g, n, r);
    }
  }
  return out;
}

int Plan::stored_bf16() const {
  const auto& nodes = model.graph->nodes();
  return static_cast<int>(std::count_if(nodes.begin(), nodes.end(), [](const Node& n) { return n.op == Op::StoreBf16; }));
}

int64_t Plan::collective_bytes_per_rank() const {
  int64_t b = 0;
  for (const CollectiveCost& c : collectives) b += c.bytes_per_rank;
  return b;
}

Plan::ArenaPeak Plan::arena_peak() const {
  const Program& prog = train_program;
  // Bytes coming alive at a call, less those gone (the loss lives past the last call).
  std::vector<int64_t> change(prog.calls.size() + 2, 0);
  for (const PlannedBuffer& b : prog.buffers)
    if (b.kind == BufferKind::Arena)
      for (auto [first, last] : b.held_ranges()) {
        change[static_cast<size_t>(first)] += arena_aligned(b.bytes);
        change[static_cast<size_t>(last) + 1] -= arena_aligned(b.bytes);
      }
  ArenaPeak peak;
  int64_t alive = 0;
  for (size_t c = 0; c < prog.calls.size(); ++c)
    if ((alive += change[c]) > peak.live_bytes) peak.live_bytes = alive, peak.call = static_cast<int>(c);
  for (size_t i = 0; i < prog.buffers.size(); ++i) {
    const PlannedBuffer& b = prog.buffers[i];
    if (b.kind != BufferKind::Arena) continue;
    for (auto [first, last] : b.held_ranges())
      if (first <= peak.call && peak.call <= last) peak.buffers.push_back(static_cast<int>(i));
  }
  std::stable_sort(peak.buffers.begin(), peak.buffers.end(), [&](int a, int b) {
    return prog.buffers[static_cast<size_t>(a)].bytes > prog.buffers[static_cast<size_t>(b)].bytes;
  });
  return peak;
}

Plan plan(const ModelBuilder& build, const ModelRequest& req, const Schedule& given, const Cluster& cluster) {
  const bool gpu = cluster.gpu();
  const Schedule schedule = gpu ? given.on_gpu(cluster.device == "cuda") : given;
  if (req.seq <= 0 || req.batch <= 0)
    throw UserError("error: plan of \"" + req.config + "\" with batch " + std::to_string(req.batch) + ", seq " +
                    std::to_string(req.seq) + ".\nlegal: batch >= 1 and seq >= 1 tokens per row.");
  if (req.precision != "f32" && req.precision != "bf16-mixed")
    throw UserError("error: plan precision \"" + req.precision + "\".\nlegal: f32, or bf16-mixed (GPU clusters, planned only).");
  if (req.precision == "bf16-mixed" &&
      (schedule.stores_bf16() || schedule.contract_precision == "bf16" || schedule.grad_reduce_precision == "bf16"))
    throw UserError("error: schedule \"" + schedule.name + "\" " +
                    (schedule.stores_bf16() ? "stores saved values in bf16 (a rule with \"store\": \"bf16\")"
                     : schedule.contract_precision == "bf16"
                         ? "rounds contractions' operands to bf16 (contract_precision \"bf16\")"
                         : "sums the gradients from bf16 (grad_reduce_precision \"bf16\")") +
                    ", and the plan's precision is bf16-mixed, which counts every value in bf16 already.\n"
                    "fix: plan precision f32 with the schedule's bf16 choices (what the libraries run), or bf16-mixed "
                    "without them.");
  // Bytes of a value as the precision stores it (the graph is built in f32).
  const double held = req.precision == "bf16-mixed" ? 0.5 : 1.0;
  auto stored = [held](int64_t b) { return static_cast<int64_t>(static_cast<double>(b) * held); };
  Plan p;
  p.schedule = schedule;
  p.cluster = cluster;
  p.request = req;
  const int64_t sp = schedule.mesh.sp;
  p.local_seq = local_seq(req.seq, sp, schedule.sequence_layout == "zigzag");
  BuiltModel m = build(req.config, req.batch, p.local_seq, req.layers);
  RebuiltGraph sharded = shard_sequence(*m.graph, m.loss.id, schedule, sp);
  RebuiltGraph tiled = tile_sequence(*sharded.graph, sharded.loss.id, schedule.seq_tile, schedule.loss_tile());
  m.graph = std::move(tiled.graph);
  m.loss = tiled.loss;
  m.params = tiled.params;
  schedule.check(*m.graph);
  Gradients grads = grad(m.loss, m.params, GradOptions{schedule.rematerialize()});
  verify(*m.graph);
  for (const Value& v : m.params) {
    p.param_ids.push_back(v.id);
    p.grad_ids.push_back(grads[v].id);
    p.num_params += v.type().numel();
  }
  for (auto rebuild : {store_saved, round_contractions})
    if (StoredGraph stored = rebuild(*m.graph, schedule); stored.graph) {
      for (std::vector<int>* ids : {&p.param_ids, &p.grad_ids})
        for (int& x : *ids) x = stored.id_of[static_cast<size_t>(x)];
      m.graph = std::move(stored.graph);
      m.loss = m.graph->value(stored.id_of[static_cast<size_t>(m.loss.id)]);
      for (Value& v : m.params) v = m.graph->value(stored.id_of[static_cast<size_t>(v.id)]);
    }
  Graph& g = *m.graph;
  std::vector<int> train_out = p.grad_ids;
  train_out.push_back(m.loss.id);
  p.train = partition(g, train_out, schedule);
  p.forward = partition(g, {m.loss.id}, schedule);
  if (gpu)
    for (const Partition* part : {&p.train, &p.forward})
      for (const Stage& st : part->stages)
        if (const int big = gpu_index_overflow(g, st); big >= 0 && p.gpu_unbuildable.empty())
          p.gpu_unbuildable = "tensor \"" + g.node(big).name + "\" " + g.node(big).type.str() +
                              " is beyond Halide's 32-bit GPU indexing";
  // Offloading moves values to the host and back over the cluster's host
  // link; CPU ranks have none (their memory is host memory).
  std::function<bool(const Node&)> offload;
  // A bf16 copy goes where its value's rules say the value goes.
  if (schedule.offloads())
    offload = [&schedule, &g](const Node& n) {
      return schedule.keep(n.op == Op::StoreBf16 ? g.node(n.inputs[0]) : n) == Keep::Offload;
    };
  if (offload && !cluster.has_host_link()) {
    std::string linked;
    for (const std::string& n : Cluster::presets())
      if (Cluster::named(n).has_host_link()) linked += (linked.empty() ? "" : ", ") + n;
    throw UserError("error: schedule \"" + schedule.name + "\" offloads values to host memory (keep \"offload\"), but "
                    "cluster \"" + cluster.name + "\" has no host link: its ranks' memory is host memory already.\n"
                    "fix: keep \"save\" or \"recompute\" on CPU ranks; offloading is for GPU clusters (the presets " +
                    linked + ", or a cluster file with \"host_link\").");
  }
  p.train_program = plan_program(g, p.train, p.param_ids, p.grad_ids, m.loss.id, offload);
  p.forward_program = plan_program(g, p.forward, p.param_ids, {}, m.loss.id, offload);
  p.model = std::move(m);

  // Time: each stage of the train program by its kind's coefficients.
  // A cluster with a bf16 peak and an f32 one (the GPU presets) prices its
  // kinds' FLOPs at the bf16 peak (tensor cores). In an f32 plan only the
  // contractions that read bf16 copies (contract_precision "bf16") and
  // attention multiplying in bf16 (its Attrs::bf16, set with them) compute
  // in bf16; every other kernel runs at the f32 peak: its FLOPs count
  // peak_bf16 / peak_f32 times (14.8 on an H200).
  const auto bf16_peak = cluster.peak_flops.find("bf16"), f32_peak = cluster.peak_flops.find("f32");
  const double f32_flops = req.precision == "f32" && bf16_peak != cluster.peak_flops.end() &&
                                   f32_peak != cluster.peak_flops.end() && f32_peak->second > 0
                               ? bf16_peak->second / f32_peak->second
                               : 1.0;
  auto reads_bf16 = [&g](const Node& n) {
    return n.op == Op::Contract && std::all_of(n.inputs.begin(), n.inputs.end(),
                                               [&g](int i) { return g.node(i).op == Op::LoadBf16; });
  };
  const int64_t ranks = schedule.mesh.ranks();
  const int threads = static_cast<int>(cluster.threads_per_rank(ranks));
  int64_t heap_scratch = 0, mapped_scratch = 0;  // a GPU's (Scratch)
  int64_t caller_scratch = 0, task_scratch = 0;  // the CPU's: the calling thread's stack, and any other thread's
  std::vector<int64_t> staging_of(p.train.stages.size(), 0);  // by stage: an all-to-all's or gather's staging
  std::vector<bool> all_to_all(p.train.stages.size(), false);
  for (size_t s = 0; s < p.train.stages.size(); ++s) {
    const Stage& st = p.train.stages[s];
    const Node& root = g.node(st.root);
    int64_t bytes = value_bytes(root.type);
    for (int x : st.extra_outputs) bytes += value_bytes(g.node(x).type);
    for (int in : st.inputs) bytes += value_bytes(g.node(in).type);
    if (is_collective(root.op)) {
      CollectiveCost c;
      c.stage = static_cast<int>(s);
      c.op = op_name(root.op);
      c.kind = collective_kind(root.op);
      c.axis = root.attrs.mesh_axis;
      c.degree = c.axis == kWholeMesh ? ranks : root.attrs.degree;
      const int64_t in = value_bytes(g.node(st.inputs[0]).type), out = value_bytes(root.type);
      // An all-to-all sends the blocks bound for other ranks; a gather its
      // own slice to each; an all-reduce (ring) about twice its buffer.
      const double share = c.degree > 1 ? static_cast<double>(c.degree - 1) / static_cast<double>(c.degree) : 0;
      // A ring shift sends the whole buffer to the next rank (straight from
      // and into the arena: no staging).
      c.bytes_per_rank = c.kind == "all_to_all" ? static_cast<int64_t>(static_cast<double>(std::max(in, out)) * share)
                         : c.kind == "all_gather" ? static_cast<int64_t>(static_cast<double>(out) * share)
                         : c.kind == "ring_shift" ? (c.degree > 1 ? out : 0)
                                                  : static_cast<int64_t>(2 * static_cast<double>(out) * share);
      if (c.kind != "all_reduce") c.bytes_per_rank = stored(c.bytes_per_rank);  // the loss and counts stay f32
      c.time_s = cluster.collective_time(c.kind, static_cast<double>(c.bytes_per_rank), c.degree);
      if (c.kind == "all_to_all" || c.kind == "all_gather") staging_of[s] = stored(2 * std::max(in, out));
      all_to_all[s] = c.kind == "all_to_all";
      p.collectives.push_back(c);
      continue;
    }
    StageCost sc;
    sc.stage = static_cast<int>(s);
    sc.kind = stage_kind(g, root);
    sc.backward = root.backward;
    sc.layer = layer_of(root.name);
    sc.label = std::string(op_name(root.op)) + " %" + std::to_string(st.root) + (root.name.empty() ? "" : " " + root.name);
    // On a GPU the library's dQ is a kernel of its own (runtime/attention_cuda.cu),
    // which computes the scores and dP again: two products more than the
    // CPU library's single pass.
    auto times = [&](int x) {
      return gpu && st.library && root.op == Op::AttentionGradK && g.node(st.computes(x)).op == Op::AttentionGradQ ? 3.0
                                                                                                                : 1.0;
    };
    // The op table counts a ring block as Halide's kernels compute it (its
    // scores whole, on the busiest rank); the library's skip the key blocks
    // no query sees.
    if (st.library && is_ring_block(root)) {
      for (int64_t r = 0; r < std::max<int64_t>(root.attrs.degree, 1); ++r) {
        double f = ring_block_visible_flops(g, root, r, false);
        for (int x : st.extra_outputs) f += times(x) * ring_block_visible_flops(g, g.node(st.computes(x)), r, true);
        sc.flops = std::max(sc.flops, f);
      }
    } else {
      sc.flops = op_flops(g, root);
      for (int x : st.extra_outputs) sc.flops += times(x) * extra_output_flops(g, g.node(st.computes(x)));
    }
    for (int id : st.inlined) sc.flops += op_flops(g, g.node(id));
    sc.bytes = stored(bytes);
    sc.charged_flops = sc.flops * (reads_bf16(root) || root.attrs.bf16 ? 1.0 : f32_flops);
    sc.time_s = cluster.kernel_time(sc.kind, sc.charged_flops, static_cast<double>(sc.bytes));
    p.compute_s += sc.time_s;
    const Scratch k = kernel_scratch(g, st, threads, schedule.kernel_tiles, gpu);
    sc.scratch_estimate = k.held();
    heap_scratch = std::max(heap_scratch, k.heap + k.per_task * k.tasks);
    mapped_scratch = std::max(mapped_scratch, k.mapped);
    caller_scratch = std::max(caller_scratch, k.heap + k.mapped + k.per_task);
    task_scratch = std::max(task_scratch, k.per_task);
    p.stages.push_back(sc);
  }
  // The gradients are summed over the mesh after the backward (ZeRO-1:
  // reduce-scattered, and the updated parameters all-gathered). Summed from
  // bf16 (grad_reduce_precision), the reduce-scatter is an all-to-all of the
  // rounded gradients, half the bytes, and without ZeRO an all-gather of the
  // f32 sums follows (runtime::Communicator::all_reduce_sum_bf16).
  const int64_t param_bytes = stored(4 * p.num_params);  // what the gradient reduction moves
  if (ranks > 1) {
    const double share = static_cast<double>(ranks - 1) / static_cast<double>(ranks);
    auto add = [&](const char* op, const char* kind, double bytes) {
      CollectiveCost c{-1, op, kind, kWholeMesh, ranks, static_cast<int64_t>(bytes), 0};
      c.time_s = cluster.collective_time(kind, bytes, ranks);
      p.collectives.push_back(c);
    };
    const bool bf16 = schedule.grad_reduce_precision == "bf16";
    auto reduce_scatter = [&] {
      if (bf16) add("reduce_scatter_grads", "all_to_all", static_cast<double>(param_bytes) / 2 * share);
      else add("reduce_scatter_grads", "all_reduce", static_cast<double>(param_bytes) * share);
    };
    if (schedule.mesh.zero == 3) {  // parameters gathered for the forward and again for the backward
      reduce_scatter();
      add("all_gather_params_forward", "all_gather", static_cast<double>(param_bytes) * share);
      add("all_gather_params_backward", "all_gather", static_cast<double>(param_bytes) * share);
    } else if (schedule.mesh.zero) {
      reduce_scatter();
      add("all_gather_params", "all_gather", static_cast<double>(param_bytes) * share);
    } else if (bf16) {
      reduce_scatter();
      add("all_gather_grads", "all_gather", static_cast<double>(param_bytes) * share);
    } else {
      add("all_reduce_grads", "all_reduce", 2 * static_cast<double>(param_bytes) * share);
    }
  }
  // AdamW reads parameter, gradient and two moments and writes three of them.
  const double updated = static_cast<double>(p.num_params) / static_cast<double>(schedule.mesh.zero ? ranks : 1);
  p.optimizer_s = cluster.kernel_time("pointwise", 12 * updated, 28 * updated);
  // Each offloaded value goes out and comes back once a step; the copies
  // run on the compute stream today, so none of it is hidden.
  for (const PlannedBuffer& b : p.train_program.buffers)
    if (b.evict >= 0) {
      const double bytes = static_cast<double>(stored(b.bytes));
      p.offload_s += 2 * (cluster.host_link.alpha_s + bytes * cluster.host_link.beta_s_per_byte);
    }
  // Under ZeRO the update reduce-scatters the gradients after the backward
  // (examples/llama/train.cpp); summed from bf16 on a GPU, they are summed
  // whole after it too (runtime::Model: grads_on_device).
  const int64_t largest_bucket =
      lay_out_step(p, cluster, schedule.mesh.zero == 0 && !(gpu && schedule.grad_reduce_precision == "bf16"));

  // Memory of one rank, as runtime::Model and the training loop allocate it.
  MemoryBreakdown& mem = p.memory;
  int64_t layer = 0;  // one layer's parameters
  for (const Value& v : p.model.params) {
    const int64_t b = arena_aligned(stored(value_bytes(v.type())));
    mem.parameters += b;
    if (g.node(v.id).name.rfind("model.layers.0.", 0) == 0) layer += b;
  }
  mem.gradients = mem.parameters;
  if (schedule.mesh.zero == 3) {  // sharded; two layers' parameters gathered ahead, one layer's gradients
    mem.parameters = mem.parameters / ranks + 2 * layer;
    mem.gradients = mem.gradients / ranks + layer;
  }
  if (req.precision == "bf16-mixed") {  // f32 master weights and two moments
    mem.optimizer_state = 12 * p.num_params / (schedule.mesh.zero ? ranks : 1);
  } else {  // two moments, and with ZeRO-1 the updated shard before it is gathered
    const int64_t f32 = 4 * p.num_params;
    mem.optimizer_state = schedule.mesh.zero ? 2 * f32 / ranks + f32 / ranks : 2 * f32;
  }
  mem.activations = stored(std::max(p.train_program.arena_bytes, p.forward_program.arena_bytes));
  mem.offloaded = stored(std::max(p.train_program.offload_bytes, p.forward_program.offload_bytes));
  mem.kernel_scratch = stored(gpu ? heap_scratch + mapped_scratch : caller_scratch + (threads - 1) * task_scratch);
  mem.collective_buffers = staging_bytes(p.train_program, staging_of, all_to_all, gpu);
  if (!gpu && ranks > 1) mem.collective_buffers += grad_sum_staging(schedule, largest_bucket ? largest_bucket : 4 * p.num_params, ranks);
  const int64_t tokens = req.batch * p.local_seq;
  mem.data = 3 * arena_aligned(4 * tokens) + 3 * 4 * tokens;  // the model's aligned copies and the loader's arrays
  mem.runtime_baseline = cluster.process_baseline_bytes;
  return p;
}

namespace {

// Where a call of the train program runs: its layer and direction.
struct CallSite {
  std::string layer;  // empty: unnamed
  bool backward = false;
};
CallSite call_site(const Plan& p, int call) {
  const PlannedCall& at = p.train_program.calls[static_cast<size_t>(call)];
  if (at.stage < 0) return {};
  const Node& root = p.model.graph->node(p.train.stages[static_cast<size_t>(at.stage)].root);
  return {layer_of(root.name), root.backward};
}

}  // namespace

std::string Plan::report() const {
  std::ostringstream os;
  char line[512];
  const Graph& g = *model.graph;
  std::snprintf(line, sizeof line, "plan: %s, batch %lld x seq %lld (%lld tokens per row on each rank), %s, ",
                request.config.c_str(), static_cast<long long>(request.batch), static_cast<long long>(request.seq),
                static_cast<long long>(local_seq), request.precision.c_str());
  os << line << schedule.str() << "\n";  // (a schedule of many rules is longer than `line`)
  std::snprintf(line, sizeof line, "cluster: %s (%lld ranks, %lld per node): %s\n", cluster.name.c_str(),
                static_cast<long long>(cluster.ranks), static_cast<long long>(cluster.ranks_per_node), cluster.source.c_str());
  os << line;
  std::snprintf(line, sizeof line, "%zu nodes, %zu stages (train), %zu kernels, %lld parameters\n\n", static_cast<size_t>(g.size()),
                train.stages.size(), train.kernels.size(), static_cast<long long>(num_params));
  os << line;
  // Stages grouped by layer and direction, in order of first appearance.
  struct Group { std::string name; int stages = 0; double flops = 0, time = 0; int64_t bytes = 0; };
  std::vector<Group> groups;
  for (const StageCost& s : stages) {
    const std::string name = (s.layer.empty() ? std::string("(unnamed)") : s.layer) + (s.backward ? " backward" : " forward");
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& x) { return x.name == name; });
    if (it == groups.end()) groups.push_back({name}), it = groups.end() - 1;
    ++it->stages, it->flops += s.flops, it->time += s.time_s, it->bytes += s.bytes;
  }
  os << "  stages                              kernels      GFLOP     MiB moved   predicted ms\n";
  for (const Group& x : groups) {
    std::snprintf(line, sizeof line, "  %-36s %6d %10.3f %13.1f %14.3f\n", x.name.c_str(), x.stages, x.flops / 1e9,
                  mib(x.bytes), x.time * 1e3);
    os << line;
  }
  os << "\n  collectives                         count   MiB sent per rank   predicted ms\n";
  std::map<std::string, std::tuple<int, int64_t, double>> by_op;
  for (const CollectiveCost& c : collectives) {
    auto& [n, b, t] = by_op[c.op + " over " + c.axis + "=" + std::to_string(c.degree)];
    ++n, b += c.bytes_per_rank, t += c.time_s;
  }
  for (const auto& [op, v] : by_op) {
    std::snprintf(line, sizeof line, "  %-36s %5d %19.2f %14.3f\n", op.c_str(), std::get<0>(v), mib(std::get<1>(v)),
                  std::get<2>(v) * 1e3);
    os << line;
  }
  os << "\n  memory per rank                     MiB\n";
  for (const auto& [k, v] : memory.items()) {
    std::snprintf(line, sizeof line, "  %-36s %10.1f\n", k.c_str(), mib(v));
    os << line;
  }
  std::snprintf(line, sizeof line, "  %-36s %10.1f%s\n", "predicted peak", mib(memory.total()),
                cluster.memory_per_rank_bytes > 0
                    ? (" of " + std::to_string(cluster.memory_per_rank_bytes >> 20) + " MiB per rank" +
                       (memory.total() > cluster.memory_per_rank_bytes ? ": DOES NOT FIT" : ""))
                          .c_str()
                    : "");
  os << line;
  if (const ArenaPeak peak = arena_peak(); peak.call >= 0) {
    const CallSite where = call_site(*this, peak.call);
    std::snprintf(line, sizeof line, "\n  activations at their fullest: %.1f MiB alive at call %d of %zu (%s%s), the largest:\n",
                  mib(peak.live_bytes), peak.call + 1, train_program.calls.size(),
                  where.layer.empty() ? "unnamed" : where.layer.c_str(), where.backward ? " backward" : " forward");
    os << line;
    const size_t shown = std::min<size_t>(peak.buffers.size(), 8);
    for (size_t i = 0; i < shown; ++i) {
      const PlannedBuffer& b = train_program.buffers[static_cast<size_t>(peak.buffers[i])];
      const Node& n = g.node(b.node);
      std::snprintf(line, sizeof line, "    %8.1f  %-8s %-16s %s  %s\n", mib(b.bytes), n.backward ? "backward" : "forward",
                    op_name(n.op), n.type.str().c_str(), n.name.c_str());
      os << line;
    }
    if (shown < peak.buffers.size()) {
      int64_t rest = 0;
      for (size_t i = shown; i < peak.buffers.size(); ++i) rest += train_program.buffers[static_cast<size_t>(peak.buffers[i])].bytes;
      std::snprintf(line, sizeof line, "    %8.1f  in %zu more\n", mib(rest), peak.buffers.size() - shown);
      os << line;
    }
  }
  if (memory.offloaded > 0) {
    std::snprintf(line, sizeof line, "  %-36s %10.1f (host memory, not in the peak; %.4f s a step out and back)\n",
                  "offloaded to the host", mib(memory.offloaded), offload_s);
    os << line;
  }
  char offload_part[64] = "", behind_part[96] = "";
  if (offload_s > 0) std::snprintf(offload_part, sizeof offload_part, ", offload %.4f", offload_s);
  if (cluster.collective_lag_s > 0 && collective_waits > 0)
    std::snprintf(behind_part, sizeof behind_part, " (%.4f for ranks behind at %d collectives)",
                  collective_lags * cluster.collective_lag_s, collective_waits);
  std::snprintf(line, sizeof line,
                "\npredicted step: %.4f s (compute %.4f, communication %.4f of which %.4f waited for%s, optimizer %.4f%s); "
                "%.3f GFLOP per rank (model FLOPs %.3f: 3x the forward's), %.2f MiB sent per rank\n",
                step_s, compute_s, communication_s, exposed_communication_s, behind_part, optimizer_s, offload_part,
                flops() / 1e9, model_flops() / 1e9, mib(collective_bytes_per_rank()));
  os << line;
  // Ring attention's work differs between the ranks (the step waits for the busiest).
  bool ring = false;
  for (const Node& n : model.graph->nodes()) ring = ring || is_ring_block(n);
  if (ring) {
    os << "attention GFLOP per sp rank (" << schedule.sequence_layout << " ring):";
    for (double f : attention_flops_per_rank()) {
      std::snprintf(line, sizeof line, " %.3f", f / 1e9);
      os << line;
    }
    os << "\n";
  }
  return os.str();
}

std::string Plan::summary_json() const {
  nlohmann::json j;
  j["schedule"] = schedule.name;
  j["schedule_spec"] = nlohmann::json::parse(schedule.to_json());
  j["config"] = request.config;
  j["precision"] = request.precision;
  j["cluster"] = cluster.name;
  j["mesh"] = {{"dp", schedule.mesh.dp}, {"sp", schedule.mesh.sp}, {"zero", schedule.mesh.zero}};
  j["seq"] = request.seq;
  j["batch"] = request.batch;
  j["local_seq"] = local_seq;
  j["predicted_peak_bytes_per_rank"] = memory.total();
  j["predicted_step_s"] = step_s;
  for (const auto& [k, v] : memory.items()) j["memory_per_rank"][k] = v;
  j["compute_s"] = compute_s;
  j["communication_s"] = communication_s;
  j["exposed_communication_s"] = exposed_communication_s;
  j["collective_waits"] = collective_waits;
  j["collective_lags"] = collective_lags;
  j["optimizer_s"] = optimizer_s;
  if (memory.offloaded > 0) {
    j["offloaded_bytes_per_rank"] = memory.offloaded;  // host memory, not in the peak
    j["offload_s"] = offload_s;
  }
  j["flops_per_rank"] = flops();
  j["model_flops_per_rank"] = model_flops();
  j["collective_bytes_per_rank"] = collective_bytes_per_rank();
  return j.dump();
}

std::string Plan::to_json() const {
  nlohmann::json j = nlohmann::json::parse(summary_json());
  j["cluster"] = nlohmann::json::parse(cluster.to_json());
  for (const StageCost& s : stages)
    j["stages"].push_back({{"stage", s.stage}, {"kind", s.kind}, {"label", s.label}, {"layer", s.layer},
                           {"backward", s.backward}, {"flops", s.flops}, {"charged_flops", s.charged_flops}, {"bytes", s.bytes},
                           {"scratch_estimate", s.scratch_estimate}, {"time_s", s.time_s}, {"start_s", s.start_s}});
  for (const CollectiveCost& c : collectives)
    j["collectives"].push_back({{"stage", c.stage}, {"op", c.op}, {"kind", c.kind}, {"axis", c.axis},
                                {"degree", c.degree}, {"bytes_per_rank", c.bytes_per_rank}, {"time_s", c.time_s},
                                {"start_s", c.start_s}});
  j["arena_bytes"] = {{"train", train_program.arena_bytes}, {"forward", forward_program.arena_bytes}};
  if (const ArenaPeak peak = arena_peak(); peak.call >= 0) {
    const CallSite where = call_site(*this, peak.call);
    nlohmann::json& a = j["arena_peak"];
    a = {{"call", peak.call + 1}, {"calls", train_program.calls.size()}, {"layer", where.layer},
         {"backward", where.backward}, {"live_bytes", peak.live_bytes}, {"values", nlohmann::json::array()}};
    for (int b : peak.buffers) {
      const PlannedBuffer& x = train_program.buffers[static_cast<size_t>(b)];
      const Node& n = model.graph->node(x.node);
      a["values"].push_back({{"bytes", x.bytes}, {"backward", n.backward}, {"op", op_name(n.op)},
                             {"type", n.type.str()}, {"label", n.name}});
    }
  }
  return j.dump(2);
}

}  // namespace halyard
