// The runtime's GEMM (runtime/gemm.h), which CUDA targets call for every
// contraction of GEMM form (Schedule::contract_kernel "cublas", cuBLAS on
// the device). What does not need a GPU is checked here:
//   - which contractions of the Llama take that form (all its projections,
//     their input gradients and weight gradients);
//   - the descriptor: buffers of every layout, a sequence tile's strided
//     rows among them, as column-major calls in cuBLAS's conventions, run
//     by the reference against a plain sum over the buffers;
//   - the lowering: a stage whose contraction calls the GEMM (on the host,
//     where it runs the reference) gives what Halide's own contraction does,
//     and compiles for a CUDA target as a call on the device.
// On a GPU, test_cuda runs the same calls through cuBLAS in a whole step.
#include <gtest/gtest.h>

#include <HalideBuffer.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <regex>
#include <string>

#include "dsl/ops.h"
#include "examples/llama/llama_builder.h"
#include "generators/jit_library.h"
#include "generators/lowering.h"
#include "runtime/gemm.h"
#include "schedules/plan.h"
#include "tests/temp_dir.h"

namespace halyard {
namespace {

[[maybe_unused]] const bool kLibraryKernels = (use_library_kernels_and_gemm_in_jit(), true);

const std::string kMicro = std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/llama_micro.json";

TEST(Gemm, EveryContractionOfTheLlamaIsOneGemm) {
  Schedule s = Schedule::named("tiled");
  s.contract_kernel = "cublas";
  s.attention_kernel = s.weight_grad_kernel = "halide";  // as halyard_aot sets them for CUDA targets
  const Plan p = plan(llama::llama_builder(), {kMicro, 2, 32}, s, Cluster::named("local-cpu"));
  const Graph& g = *p.model.graph;
  int contractions = 0, gemms = 0;
  for (const Stage& st : p.train.stages) {
    const Node& n = g.node(st.root);
    if (n.op != Op::Contract) continue;
    ++contractions;
    gemms += st.gemm;
    EXPECT_TRUE(st.gemm) << n.name << " " << n.type.str();
  }
  // q, k, v, o, gate, up, down per layer and the LM head: forward, input and weight gradients.
  EXPECT_GT(contractions, 3 * 8);
  EXPECT_EQ(gemms, contractions);
  // "auto" (the default) leaves CPU plans to Halide; halyard_aot settles it from the target.
  const Plan cpu = plan(llama::llama_builder(), {kMicro, 2, 32}, Schedule::named("tiled"), Cluster::named("local-cpu"));
  for (const Stage& st : cpu.train.stages) EXPECT_FALSE(st.gemm);
}

// A buffer of `extents` (innermost first) inside a larger allocation: each
// dimension `pad` elements wider than it needs (a tile of a longer sequence).
struct Strided {
  std::vector<float> data;
  std::vector<halide_dimension_t> dims;
  halide_buffer_t buf{};
  Strided(const std::vector<int>& extents, const std::vector<int>& pad, std::mt19937& rng) {
    int64_t stride = 1;
    for (size_t d = 0; d < extents.size(); ++d) {
      dims.push_back(halide_dimension_t(0, extents[d], static_cast<int32_t>(stride)));
      stride *= extents[d] + pad[d];
    }
    data.resize(static_cast<size_t>(stride));
    std::normal_distribution<float> normal(0.f, 1.f);
    for (float& x : data) x = normal(rng);
    buf.host = reinterpret_cast<uint8_t*>(data.data());
    buf.type = halide_type_t(halide_type_float, 32);
    buf.dimensions = static_cast<int32_t>(dims.size());
    buf.dim = dims.data();
  }
  float at(const std::vector<int>& x) const {
    int64_t off = 0;
    for (size_t d = 0; d < x.size(); ++d) off += static_cast<int64_t>(x[d]) * dims[d].stride;
    return data[static_cast<size_t>(off)];
  }
};

// Every combination of the operands' layouts, with groups of 1 to 3
// dimensions, padded (strided) or dense: the calls the descriptor makes,
// run by the reference, equal a plain sum over the buffers' coordinates.
TEST(Gemm, DescriptorReadsEveryLayoutAndStridedTiles) {
  std::mt19937 rng(7);
  struct Shape {
    std::vector<int> m, n, k, m_pad, k_pad;
    size_t loops;  // calls expected beyond one
  };
  const std::vector<Shape> shapes = {
      {{5}, {7}, {3}, {0}, {0}, 1},
      {{4, 3}, {6}, {5}, {0, 0}, {0}, 1},         // [batch, seq] rows, dense: one call
      {{4, 3}, {6}, {5}, {2, 0}, {0}, 3},         // a tile of seq: a loop over batch
      {{6}, {2, 4}, {3, 2}, {0}, {3, 0}, 2},      // heads x head_dim columns; tokens a tile over batch
      {{2, 1, 3}, {5}, {4, 1, 2}, {1, 0, 0}, {0, 0, 0}, 3},
  };
  for (const Shape& s : shapes)
    for (int a_k_inner = 0; a_k_inner < 2; ++a_k_inner)
      for (int b_k_inner = 0; b_k_inner < 2; ++b_k_inner) {
        const int mdims = static_cast<int>(s.m.size()), ndims = static_cast<int>(s.n.size()),
                  kdims = static_cast<int>(s.k.size());
        auto cat = [](std::vector<int> x, const std::vector<int>& y) {
          x.insert(x.end(), y.begin(), y.end());
          return x;
        };
        const std::vector<int> zero_n(s.n.size(), 0), zero_m(s.m.size(), 0);
        // The tile's padding lies in its m and k dimensions (rows of a longer sequence).
        Strided a(a_k_inner ? cat(s.k, s.m) : cat(s.m, s.k), a_k_inner ? cat(s.k_pad, s.m_pad) : cat(s.m_pad, s.k_pad), rng);
        Strided b(b_k_inner ? cat(s.k, s.n) : cat(s.n, s.k), b_k_inner ? cat(s.k_pad, zero_n) : cat(zero_n, s.k_pad), rng);
        Strided out(cat(s.n, s.m), cat(zero_n, zero_m), rng);
        const runtime::gemm::Calls calls =
            runtime::gemm::describe(&a.buf, &b.buf, mdims, ndims, kdims, a_k_inner, b_k_inner, &out.buf);
        const std::string what = "m " + std::to_string(mdims) + " n " + std::to_string(ndims) + " k " +
                                 std::to_string(kdims) + " a_k_inner " + std::to_string(a_k_inner) + " b_k_inner " +
                                 std::to_string(b_k_inner) + " pads " + std::to_string(s.loops);
        ASSERT_EQ(calls.error, "") << what;
        EXPECT_EQ(calls.calls.size(), s.loops) << what;
        for (const runtime::gemm::Call& c : calls.calls)
          runtime::gemm::reference(c, reinterpret_cast<const float*>(b.buf.host),
                                   reinterpret_cast<const float*>(a.buf.host), reinterpret_cast<float*>(out.buf.host));
        // The sum over every coordinate of m, n and k.
        double worst = 0;
        std::vector<int> mi(s.m.size()), ni(s.n.size()), ki(s.k.size());
        auto next = [](std::vector<int>& x, const std::vector<int>& e) {
          for (size_t d = 0; d < x.size(); ++d) {
            if (++x[d] < e[d]) return true;
            x[d] = 0;
          }
          return false;
        };
        do {
          do {
            double want = 0;
            std::fill(ki.begin(), ki.end(), 0);
            do {
              want += static_cast<double>(a.at(a_k_inner ? cat(ki, mi) : cat(mi, ki))) *
                      b.at(b_k_inner ? cat(ki, ni) : cat(ni, ki));
            } while (next(ki, s.k));
            worst = std::max(worst, std::abs(out.at(cat(ni, mi)) - want));
          } while (next(ni, s.n));
        } while (next(mi, s.m));
        EXPECT_LT(worst, 1e-5) << what;
      }
}

TEST(Gemm, BuffersThatDoNotReadAsAGemmAreRefused) {
  std::mt19937 rng(3);
  Strided a({4, 5}, {0, 0}, rng), b({6, 5}, {0, 0}, rng), out({6, 4}, {0, 0}, rng);
  b.dims[0].stride = 2;  // columns of b not dense
  b.dims[1].stride = 12;
  const runtime::gemm::Calls calls = runtime::gemm::describe(&a.buf, &b.buf, 1, 1, 1, false, false, &out.buf);
  EXPECT_NE(calls.error.find("not dense in b"), std::string::npos) << calls.error;
  Strided wrong({4, 3}, {0, 0}, rng);
  EXPECT_NE(runtime::gemm::describe(&wrong.buf, &b.buf, 1, 1, 1, false, false, &out.buf).error.find("same k"),
            std::string::npos);
}

// A projection's forward, input gradient and weight gradient, with a batch
// axis and a [heads, head_dim] side: lowered with the GEMM (the reference,
// on the host) and with Halide's contraction, run on the same data.
struct Contraction {
  const char* kind;
  int64_t batch, seq, model, heads, head_dim;
};

// With bf16 operands (contract_precision "bf16": the stage reads 16-bit
// copies and decodes them), the GEMM reads the copies themselves.
TEST(Gemm, LoweredGemmStagesEqualHalidesContraction) {
  const std::vector<Contraction> cases = {
      {"forward", 2, 13, 24, 3, 8}, {"grad_input", 2, 13, 24, 3, 8}, {"grad_weight", 2, 13, 24, 3, 8},
      {"forward", 1, 40, 16, 1, 20}, {"grad_weight", 1, 40, 16, 1, 20},
  };
  for (const bool bf16 : {false, true})
  for (const Contraction& c : cases) {
    Graph g;
    const std::vector<Axis> rows = {{"batch", c.batch}, {"seq", c.seq}};
    const std::vector<Axis> cols = {{"heads", c.heads}, {"head_dim", c.head_dim}};
    auto with = [](std::vector<Axis> a, const std::vector<Axis>& b) {
      a.insert(a.end(), b.begin(), b.end());
      return a;
    };
    const DType t = bf16 ? DType::bf16 : DType::f32;
    auto read = [bf16](Value v) { return bf16 ? load_bf16(v) : v; };
    const std::string kind = c.kind;
    Value out;
    if (kind == "forward")
      out = contract(read(input(g, "x", t, with(rows, {{"model", c.model}}))),
                     read(input(g, "w", t, with(cols, {{"model", c.model}}))), {"model"});
    else if (kind == "grad_input")
      out = contract_to(read(input(g, "dy", t, with(rows, cols))), read(input(g, "w", t, with(cols, {{"model", c.model}}))),
                        {"batch", "seq", "model"});
    else
      out = contract_to(read(input(g, "dy", t, with(rows, cols))), read(input(g, "x", t, with(rows, {{"model", c.model}}))),
                        {"heads", "head_dim", "model"});
    const std::string what = kind + (bf16 ? " bf16" : " f32") + " seq " + std::to_string(c.seq);
    std::vector<Halide::Buffer<float>> results;
    for (const char* kernel : {"cublas", "halide"}) {
      Schedule s;
      s.contract_kernel = kernel;
      s.weight_grad_kernel = "halide";
      const Partition p = partition(g, {out.id}, s);
      const Stage& st = p.stages.at(0);
      EXPECT_EQ(st.gemm, std::string(kernel) == "cublas") << what;
      LoweredStage ls = lower_stage(g, st);
      schedule_cpu(ls, g, st, Halide::get_host_target());
      std::mt19937 rng(11);
      std::normal_distribution<float> normal(0.f, 1.f);
      std::vector<Halide::Buffer<>> ins;
      for (size_t i = 0; i < st.inputs.size(); ++i) {
        const TensorType& it = g.node(st.inputs[i]).type;
        EXPECT_EQ(it.dtype, t) << what;
        std::vector<int> sizes;
        for (int d = it.rank() - 1; d >= 0; --d) sizes.push_back(static_cast<int>(it.axes[static_cast<size_t>(d)].size));
        ins.emplace_back(bf16 ? Halide::UInt(16) : Halide::Float(32), sizes);
        for (int64_t e = 0; e < it.numel(); ++e) {
          const float x = normal(rng);
          if (!bf16) {
            static_cast<float*>(ins.back().data())[e] = x;
            continue;
          }
          uint32_t u;
          std::memcpy(&u, &x, sizeof u);
          static_cast<uint16_t*>(ins.back().data())[e] = static_cast<uint16_t>(u >> 16);  // a bf16 value
        }
        ls.inputs[i].set(ins.back());
      }
      std::vector<int> sizes;
      for (int d = out.type().rank() - 1; d >= 0; --d) sizes.push_back(static_cast<int>(out.type().axes[static_cast<size_t>(d)].size));
      results.emplace_back(sizes);
      ls.pipeline.compile_jit(Halide::get_host_target());
      try {
        ls.pipeline.realize(results.back());
      } catch (const Halide::Error& e) {
        FAIL() << what << " through " << kernel << ": " << e.what();
      }
    }
    double worst = 0, scale = 1e-30;
    for (int64_t e = 0; e < out.type().numel(); ++e) {
      worst = std::max(worst, static_cast<double>(std::abs(results[0].data()[e] - results[1].data()[e])));
      scale = std::max(scale, static_cast<double>(std::abs(results[1].data()[e])));
    }
    EXPECT_LT(worst / scale, 1e-5) << what;
  }
}

// The lowered statement of `out`'s stage for a CUDA target, its
// contractions through the runtime's GEMM.
std::string cuda_stmt(Graph& g, const Value& out, const std::string& file) {
  Schedule s;
  s.contract_kernel = "cublas";
  const Partition p = partition(g, {out.id}, s);
  const Stage& st = p.stages.at(0);
  EXPECT_TRUE(st.gemm);
  const Halide::Target cuda("host-cuda-cuda_capability_80");
  LoweredStage ls = lower_stage(g, st, false, {}, 0, Halide::DeviceAPI::CUDA, true);
  schedule_gpu(ls, g, st, cuda);
  const halyard::testing::TempDir dir;
  const std::string stmt = dir / file;
  std::vector<Halide::Argument> args = ls.args;
  ls.pipeline.compile_to_lowered_stmt(stmt, args, Halide::StmtOutputFormat::Text, cuda);
  std::ifstream in(stmt);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// For a CUDA target the stage is an extern stage on the device: the call
// to the runtime's GEMM.
TEST(Gemm, CudaStagesCallTheRuntimeGemmOnTheDevice) {
  Graph g;
  Value out = contract(input(g, "x", DType::f32, {{"batch", 1}, {"seq", 64}, {"model", 32}}),
                       param(g, "w", DType::f32, {{"ffn", 48}, {"model", 32}}), {"model"});
  const std::string text = cuda_stmt(g, out, "gemm_cuda.stmt");
  EXPECT_NE(text.find("halyard_gemm("), std::string::npos);
  // The call is the stage's output, writing the output buffer itself: no
  // kernel of Halide's copies it there. (Halide moves nothing for it either:
  // the runtime uploads an operand the host wrote last, runtime/gemm.h.)
  EXPECT_TRUE(std::regex_search(text, std::regex(R"(halyard_gemm\([^\n]*\)out(\$\d+)?\.buffer\))"))) << text;
  EXPECT_EQ(text.find("halide_cuda_run("), std::string::npos);
}

// Contractions in bf16 on a CUDA target: the GEMM reads the copies (the
// stage's 16-bit inputs) and is told so; nothing of Halide's decodes them
// on the device first.
TEST(Gemm, CudaBf16StagesPassTheCopiesToTheGemm) {
  Graph g;
  Value out = contract(load_bf16(input(g, "x", DType::bf16, {{"batch", 1}, {"seq", 64}, {"model", 32}})),
                       load_bf16(param(g, "w", DType::bf16, {{"ffn", 48}, {"model", 32}})), {"model"});
  const std::string text = cuda_stmt(g, out, "gemm_cuda_bf16.stmt");
  // (a, b, m_dims, n_dims, k_dims, a_k_inner, b_k_inner, bf16 = 1, ...): the stage's inputs in0 and in1 themselves.
  const std::string input_buffer = R"(\(struct halide_buffer_t \*\)in\d\.buffer)";
  EXPECT_TRUE(std::regex_search(text, std::regex("halyard_gemm\\(" + input_buffer + ", " + input_buffer + R"(, \d, \d, \d, [01], [01], 1,)")))
      << text;
  EXPECT_EQ(text.find("halide_cuda_run("), std::string::npos);
}

}  // namespace
}  // namespace halyard
