// Generated matmul kernels against Eigen at the tiny Llama's shapes.
//
// Each contraction is built in the DSL, partitioned and lowered by the same
// code as an AOT build (lower_stage + schedule_cpu), JIT-compiled, and timed
// side by side with Eigen's GEMM on the same data and thread count. Prints
// GFLOP/s and the ratio; never asserts.
//   matmul_bench [--threads N] [--seq S] [--reps R]
#include <Eigen/Dense>
#include <HalideBuffer.h>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "bench/bench_util.h"
#include "dsl/ops.h"
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

// out = x[rows, K] . w[N, K]^T  (forward), or the gradient shapes when `kind` says so.
struct Totals {
  double flops = 0, halyard_s = 0, eigen_s = 0;
};

void run_case(const char* what, int64_t rows, int64_t k, int64_t n, const char* kind, int reps, Totals& tot) {
  Graph g;
  const Axis R{"seq", rows}, K{"model", k}, N{"ffn", n};
  Value out;
  std::string eigen_form;
  if (std::string(kind) == "forward") {  // y[s, f] = sum_m x[s, m] w[f, m]
    Value x = input(g, "x", DType::f32, {R, K});
    Value w = param(g, "w", DType::f32, {N, K});
    out = contract(x, w, {"model"});
  } else if (std::string(kind) == "grad_input") {  // dx[s, m] = sum_f dy[s, f] w[f, m]
    Value dy = input(g, "dy", DType::f32, {R, N});
    Value w = param(g, "w", DType::f32, {N, K});
    out = contract_to(dy, w, {"seq", "model"});
  } else {  // dw[f, m] = sum_s dy[s, f] x[s, m]
    Value dy = input(g, "dy", DType::f32, {R, N});
    Value x = input(g, "x", DType::f32, {R, K});
    out = contract_to(dy, x, {"ffn", "model"});
  }
  Partition p = partition(g, {out.id}, Schedule{});
  const Stage& st = p.stages.at(0);
  LoweredStage ls = lower_stage(g, st);
  Halide::Target t = Halide::get_host_target();
  schedule_cpu(ls, g, st, t);
  std::mt19937 rng(0);
  std::vector<Halide::Buffer<float>> ins;
  for (size_t i = 0; i < st.inputs.size(); ++i) {
    ins.push_back(random_buffer(g.node(st.inputs[i]).type, rng));
    ls.inputs[i].set(ins.back());
  }
  // Eigen first: Halide's worker threads keep spinning for a while after a
  // pipeline returns, which would steal cores from Eigen's OpenMP threads.
  const TensorType& t0 = g.node(st.inputs[0]).type;
  const TensorType& t1 = g.node(st.inputs[1]).type;
  Eigen::Map<RowMat> A(ins[0].data(), t0.axes[0].size, t0.axes[1].size);
  Eigen::Map<RowMat> B(ins[1].data(), t1.axes[0].size, t1.axes[1].size);
  RowMat C(out.type().axes[0].size, out.type().axes[1].size);
  double t_eigen;
  if (std::string(kind) == "forward") t_eigen = bench::median_seconds([&] { C.noalias() = A * B.transpose(); }, reps);
  else if (std::string(kind) == "grad_input") t_eigen = bench::median_seconds([&] { C.noalias() = A * B; }, reps);
  else t_eigen = bench::median_seconds([&] { C.noalias() = A.transpose() * B; }, reps);
  Halide::Buffer<float> result = random_buffer(out.type(), rng);
  ls.pipeline.compile_jit(t);
  const double t_halide = bench::median_seconds([&] { ls.pipeline.realize(result); }, reps);

  double max_diff = 0;
  Eigen::Map<RowMat> H(result.data(), C.rows(), C.cols());
  max_diff = (H - C).cwiseAbs().maxCoeff() / std::max(1e-30f, C.cwiseAbs().maxCoeff());
  const double flops = 2.0 * static_cast<double>(rows * k * n);
  tot.flops += flops, tot.halyard_s += t_halide, tot.eigen_s += t_eigen;
  std::printf("%-28s %-10s %6lld x %5lld x %5lld   halyard %7.1f GFLOP/s   eigen %7.1f GFLOP/s   ratio %.2f   (rel diff %.1e)\n",
              what, kind, static_cast<long long>(rows), static_cast<long long>(k), static_cast<long long>(n),
              flops / t_halide * 1e-9, flops / t_eigen * 1e-9, t_eigen / t_halide, max_diff);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, reps = 9;
  int64_t seq = 4096;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--threads") threads = std::atoi(argv[i + 1]);
    else if (k == "--seq") seq = std::atoll(argv[i + 1]);
    else if (k == "--reps") reps = std::atoi(argv[i + 1]);
  }
  runtime::keep_freed_memory();
  setenv("HL_NUM_THREADS", std::to_string(threads).c_str(), 1);
  Eigen::setNbThreads(threads);
  std::printf("matmul: generated Halide kernels (JIT, same lowering and schedule as AOT) vs Eigen %d.%d.%d, %d threads "
              "(Eigen threads: %d), median of %d\n",
              EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION, threads, Eigen::nbThreads(), reps);
  // The tiny Llama (hidden 256, ffn 768, vocab 256) at `seq` tokens.
  Totals tot;
  try {
    run_case("q/o proj, lm_head", seq, 256, 256, "forward", reps, tot);
    run_case("gate/up proj", seq, 256, 768, "forward", reps, tot);
    run_case("down proj", seq, 768, 256, "forward", reps, tot);
    run_case("gate/up proj", seq, 256, 768, "grad_input", reps, tot);
    run_case("gate/up proj", seq, 256, 768, "grad_weight", reps, tot);
    run_case("down proj", seq, 768, 256, "grad_weight", reps, tot);
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
