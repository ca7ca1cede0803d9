// Generated matmul kernels against Eigen: every contraction kernel of the
// tiny Llama's train step.
//
// The model is planned as llama_aot plans it (batch and all: a weight
// gradient sums over batch and seq), each distinct contraction stage lowered
// and scheduled by the same code as an AOT build (lower_stage +
// schedule_cpu), JIT-compiled, and timed side by side with Eigen's GEMM on
// the same data and thread count. Prints GFLOP/s and the ratio; never asserts.
//   matmul_bench [--threads N] [--seq S] [--reps R] [--config tiny.json]
#include <Eigen/Dense>
#include <HalideBuffer.h>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "bench/bench_target.h"
#include "bench/bench_util.h"
#include "dsl/ops.h"
#include "examples/llama/llama_builder.h"
#include "generators/jit_library.h"
#include "generators/lowering.h"
#include "runtime/model.h"

using namespace halyard;

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

Halide::Buffer<float> random_buffer(const TensorType& t, std::mt19937& rng) {
  std::vector<int> sizes;
  for (int d = t.rank() - 1; d >= 0; --d) sizes.push_back(static_cast<int>(t.axes[static_cast<size_t>(d)].size));
  Halide::Buffer<float> b(sizes);
  std::normal_distribution<float> n(0.f, 1.f);
  b.for_each_value([&](float& x) { x = n(rng); });
  return b;
}

struct Totals {
  double flops = 0, halyard_s = 0, eigen_s = 0;
};

// An operand as a matrix: its axes the output keeps, then the summed ones
// (or the other way round), each group contiguous, as in every contraction
// of the Llama. Empty when it is not one.
struct MatrixView {
  bool ok = false, kept_first = true;
  int64_t kept = 1, summed = 1;
};

MatrixView matrix_view(const TensorType& t, const TensorType& out) {
  MatrixView v;
  std::string groups;  // 'k' or 's' per axis, outermost first
  for (const Axis& a : t.axes) {
    const bool kept = out.has(a.name);
    (kept ? v.kept : v.summed) *= a.size;
    groups += kept ? 'k' : 's';
  }
  const auto first_s = groups.find('s'), last_k = groups.rfind('k');
  const auto first_k = groups.find('k'), last_s = groups.rfind('s');
  v.kept_first = last_k == std::string::npos || first_s == std::string::npos || last_k < first_s;
  v.ok = v.kept_first || last_s < first_k;
  return v;
}

