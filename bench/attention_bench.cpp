// Causal grouped-query attention, forward + backward, as Halyard generates it.
//
// Builds attention in the DSL, differentiates it, and JIT-compiles the three
// attention kernels of the joint graph (the forward, which also writes each
// row's log-sum-exp; dQ; dK with dV) with the same lowering and CPU schedule
// an AOT build uses. Prints one JSON
// line: median seconds of forward and of forward+backward, and peak RSS (the
// kernels never hold a [seq, seq] matrix). scripts/bench.sh prints it next to
// PyTorch's attention on the same shapes.
//   attention_bench [--seq S] [--heads H] [--kv-heads KV] [--head-dim D] [--threads T] [--reps R]
//                   [--kernel library|halide] [--query-block Q] [--key-block K]
// --kernel is the schedule's attention_kernel (library: the forward, and one
// backward writing dQ, dK and dV); the blocks are its kernel_tiles.
#include <HalideBuffer.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "bench/bench_target.h"
#include "bench/bench_util.h"
#include "dsl/autodiff.h"
#include "dsl/ops.h"
#include "generators/jit_library.h"
#include "generators/lowering.h"
#include "runtime/attention_cpu.h"
#include "runtime/model.h"

using namespace halyard;

int main(int argc, char** argv) {
  halyard::use_library_kernels_in_jit();
  std::map<std::string, int> o = {{"--seq", 4096}, {"--heads", 8}, {"--kv-heads", 2}, {"--head-dim", 32}, {"--threads", 2}, {"--reps", 5}, {"--query-block", 0}, {"--key-block", 0}};
  std::string kernel = "library";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--kernel") kernel = argv[i + 1];
    else o[argv[i]] = std::atoi(argv[i + 1]);
  }
  const auto& kinds = Schedule::attention_kernels();
  if (std::find(kinds.begin(), kinds.end(), kernel) == kinds.end()) {
    std::fprintf(stderr, "error: --kernel %s\nlegal: library, halide\n", kernel.c_str());
    return 2;
  }
  Schedule sched;
  sched.attention_kernel = kernel;
  sched.kernel_tiles.attention_queries = o["--query-block"];
  sched.kernel_tiles.attention_keys = o["--key-block"];
  runtime::keep_freed_memory();
  setenv("HL_NUM_THREADS", std::to_string(o["--threads"]).c_str(), 1);
  const Axis B{"batch", 1}, S{"seq", o["--seq"]}, H{"heads", o["--heads"]}, KV{"kv_heads", o["--kv-heads"]},
      D{"head_dim", o["--head-dim"]};
  Graph g;
  Value q = param(g, "q", DType::f32, {B, S, H, D});
  Value k = param(g, "k", DType::f32, {B, S, KV, D});
  Value v = param(g, "v", DType::f32, {B, S, KV, D});
  Value pos = input(g, "position_ids", DType::i32, {B, S});
  Value out = attention(q, k, v, pos);
  Value r = input(g, "r", DType::f32, out.type().axes);
  Value loss = contract_to(out, r, {});
  Gradients grads = grad(loss, {q, k, v});
  Partition p = partition(g, {grads[q].id, grads[k].id, grads[v].id}, sched);

  // Every buffer a stage reads or writes, filled with small random-ish values.
  std::map<int, Halide::Buffer<>> bufs;
  auto buffer = [&](int id) -> Halide::Buffer<>& {
    auto it = bufs.find(id);
    if (it != bufs.end()) return it->second;
    const TensorType& t = g.node(id).type;
    std::vector<int> sizes;
    for (int d = t.rank() - 1; d >= 0; --d) sizes.push_back(static_cast<int>(t.axes[static_cast<size_t>(d)].size));
    Halide::Buffer<> b(halide_type(t.dtype), sizes);
    if (t.dtype == DType::i32) {
      Halide::Buffer<int32_t> bi(b);
      bi.for_each_element([&](const int* c) { bi(c) = c[0]; });  // positions 0..S-1
    } else {
      Halide::Buffer<float> bf(b);
      unsigned x = 1;
      bf.for_each_value([&](float& f) { x = x * 1664525u + 1013904223u; f = static_cast<float>(x >> 8) / (1 << 24) - 0.5f; });
    }
    return bufs.emplace(id, b).first->second;
  };
  struct Kernel {
    std::string name;
    LoweredStage ls;
    int root;
    std::vector<int> extra;
  };
  std::vector<Kernel> kernels;
  Halide::Target t = bench::target();
  for (const Stage& st : p.stages) {
    Op op = g.node(st.root).op;
    if (op != Op::Attention && op != Op::AttentionLse && op != Op::AttentionGradQ && op != Op::AttentionGradK &&
        op != Op::AttentionGradV)
      continue;
    LoweredStage ls = lower_stage(g, st, false, sched.kernel_tiles, t.natural_vector_size(Halide::Float(32)));
    try {
      schedule_cpu(ls, g, st, t, sched.kernel_tiles);
      ls.pipeline.compile_jit(t);
    } catch (const Halide::Error& e) {
      std::fprintf(stderr, "%s: %s\n", op_name(op), e.what());
      return 1;
    }
    for (size_t i = 0; i < st.inputs.size(); ++i) ls.inputs[i].set(buffer(st.inputs[i]));
    std::string name = op_name(op);
    for (int x : st.extra_outputs) name += g.node(x).op == Op::AttentionLse ? "+lse" : g.node(x).op == Op::AttentionGradV ? "+v" : "+q";
    kernels.push_back({name + (st.library ? " (library)" : ""), std::move(ls), st.root, st.extra_outputs});
  }
  double fwd = 0, total = 0;
  for (Kernel& kern : kernels) {
    Halide::Buffer<>& dst = buffer(kern.root);
    std::vector<Halide::Buffer<>> outs = {dst};
    for (int x : kern.extra) outs.push_back(buffer(x));  // dV with dK, the log-sum-exp with the output
    const double s = bench::median_seconds([&] { kern.ls.pipeline.realize(Halide::Realization(outs)); }, o["--reps"]);
    total += s;
    if (kern.name.rfind("attention+", 0) == 0 || kern.name == "attention") fwd = s;
    std::fprintf(stderr, "  %-18s %8.1f ms\n", kern.name.c_str(), s * 1e3);
  }
  std::printf("{\"peer\":\"halyard\",\"bench\":\"attention\",\"kernel\":\"%s\",\"isa\":\"%s\",\"seq\":%d,\"heads\":%d,\"kv_heads\":%d,\"head_dim\":%d,"
              "\"threads\":%d,\"forward_s\":%.4f,\"forward_backward_s\":%.4f,\"peak_rss_mib\":%.1f}\n",
              kernel.c_str(), kernel == "library" ? runtime::attention_cpu::isa() : ("halide " + t.to_string()).c_str(), o["--seq"], o["--heads"], o["--kv-heads"], o["--head-dim"], o["--threads"], fwd, total, bench::peak_rss_mib());
  return 0;
}