// One of the model's contraction kernels, built, lowered and scheduled as
// its AOT build does, against Eigen's GEMM on the same data and threads.
void run_case(const Graph& g, const Stage& st, int reps, Totals& tot) {
  const Node& n = g.node(st.root);
  const TensorType &ta = g.node(n.inputs[0]).type, &tb = g.node(n.inputs[1]).type;
  const bool operands_in = st.inputs.size() == 2 && st.inputs[0] == n.inputs[0] && st.inputs[1] == n.inputs[1];
  const MatrixView va = matrix_view(ta, n.type), vb = matrix_view(tb, n.type);
  // The output as [a's kept axes, b's kept axes] or the other way round.
  const bool out_ab = n.type.axes.empty() || ta.has(n.type.axes.front().name);
  std::string what = n.name + (n.backward ? " (backward)" : "");
  if (!operands_in || !va.ok || !vb.ok) {
    std::printf("%-44s (not a plain GEMM of its inputs: no Eigen peer)\n", what.c_str());
    return;
  }
  const Halide::Target t = bench::target();
  LoweredStage ls = lower_stage(g, st, false, {}, t.natural_vector_size(Halide::Float(32)));
  schedule_cpu(ls, g, st, t);
  std::mt19937 rng(0);
  std::vector<Halide::Buffer<float>> ins;
  for (size_t i = 0; i < st.inputs.size(); ++i) {
    ins.push_back(random_buffer(g.node(st.inputs[i]).type, rng));
    ls.inputs[i].set(ins.back());
  }
  Eigen::Map<RowMat> A(ins[0].data(), va.kept_first ? va.kept : va.summed, va.kept_first ? va.summed : va.kept);
  Eigen::Map<RowMat> B(ins[1].data(), vb.kept_first ? vb.kept : vb.summed, vb.kept_first ? vb.summed : vb.kept);
  RowMat C(out_ab ? va.kept : vb.kept, out_ab ? vb.kept : va.kept);
  Halide::Buffer<float> result = random_buffer(n.type, rng);
  ls.pipeline.compile_jit(t);
  auto halyard = [&] { ls.pipeline.realize(result); };
  // Each side's median of `reps` calls, best of five alternating rounds: a
  // call takes about a millisecond, so one burst of noise on a shared 2-core
  // VM would otherwise decide a whole row. Each side starts after a pause:
  // the other's idle workers spin for milliseconds after returning (libgomp's
  // and Halide's alike) and would hold a core, halving the rate measured.
  // Each pool's workers then run on CPUs of their own (spread_threads: a
  // worker woken after the pause could share the caller's vCPU).
  auto side = [&](const std::function<void()>& f) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    f();  // starts the side's pool, on the first round
    bench::spread_threads();
    return bench::median_seconds(f, reps);
  };
  auto time_gemm = [&](const auto& L, const auto& R) {  // C = L R^T, L and R [kept x summed]
    double e = 1e30, h = 1e30;
    for (int round = 0; round < 5; ++round) {
      e = std::min(e, side([&] { C.noalias() = L * R.transpose(); }));
      h = std::min(h, side(halyard));
    }
    return std::make_pair(e, h);
  };
  auto with_b = [&](const auto& L, bool b_side) {
    const MatrixView& v = b_side ? vb : va;
    const Eigen::Map<RowMat>& M = b_side ? B : A;
    return v.kept_first ? time_gemm(L, M) : time_gemm(L, M.transpose());
  };
  const MatrixView& vl = out_ab ? va : vb;
  const Eigen::Map<RowMat>& ML = out_ab ? A : B;
  const auto [t_eigen, t_halide] = vl.kept_first ? with_b(ML, out_ab) : with_b(ML.transpose(), out_ab);

  Eigen::Map<RowMat> H(result.data(), C.rows(), C.cols());
  const double max_diff = (H - C).cwiseAbs().maxCoeff() / std::max(1e-30f, C.cwiseAbs().maxCoeff());
  const double flops = 2.0 * static_cast<double>(va.kept) * static_cast<double>(vb.kept) * static_cast<double>(va.summed);
  tot.flops += flops, tot.halyard_s += t_halide, tot.eigen_s += t_eigen;
  const char* kind = !n.backward ? "forward" : n.type.has("seq") ? "grad_input" : "grad_weight";
  std::printf("%-44s %-11s %5lld x %5lld, sum %5lld   halyard %6.1f GFLOP/s   eigen %6.1f GFLOP/s   ratio %.2f   (rel diff %.1e)\n",
              what.c_str(), kind, static_cast<long long>(C.rows()), static_cast<long long>(C.cols()),
              static_cast<long long>(va.summed), flops / t_halide * 1e-9, flops / t_eigen * 1e-9, t_eigen / t_halide,
              max_diff);
}

}  // namespace

int main(int argc, char** argv) {
  halyard::use_library_kernels_in_jit();
  int threads = 2, reps = 9;
  int64_t seq = 4096;
  std::string config = HALYARD_SOURCE_DIR "/examples/llama/configs/tiny.json";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--threads") threads = std::atoi(argv[i + 1]);
    else if (k == "--seq") seq = std::atoll(argv[i + 1]);
    else if (k == "--reps") reps = std::atoi(argv[i + 1]);
    else if (k == "--config") config = argv[i + 1];
  }
  runtime::keep_freed_memory();
  setenv("HL_NUM_THREADS", std::to_string(threads).c_str(), 1);
  Eigen::setNbThreads(threads);
  std::printf("matmul: generated Halide kernels (JIT, same lowering and schedule as AOT) vs Eigen %d.%d.%d, %d threads "
              "(Eigen threads: %d), each the median of %d calls, best of 5 alternating rounds\n",
              EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION, threads, Eigen::nbThreads(), reps);
  // Every distinct contraction kernel of the tiny Llama's train step (the
  // default schedule at `seq` tokens, batch 1), as its AOT build makes them.
  Totals tot;
  try {
    Plan p = plan(llama::llama_builder(), {config, 1, seq}, Schedule::named("default"), Cluster::named("local-cpu"));
    const Graph& g = *p.model.graph;
    std::set<std::string> seen;
    for (const Stage& st : p.train.stages)
      if (g.node(st.root).op == Op::Contract && seen.insert(st.signature).second) run_case(g, st, reps, tot);
  } catch (const Halide::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  // Each side's rate over all the shapes together (total FLOPs / total time):
  // bench.sh sets the training step's useful FLOP rate against Eigen's.
  std::printf("{\"peer\":\"eigen\",\"seq\":%lld,\"threads\":%d,\"halyard_gflops\":%.1f,\"eigen_gflops\":%.1f}\n",
              static_cast<long long>(seq), threads, tot.flops / tot.halyard_s * 1e-9, tot.flops / tot.eigen_s * 1e-9);
  return 0;
}
