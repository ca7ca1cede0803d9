// Single generated kernels against the f64 reference interpreter: each stage
// is lowered and scheduled as an AOT build does it (lower_stage +
// schedule_cpu), JIT-compiled for the host, and run on random data.
//
// Attention (the forward kernel that also writes the log-sum-exp, dQ, and dK
// with dV) runs at lengths that are and are not multiples of its tiles and
// of its 16-key blocks, with ordinary and packed positions.
//
// The linear layer's three contractions run at token counts below, at and
// past the blocks that weight gradients are summed in (schedule_cpu.cpp: 32
// to 512 tokens, chosen from the L1 size; the library's 256), none of them a
// multiple of a block, and with column counts that are and are not a
// multiple of the register tile (the latter keeps the unblocked schedule),
// through Halide's kernels and the library's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <HalideBuffer.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <cstdio>
#include <random>
#include <regex>
#include <set>
#include <string>

#include <unistd.h>

#include "dsl/autodiff.h"
#include "dsl/error.h"
#include "dsl/interpreter.h"
#include "dsl/ops.h"
#include "examples/llama/llama_builder.h"
#include "generators/jit_library.h"
#include "generators/lowering.h"
#include "runtime/attention_cpu.h"
#include "schedules/plan.h"
#include "tests/attention_against_cpu.h"
#include "schedules/precision.h"

namespace halyard {
namespace {

// The library's kernels and the DSL agree on a row that sees no key.
static_assert(runtime::attention_cpu::kNoKeysLse == static_cast<float>(kNoKeysLse));

// Before any stage is lowered: the library stages call the CPU kernels.
[[maybe_unused]] const bool kLibraryKernels = (use_library_kernels_in_jit(), true);

// Halide's JIT runtime holds the OpenCL device state (PoCL's context, each
// kernel's program) until it is released. Released after the last test:
// else LeakSanitizer, which does not scan JIT-compiled code's memory, found
// 4096 bytes held only from there in one run of four.
struct ReleaseJitRuntime : ::testing::Environment {
  void TearDown() override { Halide::Internal::JITSharedRuntime::release_all(); }
};
[[maybe_unused]] ::testing::Environment* const kReleaseJit = ::testing::AddGlobalTestEnvironment(new ReleaseJitRuntime);

struct Case {
  const char* kind;
  int64_t tokens, k, n;
  std::string kernel = "halide";  // the schedule's weight_grad_kernel
  int64_t batch = 0;              // > 0: a batch axis outside seq (summed with it in a weight gradient)
  int64_t heads = 0;              // > 0: the n axis as [heads, n / heads] (a projection's output)
};

std::string name_of(const Case& c) {
  return std::string(c.kind) + " " + std::to_string(c.tokens) + "x" + std::to_string(c.k) + "x" + std::to_string(c.n) +
         (c.batch ? " batch " + std::to_string(c.batch) : "") + (c.heads ? " heads " + std::to_string(c.heads) : "") +
         " " + c.kernel;
}

std::vector<std::string> with_names(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The largest difference from the reference, relative to its largest magnitude.
double run_case(const Case& c) {
  Graph g;
  const Axis R{"seq", c.tokens}, K{"model", c.k};
  std::vector<Axis> rows = {R}, n_axes = {Axis{"ffn", c.n}};
  if (c.batch) rows.insert(rows.begin(), Axis{"batch", c.batch});
  if (c.heads) n_axes = {Axis{"heads", c.heads}, Axis{"ffn", c.n / c.heads}};
  auto with = [](std::vector<Axis> a, const std::vector<Axis>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  std::vector<std::string> n_names, row_names;
  for (const Axis& a : n_axes) n_names.push_back(a.name);
  for (const Axis& a : rows) row_names.push_back(a.name);
  Value out;
  const std::string kind = c.kind;
  if (kind == "forward") {  // y[s, f] = sum_m x[s, m] w[f, m]
    out = contract(input(g, "a", DType::f32, with(rows, {K})), param(g, "b", DType::f32, with(n_axes, {K})), {"model"});
  } else if (kind == "grad_input") {  // dx[s, m] = sum_f dy[s, f] w[f, m]
    out = contract_to(input(g, "a", DType::f32, with(rows, n_axes)), param(g, "b", DType::f32, with(n_axes, {K})),
                      with_names(row_names, {"model"}));
  } else {  // dw[f, m] = sum_s dy[s, f] x[s, m]
    out = contract_to(input(g, "a", DType::f32, with(rows, n_axes)), input(g, "b", DType::f32, with(rows, {K})),
                      with_names(n_names, {"model"}));
  }
  Schedule sched;
  sched.weight_grad_kernel = c.kernel;
  Partition p = partition(g, {out.id}, sched);
  const Stage& st = p.stages.at(0);
  EXPECT_EQ(st.library, kind == "grad_weight" && c.kernel == "library") << name_of(c);
  LoweredStage ls = lower_stage(g, st);
  const Halide::Target t = Halide::get_host_target();
  schedule_cpu(ls, g, st, t);

  std::mt19937 rng(static_cast<unsigned>(c.tokens * 131 + c.k));
  std::normal_distribution<float> normal(0.f, 1.f);
  Interpreter<double> ref(g);
  std::vector<Halide::Buffer<float>> ins;
  for (size_t i = 0; i < st.inputs.size(); ++i) {
    const Node& in = g.node(st.inputs[i]);
    std::vector<int> sizes;
    for (int d = in.type.rank() - 1; d >= 0; --d) sizes.push_back(static_cast<int>(in.type.axes[static_cast<size_t>(d)].size));
    Halide::Buffer<float> b(sizes);
    std::vector<double> values;
    // Row-major element order is the buffer's memory order (innermost axis first).
    for (int64_t e = 0; e < in.type.numel(); ++e) values.push_back(b.data()[e] = normal(rng));
    ref.set(in.name, values);
    ins.push_back(b);
    ls.inputs[i].set(ins.back());
  }
  ref.run();
  std::vector<int> sizes;
  for (int d = out.type().rank() - 1; d >= 0; --d) sizes.push_back(static_cast<int>(out.type().axes[static_cast<size_t>(d)].size));
  Halide::Buffer<float> result(sizes);
  ls.pipeline.compile_jit(t);
  ls.pipeline.realize(result);
  const std::vector<double>& want = ref.value(out);
  double diff = 0, scale = 1e-300;
  for (size_t e = 0; e < want.size(); ++e) {
    diff = std::max(diff, std::abs(static_cast<double>(result.data()[e]) - want[e]));
    scale = std::max(scale, std::abs(want[e]));
  }
  return diff / scale;
}

void run_contraction_cases(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    double err = 1;
    try {
      err = run_case(c);
    } catch (const Halide::Error& e) {
      ADD_FAILURE() << name_of(c) << ": Halide: " << e.what();
      continue;
    }
    std::printf("  %-48s max |diff| / max |ref| = %.2e\n", name_of(c).c_str(), err);
    // f32 sums of up to 2053 products: rounding grows like sqrt(n) * 6e-8.
    EXPECT_LE(err, 2e-5) << name_of(c);
  }
}

TEST(Kernels, ContractionsMatchTheInterpreterAtEveryLength) {
  run_contraction_cases({
      {"forward", 300, 64, 160},       {"grad_input", 300, 64, 160},    {"grad_weight", 37, 64, 160},
      {"grad_weight", 300, 64, 160},   {"grad_weight", 1100, 64, 160},  {"grad_weight", 2053, 64, 160},
      {"grad_weight", 1100, 160, 64},  {"grad_weight", 1100, 72, 100},
      {"forward", 300, 64, 160, "halide", 2, 4},  {"grad_input", 300, 64, 160, "halide", 2, 4},
      {"grad_weight", 300, 64, 160, "halide", 2, 4},
      // Columns narrower than two vectors and not a multiple of one (24 on
      // AVX-512 read B past its edge).
      {"grad_input", 300, 24, 160},    {"forward", 300, 64, 24},
  });
}

// The library weight gradient (runtime/gemm_cpu.h): token counts below, at
// and past its 256-token blocks, none a multiple of them; rows and columns
// that are and are not multiples of its register tile (12 or 6 rows, 32, 16
// or 8 columns); a batch axis summed with seq; a [heads, head_dim] operand
// on either side; and a forward and an input gradient, which stay Halide's.
const std::vector<Case>& library_cases() {
  static const std::vector<Case> cases = {
      {"grad_weight", 37, 64, 160, "library"},   {"grad_weight", 300, 64, 160, "library"},
      {"grad_weight", 1100, 64, 160, "library"}, {"grad_weight", 2053, 64, 160, "library"},
      {"grad_weight", 1100, 160, 64, "library"}, {"grad_weight", 300, 72, 100, "library"},
      {"grad_weight", 300, 13, 7, "library"},    {"grad_weight", 300, 64, 160, "library", 3},
      {"grad_weight", 300, 64, 160, "library", 2, 4}, {"grad_weight", 260, 96, 64, "library", 1, 2},
      {"forward", 300, 64, 160, "library", 2},   {"grad_input", 300, 64, 160, "library", 2},
  };
  return cases;
}

TEST(Kernels, LibraryWeightGradientsMatchTheInterpreterAtEveryLength) { run_contraction_cases(library_cases()); }

// Every vector ISA this CPU runs (runtime/cpu_kernels.cpp chooses the
// widest): the narrower variants are what other machines run.
void in_every_isa(const std::function<void()>& run) {
  for (const char* isa : {"base", "avx2", "avx512"}) {
    setenv("HALYARD_CPU_ISA", isa, 1);
    if (std::string(runtime::attention_cpu::isa()) != isa) {
      std::printf("  [SKIP] this CPU does not run the %s variant\n", isa);
      continue;
    }
    std::printf("  ISA %s\n", isa);
    run();
  }
  unsetenv("HALYARD_CPU_ISA");
}

TEST(Kernels, LibraryWeightGradientsMatchTheInterpreterInEveryIsa) {
  in_every_isa([] { run_contraction_cases({library_cases()[2], library_cases()[6], library_cases()[8]}); });
}

Halide::Buffer<> buffer_of(const TensorType& t) {
  std::vector<int> sizes;
  for (int d = t.rank() - 1; d >= 0; --d) sizes.push_back(static_cast<int>(t.axes[static_cast<size_t>(d)].size));
  return Halide::Buffer<>(halide_storage_type(t.dtype), sizes);
}

// Causal GQA attention and its gradients, every stage of the partition run
// in order (JIT) and each value compared with the interpreter's. Returns the
// worst relative difference; `packed` restarts positions every 29 tokens.
// `kernel` is the schedule's attention_kernel.
struct AttentionCase {
  int64_t seq;
  bool packed;
  std::string kernel;
  int64_t head_dim = 16, batch = 1;
  bool bf16 = false;  // mixed precision (contract_precision "bf16": Attrs::bf16 on attention)
  bool lse_alone = false;  // the log-sum-exp alone (as a backward recomputes it) instead of attention and its gradients
  // A ring attention key block (dsl/ops.h: attention_block) over 4 ranks of
  // `seq` tokens each: rank ring_rank's queries and rank ring_from's keys,
  // the tokens' indices those of the layout (zigzag: chunks r and 7 - r of
  // seq / 2). ring_rank < 0: plain attention.
  int ring_rank = -1, ring_from = 0;
  bool zigzag = false;
  // q, k and v projections of an input, saved in bf16 (a store rule,
  // schedules/precision.h), as the output is: attention's stages read the
  // copies, the library's in place.
  bool stored = false;
  // q and k are RoPE of those, computed inside attention's stages (the rule
  // op:rope compute inline, as AutoSP's plans have it): the stages copy them.
  bool rope = false;
};

constexpr int64_t kRingDegree = 4;

// Rank r's tokens' indices in the whole row (AttentionCase::ring_rank).
std::vector<int32_t> ring_indices(const AttentionCase& c, int64_t r) {
  return testing::ring_token_indices(c.seq, kRingDegree, r, c.zigzag);
}

std::string ring_name(const AttentionCase& c) {
  if (c.ring_rank < 0) return "";
  return std::string(c.zigzag ? " zigzag" : " ring") + " rank " + std::to_string(c.ring_rank) + " keys of rank " +
         std::to_string(c.ring_from);
}

// The stages of attention's forward and of its gradients (4 heads, 2 KV
// heads), in `g`, or where the case stores or rounds values in the graph
// store_saved and round_contractions make of it (left in *rounded).
Partition attention_partition(Graph& g, const AttentionCase& c, std::unique_ptr<Graph>* rounded = nullptr) {
  Schedule sched;
  sched.attention_kernel = c.kernel;
  if (c.bf16) sched.contract_precision = "bf16";
  const Axis B{"batch", c.batch}, S{"seq", c.seq}, H{"heads", 4}, KV{"kv_heads", 2}, D{"head_dim", c.head_dim};
  Value q, k, v;
  std::vector<Value> wrt;
  Value pos = input(g, "position_ids", DType::i32, {B, S});
  if (c.stored) {
    const Axis M{"model", 8};
    Value x = input(g, "x", DType::f32, {B, S, M});
    auto projection = [&](const char* name, const Axis& heads) {
      wrt.push_back(param(g, name, DType::f32, {M, heads, D}));
      return contract_to(x, wrt.back(), {"batch", "seq", heads.name, "head_dim"});
    };
    q = projection("wq", H), k = projection("wk", KV), v = projection("wv", KV);
  } else {
    q = param(g, "q", DType::f32, {B, S, H, D});
    k = param(g, "k", DType::f32, {B, S, KV, D});
    v = param(g, "v", DType::f32, {B, S, KV, D});
    wrt = {q, k, v};
  }
  if (c.rope) q = rope(q, pos, 10000.0), k = rope(k, pos, 10000.0);
  if (c.rope) sched.values.push_back({"op:rope", "", "inline", ""});
  if (c.stored) sched.values.push_back({"*", "", "", "bf16"});
  TokenIndex index;
  Attrs block;
  if (c.ring_rank >= 0) {
    index = {input(g, "query_index", DType::i32, {B, S}), input(g, "key_index", DType::i32, {B, S})};
    block.degree = kRingDegree;
    block.offset = ((c.ring_rank - c.ring_from) % kRingDegree + kRingDegree) % kRingDegree;
    block.layout = c.zigzag ? "zigzag" : "contiguous";
  }
  Value out = c.ring_rank >= 0 ? attention_block(q, k, v, pos, index, block) : attention(q, k, v, pos);
  Value r = input(g, "r", DType::f32, out.type().axes);
  Value loss = contract_to(out, r, {});
  Gradients grads = grad(loss, wrt);
  std::vector<int> outputs = {out.id};
  for (const Value& w : wrt) outputs.push_back(grads[w].id);
  if (c.lse_alone) outputs = {(c.ring_rank >= 0 ? attention_block_lse(q, k, pos, index, block) : attention_lse(q, k, pos)).id};
  const Graph* src = &g;
  auto rebuilt = [&](StoredGraph sg) {
    if (!sg.graph) return;
    for (int& id : outputs) id = sg.id_of[static_cast<size_t>(id)];
    *rounded = std::move(sg.graph);
    src = rounded->get();
  };
  if (c.stored) rebuilt(store_saved(*src, sched));
  if (c.bf16) rebuilt(round_contractions(*src, sched));
  return partition(*src, outputs, sched);
}

// `target`: what Halide compiles the generated kernels for (the host's by
// default; a GPU target gets the GPU schedule); `bits`, if given, receives a
// 64-bit FNV-1a hash of every value the stages wrote.
double attention_case(const AttentionCase& c, const Halide::Target* target = nullptr, uint64_t* bits = nullptr) {
  const int64_t seq = c.seq;
  const bool packed = c.packed;
  Graph g0;
  std::unique_ptr<Graph> rounded;
  Partition p = attention_partition(g0, c, &rounded);
  const Graph& g = rounded ? *rounded : g0;

  Interpreter<double> ref(g);
  std::map<int, Halide::Buffer<>> bufs;
  std::mt19937 rng(static_cast<unsigned>(seq));
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int id = 0; id < static_cast<int>(g.nodes().size()); ++id) {
    const Node& n = g.node(id);
    if (n.op != Op::Input && n.op != Op::Param) continue;
    Halide::Buffer<> b = buffer_of(n.type);
    if (n.type.dtype == DType::i32) {
      // Each token's index in the row: its seq index, or a ring block's
      // (the queries' for the positions).
      const std::vector<int32_t> qidx = c.ring_rank >= 0 ? ring_indices(c, c.ring_rank) : std::vector<int32_t>{},
                                 kidx = c.ring_rank >= 0 ? ring_indices(c, c.ring_from) : std::vector<int32_t>{};
      std::vector<int32_t> values;
      for (int64_t e = 0; e < n.type.numel(); ++e) {
        const int64_t i = e % seq, at = c.ring_rank >= 0 ? qidx[static_cast<size_t>(i)] : i;
        const int64_t x = n.name == "key_index" ? kidx[static_cast<size_t>(i)] : n.name == "query_index" ? at : packed ? at % 29 : at;
        values.push_back(static_cast<Halide::Buffer<int32_t>>(b).data()[e] = static_cast<int32_t>(x));
      }
      ref.set_int(n.name, values);
    } else {
      std::vector<double> values;
      for (int64_t e = 0; e < n.type.numel(); ++e)
        values.push_back(static_cast<Halide::Buffer<float>>(b).data()[e] = normal(rng));
      ref.set(n.name, values);
    }
    b.set_host_dirty();  // (a GPU target uploads only what the host wrote)
    bufs.emplace(id, b);
  }
  ref.run();
  const Halide::Target t = target ? *target : Halide::get_host_target();
  double worst = 0;
  int attention_kernels = 0;
  uint64_t hash = 1469598103934665603ull;
  for (const Stage& st : p.stages) {
    LoweredStage ls = lower_stage(g, st, false, {}, t.natural_vector_size(Halide::Float(32)), Halide::DeviceAPI::Host,
                                  t.has_gpu_feature());
    if (t.has_gpu_feature()) schedule_gpu(ls, g, st, t);
    else schedule_cpu(ls, g, st, t);
    for (size_t i = 0; i < st.inputs.size(); ++i) ls.inputs[i].set(bufs.at(st.inputs[i]));
    std::vector<int> written = {st.root};
    written.insert(written.end(), st.extra_outputs.begin(), st.extra_outputs.end());
    std::vector<Halide::Buffer<>> outs;
    for (int id : written) outs.push_back(bufs.emplace(id, buffer_of(g.node(id).type)).first->second);
    ls.pipeline.compile_jit(t);
    ls.pipeline.realize(Halide::Realization(outs), t);
    for (Halide::Buffer<>& o : outs) o.copy_to_host();  // a GPU target leaves them on the device
    const std::string kind = op_name(g.node(st.root).op);
    if (kind.rfind("attention", 0) == 0) ++attention_kernels;
    for (int id : written) {
      if (g.node(id).type.dtype != DType::f32) continue;  // (bf16 copies: their readers are compared)
      const std::vector<double>& want = ref.value(id);
      const float* got = static_cast<Halide::Buffer<float>>(bufs.at(id)).data();
      const auto* byte = reinterpret_cast<const unsigned char*>(got);
      for (size_t e = 0; e < want.size() * sizeof(float); ++e) hash = (hash ^ byte[e]) * 1099511628211ull;
      // In bf16 the root mean squares' ratio: a probability or a dS that the
      // kernels round (unnormalized, in their key blocks) to the other side
      // of a bf16 rounding from the interpreter's moves a few elements by
      // up to 2^-9 of the largest. So does a stored value (a projection) that
      // f32 and f64 round to neighbouring bf16s.
      const bool rounding = c.bf16 || c.stored;
      double diff = 0, scale = 1e-300;
      for (size_t e = 0; e < want.size(); ++e) {
        if (want[e] <= -1e29) {  // a ring block's row that sees no key: its log-sum-exp, -1e30
          EXPECT_LE(got[e], -1e29) << op_name(g.node(id).op) << " %" << id << " element " << e << ring_name(c);
          continue;
        }
        const double d = static_cast<double>(got[e]) - want[e];
        diff = rounding ? diff + d * d : std::max(diff, std::abs(d));
        scale = rounding ? scale + want[e] * want[e] : std::max(scale, std::abs(want[e]));
      }
      const double rel = rounding ? std::sqrt(diff / scale) : diff / scale;
      worst = std::max(worst, rel);
      // A ring block before the queries' own has every row see all its keys,
      // each row's output a mean over hundreds of them (and small): there the
      // roundings move it by up to half a bf16 step, 2^-9 of it (1.1e-3
      // measured at 300 tokens), where a causal row's few keys move it less.
      const double bf16_bound = c.ring_rank >= 0 ? std::ldexp(1.0, -9) : 1e-3;
      EXPECT_LE(rel, rounding ? bf16_bound : 1e-5) << op_name(g.node(id).op) << " %" << id << " at seq " << seq << ", "
                                              << c.kernel << " kernels, head_dim " << c.head_dim << ", batch " << c.batch
                                              << (c.bf16 ? ", bf16" : "") << (c.stored ? ", stored in bf16" : "")
                                              << ring_name(c);
    }
  }
  if (c.lse_alone)
    EXPECT_EQ(attention_kernels, 1) << "the log-sum-exp alone";
  else if (c.kernel == "library")
    EXPECT_EQ(attention_kernels, 2) << "the forward with its log-sum-exp; one backward writing dK, dV and dQ";
  else
    EXPECT_EQ(attention_kernels, 3) << "the forward with its log-sum-exp, dQ, dK with dV";
  if (bits) *bits = hash;
  return worst;
}

void run_attention_cases(const std::vector<AttentionCase>& cases, const Halide::Target* target = nullptr) {
  for (const AttentionCase& c : cases) {
    double err = 1;
    try {
      err = attention_case(c, target);
    } catch (const Halide::Error& e) {
      ADD_FAILURE() << "seq " << c.seq << ": Halide: " << e.what();
      continue;
    }
    std::printf("  attention%s %-7s seq %4lld d %3lld batch %lld %-7s%s worst value %s = %.2e\n",
                c.lse_alone ? " lse" : "", target && target->has_gpu_feature() ? "gpu" : c.kernel.c_str(),
                static_cast<long long>(c.seq),
                static_cast<long long>(c.head_dim), static_cast<long long>(c.batch), c.packed ? "packed" : "causal",
                ring_name(c).c_str(), c.bf16 || c.stored ? "bf16: rms diff / rms ref" : "max |diff| / max |ref|", err);
  }
}

TEST(Kernels, AttentionMatchesTheInterpreterAtShortLengths) {
  run_attention_cases({{37, false, "halide"}, {100, true, "halide"}});
}

// (Apart from the short ones so that the sanitizer run, which they would
// hold for minutes compiling in Halide, can leave them out.)
TEST(Kernels, AttentionMatchesTheInterpreterAtLongerLengths) {
  run_attention_cases({{300, false, "halide"}, {520, false, "halide"}, {300, true, "halide"}});
}

// The GPU schedule (schedule_gpu.cpp: one thread per row, O(S) memory),
// compiled for OpenCL and run by PoCL, OpenCL on the CPU (scripts/setup.sh
// installs it): the same lengths, packed rows, a batch and a head_dim that
// is no power of two.
TEST(Kernels, GpuAttentionMatchesTheInterpreterAtEveryLength) {
  const Halide::Target opencl("host-opencl-cl_doubles");
  run_attention_cases({{37, false, "halide"}, {300, false, "halide"}, {100, true, "halide"}, {130, true, "halide", 24, 2}},
                      &opencl);
}

// What a lowered stage allocates, with its buffers' sizes fixed: bytes in
// device memory (Halide's buffers, outside kernels; on a CPU target, its
// heap), and bytes its kernels declare per thread, summed over its kernels
// (registers or local memory: arrays in the OpenCL C source, the local
// depots of the PTX).
struct Allocated {
  int64_t memory = 0, per_thread = 0;
  std::vector<std::string> unsized;
};

// A lowered stage's statement text for target t. The file is this
// process's own: ctest runs this binary's tests in parallel processes, and
// one shared name let a test read another's half-written file.
std::string lowered_stmt(LoweredStage& ls, const Halide::Target& t) {
  static int calls = 0;
  const std::string path =
      ::testing::TempDir() + "/stage." + std::to_string(getpid()) + "." + std::to_string(calls++) + ".stmt";
  ls.pipeline.compile_to_lowered_stmt(path, ls.args, Halide::StmtOutputFormat::Text, t);
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  return text;
}

Allocated allocations_of(const Graph& g, const Stage& st, const Halide::Target& t,
                         Halide::DeviceAPI library = Halide::DeviceAPI::Host) {
  LoweredStage ls = lower_stage(g, st, false, {}, 0, library, t.has_gpu_feature());
  if (t.has_gpu_feature()) schedule_gpu(ls, g, st, t);
  else schedule_cpu(ls, g, st, t);
  auto fix = [](Halide::OutputImageParam b, const TensorType& type) {
    for (int d = 0; d < type.rank(); ++d) b.dim(d).set_bounds(0, static_cast<int>(type.axes[static_cast<size_t>(type.rank() - 1 - d)].size));
  };
  for (size_t k = 0; k < st.inputs.size(); ++k) fix(ls.inputs[k], g.node(st.inputs[k]).type);
  fix(ls.funcs.out.output_buffers().front(), g.node(st.root).type);  // (a Tuple's others follow the first)
  for (size_t k = 0; k < ls.funcs.extra_outs.size(); ++k)
    fix(ls.funcs.extra_outs[k].output_buffer(), g.node(st.extra_outputs[k]).type);
  struct Walk : Halide::Internal::IRVisitor {
    Allocated a;
    using IRVisitor::visit;
    void visit(const Halide::Internal::Allocate* op) override {
      int64_t n = op->type.bytes();
      for (const Halide::Expr& e : op->extents) {
        const auto c = Halide::Internal::as_const_int(Halide::Internal::simplify(e));
        if (!c) a.unsized.push_back(op->name);
        n *= c ? *c : 0;
      }
      if (op->new_expr.defined()) a.unsized.push_back(op->name);  // a device allocation sized at run time
      if (op->memory_type != Halide::MemoryType::Stack) a.memory += n;  // (not the host's bookkeeping)
      IRVisitor::visit(op);
    }
  } walk;
  // Kernels are offloaded by now: the walk sees the host's code, their code is text.
  for (const auto& f : ls.pipeline.compile_to_module(ls.args, "attention_stage", t).functions()) f.body.accept(&walk);
  const std::string text = lowered_stmt(ls, t);
  const std::regex arrays(R"((float|int|uint|double) _\w+\[(\d+)\];|\.local \.align \d+ \.b8\s+\w+\[(\d+)\];)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), arrays); it != std::sregex_iterator(); ++it) {
    const auto& m = *it;
    if (m[3].matched) walk.a.per_thread += std::stoll(m[3]);
    else walk.a.per_thread += std::stoll(m[2]) * (m[1] == "double" ? 8 : 4);
  }
  return walk.a;
}

// The GPU schedule's attention keeps O(S) memory: doubling the length at
// most doubles what any stage allocates, and a kernel's per-thread storage
// does not grow at all (no [keys x queries] scores anywhere; the old
// schedule held three [S, S, heads] of them). Checked for CUDA, the target
// that matters, and OpenCL, the one these tests run.
TEST(Kernels, GpuAttentionMemoryIsLinearInTheLength) {
  for (const char* target : {"host-cuda-cuda_capability_80", "host-opencl-cl_doubles"}) {
    const Halide::Target t(target);
    std::map<std::string, Allocated> at[2];
    for (int x = 0; x < 2; ++x) {
      Graph g;
      const Partition p = attention_partition(g, {x ? 4096 : 2048, false, "halide", 64, 1});
      for (const Stage& st : p.stages) {
        const std::string kind = op_name(g.node(st.root).op);
        if (kind.rfind("attention", 0) != 0) continue;
        try {
          at[x][kind] = allocations_of(g, st, t);
        } catch (const Halide::Error& e) {
          FAIL() << kind << " for " << target << ": Halide: " << e.what();
        }
      }
    }
    ASSERT_EQ(at[0].size(), 3u) << "the forward with its log-sum-exp, dQ, dK with dV";
    for (const auto& [kind, a] : at[0]) {
      const Allocated& b = at[1].at(kind);
      EXPECT_TRUE(a.unsized.empty() && b.unsized.empty())
          << kind << ": a buffer of no fixed size: " << ::testing::PrintToString(a.unsized);
      std::printf("  %-30s %-18s seq 2048: %9lld bytes, %4lld per thread; seq 4096: %9lld bytes, %4lld per thread\n",
                  target, kind.c_str(), static_cast<long long>(a.memory), static_cast<long long>(a.per_thread),
                  static_cast<long long>(b.memory), static_cast<long long>(b.per_thread));
      EXPECT_LE(b.memory, 2 * a.memory) << kind;
      EXPECT_EQ(b.per_thread, a.per_thread) << kind;
      EXPECT_GT(a.per_thread, 0) << kind << ": no kernel's arrays found (has Halide's statement text changed?)";
      EXPECT_LT(b.memory, int64_t{4096} * 4096) << kind << ": as much as one head's scores";
    }
  }
}

// A plan on a GPU cluster counts the kernels a GPU library runs (the CUDA
// attention kernels, contractions through cuBLAS; no CPU library kernel),
// and for each kernel what the lowering allocates on the device: for the
// library's attention, copies of operands computed inline; for Halide's
// (generators/schedule_gpu.cpp, which a schedule may still ask for), the
// tiny Llama's q and k after RoPE computed once, k (and v) transposed, the
// row statistics; elsewhere per-token values (a norm's scale, the loss's
// log-sum-exp), RoPE's tables and the partial sums of long sums. Before,
// such a plan counted the CPU library's stages and scratch. In mixed
// precision (bf16_mixed: saved values and contraction operands in bf16)
// the GEMMs and the attention kernels read the bf16 copies in place, and
// the plan counts no copy of them (it counted f32 copies of both GEMM
// operands, 2 GiB a loss tile for Llama-3.2-1B at 32,768 tokens).
TEST(Kernels, GpuPlanCountsWhatTheGpuLoweringAllocates) {
  Schedule halide = Schedule::named("default");
  halide.attention_kernel = "halide";
  // (and with RoPE computed inside attention's stages, which copy q and k in bf16)
  Schedule rope_inline = Schedule::named(HALYARD_SOURCE_DIR "/examples/llama/schedules/bf16_mixed.json");
  rope_inline.values.insert(rope_inline.values.begin(), {"op:rope", "", "inline", ""});
  for (const Schedule& s : {Schedule::named("default"), halide,
                            Schedule::named(HALYARD_SOURCE_DIR "/examples/llama/schedules/bf16_mixed.json"),
                            rope_inline}) {
    const Plan p = plan(llama::llama_builder(), {HALYARD_SOURCE_DIR "/examples/llama/configs/tiny.json", 1, 1024}, s,
                        Cluster::named("8xH200"));
    EXPECT_EQ(p.schedule.attention_kernel, s.attention_kernel);
    EXPECT_EQ(p.schedule.contract_kernel, "cublas");
    const Graph& g = *p.model.graph;
    const Halide::Target cuda("host-cuda-cuda_capability_80");
    std::vector<std::string> checked;
    std::set<int> kernels;
    for (const StageCost& c : p.stages) {
      const Stage& st = p.train.stages[static_cast<size_t>(c.stage)];
      const bool attention = c.kind.rfind("attention", 0) == 0;
      EXPECT_EQ(st.library, attention && s.attention_kernel == "library") << c.label;
      // every kernel once with the library's attention, Halide's attention kernels with the other
      if (s.attention_kernel == "library" ? st.kernel < 0 || !kernels.insert(st.kernel).second
                                          : !attention || c.layer != "model.layers.0")
        continue;
      const Allocated a = allocations_of(g, st, cuda);
      std::printf("  %-7s %-44s lowered for CUDA: %9lld bytes; plan: %9lld\n", s.attention_kernel.c_str(),
                  c.label.c_str(), static_cast<long long>(a.memory), static_cast<long long>(c.scratch_estimate));
      EXPECT_EQ(a.memory, c.scratch_estimate) << c.label;
      EXPECT_TRUE(a.unsized.empty()) << c.label;
      checked.push_back(op_name(g.node(st.root).op));
    }
    if (s.attention_kernel == "library") {
      // (bf16_mixed computes RoPE inside its readers, and stores copies)
      const bool mixed = s.contract_precision == "bf16";
      for (const char* kind : {"attention", "attention_grad_k", "rms_norm_grad_w", mixed ? "store_bf16" : "rope",
                               "cross_entropy", "token_count"})
        EXPECT_NE(std::find(checked.begin(), checked.end(), kind), checked.end()) << kind << " in " << s.name;
    } else
      EXPECT_EQ(checked.size(), 3u) << "the forward with its log-sum-exp, dQ, dK with dV";
  }
}

// Long sums into few elements on the GPU schedule (schedules/partition.h,
// gpu_sum_split): a norm's and a bias's weight gradients, the token count
// and the loss, over 2 x 1000 tokens (16 chunks of 63 along the sequence),
// run by PoCL against the interpreter. Each is split (Halide's rfactor
// names the partial sums "_intm"); the plan counts them
// (GpuPlanCountsWhatTheGpuLoweringAllocates).
TEST(Kernels, GpuLongSumsSplitIntoChunksOfTokens) {
  Graph g;
  const std::vector<Axis> tokens = {{"batch", 2}, {"seq", 1000}};
  auto with = [&](const Axis& a) {
    std::vector<Axis> axes = tokens;
    axes.push_back(a);
    return axes;
  };
  Value x = input(g, "x", DType::f32, with({"model", 24})), dy = input(g, "dy", DType::f32, with({"model", 24}));
  Value logits = input(g, "logits", DType::f32, with({"vocab", 40}));
  Value labels = input(g, "labels", DType::i32, tokens);
  const std::vector<Value> sums = {rms_norm_grad_w(x, dy, "model", 1e-5), bias_add_grad(dy, {"model"}),
                                   cross_entropy(logits, labels, -100)};
  std::vector<int> outs;
  for (const Value& v : sums) outs.push_back(v.id);
  const Partition p = partition(g, outs, Schedule{});
  Interpreter<double> ref(g);
  std::map<int, Halide::Buffer<>> bufs;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const Value& in : {x, dy, logits, labels}) {
    Halide::Buffer<> b = buffer_of(in.type());
    if (in.type().dtype == DType::i32) {
      std::vector<int32_t> values;
      for (int64_t e = 0; e < in.type().numel(); ++e)
        values.push_back(static_cast<Halide::Buffer<int32_t>>(b).data()[e] = e % 7 == 3 ? -100 : static_cast<int32_t>(e % 40));
      ref.set_int(in.node().name, values);
    } else {
      std::vector<double> values;
      for (int64_t e = 0; e < in.type().numel(); ++e) values.push_back(static_cast<Halide::Buffer<float>>(b).data()[e] = normal(rng));
      ref.set(in.node().name, values);
    }
    b.set_host_dirty();
    bufs.emplace(in.id, b);
  }
  ref.run();
  const Halide::Target opencl("host-opencl-cl_doubles");
  std::vector<std::string> split;
  for (const Stage& st : p.stages) {
    const Node& root = g.node(st.root);
    LoweredStage ls = lower_stage(g, st, false, {}, 0, Halide::DeviceAPI::Host, true);
    schedule_gpu(ls, g, st, opencl);
    const bool has_chunks = lowered_stmt(ls, opencl).find("_intm") != std::string::npos;
    EXPECT_EQ(has_chunks, gpu_sum_split(g, root).chunks > 0) << op_name(root.op);
    if (has_chunks) split.push_back(op_name(root.op));
    for (size_t i = 0; i < st.inputs.size(); ++i) ls.inputs[i].set(bufs.at(st.inputs[i]));
    std::vector<int> written = {st.root};
    written.insert(written.end(), st.extra_outputs.begin(), st.extra_outputs.end());
    std::vector<Halide::Buffer<>> results;
    for (int id : written) results.push_back(bufs.emplace(id, buffer_of(g.node(id).type)).first->second);
    try {
      ls.pipeline.compile_jit(opencl);
      ls.pipeline.realize(Halide::Realization(results), opencl);
    } catch (const Halide::Error& e) {
      FAIL() << op_name(root.op) << ": Halide: " << e.what();
    }
    for (size_t k = 0; k < written.size(); ++k) {
      results[k].copy_to_host();
      const std::vector<double>& want = ref.value(written[k]);
      const float* got = static_cast<Halide::Buffer<float>>(results[k]).data();
      double diff = 0, scale = 1e-300;
      for (size_t e = 0; e < want.size(); ++e) {
        diff = std::max(diff, std::abs(static_cast<double>(got[e]) - want[e]));
        scale = std::max(scale, std::abs(want[e]));
      }
      std::printf("  %-16s %zu values: max |diff| / max |ref| = %.2e\n", op_name(g.node(written[k]).op), want.size(),
                  diff / scale);
      EXPECT_LE(diff / scale, 1e-5) << op_name(g.node(written[k]).op);
    }
  }
  EXPECT_THAT(split, ::testing::UnorderedElementsAre("rms_norm_grad_w", "bias_add_grad", "token_count", "cross_entropy"));
  // The tiny Llama's norms at 256 tokens split too: test_cuda's device steps
  // (against the CPU library) run such kernels on a GPU.
  EXPECT_EQ(gpu_sum_split(256, 256).chunks, 4);

}

// The library kernels (runtime/attention_cpu.h) on lengths that are not
// multiples of their blocks (128 or 256 queries, 128 keys), several rows, and
// head_dims that are not a whole number of vectors (padded copies).
TEST(Kernels, LibraryAttentionMatchesTheInterpreterAtEveryLength) {
  run_attention_cases({{37, false, "library"}, {300, false, "library"}, {520, false, "library"},
                       {100, true, "library"}, {300, true, "library"}, {130, false, "library", 20, 2},
                       {200, true, "library", 24, 1}, {64, false, "library", 32, 1}});
}

// A log-sum-exp recomputed alone (a checkpointing schedule's backward):
// the library's stage (the forward without P V) and Halide's, against the
// interpreter; and the library's gives the bits its forward writes beside
// the output, every head or some, packed documents, bf16, in every ISA, so
// that a backward reads the same statistics whether the schedule saved
// them or recomputed them. Before, the library had no such entry point and
// the stage was Halide's, as slow as the library's whole forward (940 ms
// against 900 ms a layer at 16,384 tokens, AMD EPYC Zen 4, 2 threads).
TEST(Kernels, LibraryLogSumExpAloneIsTheForwardsBits) {
  for (const AttentionCase& c : {AttentionCase{300, false, "library"}, AttentionCase{200, true, "library", 24, 2},
                                 AttentionCase{300, false, "library", 16, 1, true}, AttentionCase{130, true, "halide"}}) {
    AttentionCase alone = c;
    alone.lse_alone = true;
    Graph g;
    std::unique_ptr<Graph> rounded;
    const Partition p = attention_partition(g, alone, &rounded);
    ASSERT_EQ(p.stages.size(), 1u);
    EXPECT_EQ(p.stages[0].library, c.kernel == "library");
    run_attention_cases({alone});
  }
  using Halide::Runtime::Buffer;
  in_every_isa([] {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (const int bf16 : {0, 1})
      for (const int D : {16, 24}) {
        const int S = 300, H = 4, KV = 2, B = 2;
        Buffer<float> q(D, H, S, B), k(D, KV, S, B), v(D, KV, S, B), o(D, H, S, B), lse(H, S, B), alone(H, S, B),
            some(2, S, B);
        for (Buffer<float>* x : {&q, &k, &v}) x->for_each_value([&](float& e) { e = normal(rng); });
        Buffer<int32_t> pos(S, B);
        for (int i = 0; i < S; ++i) pos(i, 0) = i, pos(i, 1) = i % 77;
        some.set_min({1, 0, 0});
        ASSERT_EQ(halyard_attention_forward_lse(q, k, v, pos, lse, H, KV, D, 0, 0, bf16, o), 0);
        ASSERT_EQ(halyard_attention_lse(q, k, pos, H, KV, D, 0, 0, bf16, alone), 0);
        ASSERT_EQ(halyard_attention_lse(q, k, pos, H, KV, D, 0, 0, bf16, some), 0);
        EXPECT_EQ(std::memcmp(lse.data(), alone.data(), lse.size_in_bytes()), 0)
            << runtime::attention_cpu::isa() << ", head_dim " << D << (bf16 ? ", bf16" : "");
        some.for_each_element([&](int h, int i, int b) {
          EXPECT_EQ(some(h, i, b), lse(h, i, b)) << "head " << h << " row " << i << " batch row " << b;
        });
      }
  });
}

// Saved values stored in bf16 (q, k, v and the output): the library reads
// the copies in place, Halide's kernels decode them inline; both against
// the interpreter of the same graph, in f32 and in mixed precision.
TEST(Kernels, AttentionOnValuesStoredInBf16MatchesTheInterpreter) {
  std::vector<AttentionCase> cases = {{300, false, "library"}, {200, true, "library", 24, 2},
                                      {300, true, "library", 16, 1, true}, {130, true, "halide"},
                                      {100, false, "halide", 16, 1, true}};
  for (AttentionCase& c : cases) c.stored = true;
  run_attention_cases(cases);
}

// Mixed precision (Attrs::bf16): the library's kernels and Halide's round
// what the interpreter rounds (q, k, v, dO, the probabilities before their
// products, dS), packed rows and padded head_dims included.
TEST(Kernels, AttentionInBf16MatchesTheInterpretersBf16) {
  run_attention_cases({{300, false, "library", 16, 1, true}, {200, true, "library", 24, 2, true},
                       {100, true, "halide", 16, 1, true}});
}

// RoPE of q and k computed inside attention's stages (the rule op:rope
// compute inline, which AutoSP's plans carry): the library's stages copy
// them once per call, in f32, or in bf16 where the products read bf16
// (schedules/partition.h: attention_copies_bf16), which the kernels round
// them to anyway: half the bytes, for the CPU library and the CUDA kernels
// alike; against the interpreter, stored in bf16 or not. (The CUDA plan
// counts the same: GpuPlanCountsWhatTheGpuLoweringAllocates.)
TEST(Kernels, LibraryAttentionCopiesRopeOperandsInItsProductsPrecision) {
  for (const bool bf16 : {false, true})
    for (const bool stored : {false, true}) {
      AttentionCase c{300, /*packed=*/stored, "library", 16, 1, bf16};
      c.rope = true, c.stored = stored;
      run_attention_cases({c});
      Graph g0;
      std::unique_ptr<Graph> rebuilt;
      const Partition p = attention_partition(g0, c, &rebuilt);
      const Graph& g = rebuilt ? *rebuilt : g0;
      // q's and k's copies, [16, 4 + 2, 300] elements, and RoPE's tables
      // for each, cos and sin at [300, 16 / 2]
      const int64_t copies = 16 * (4 + 2) * 300 * (bf16 ? 2 : 4) + 2 * 2 * 300 * 8 * 4;
      int stages = 0;
      for (const Stage& st : p.stages) {
        if (!st.library || std::string(op_name(g.node(st.root).op)).rfind("attention", 0) != 0) continue;
        ++stages;
        for (const bool cuda : {false, true}) {
          const Allocated a = cuda ? allocations_of(g, st, Halide::Target("host-cuda-cuda_capability_80"),
                                                    Halide::DeviceAPI::CUDA)
                                   : allocations_of(g, st, Halide::get_host_target());
          EXPECT_TRUE(a.memory == copies && a.unsized.empty())
              << describe(g, st.root) << (cuda ? " on CUDA" : "") << (bf16 ? ", bf16" : "")
              << (stored ? ", stored in bf16" : "") << ": " << a.memory << " bytes and " << a.unsized.size()
              << " buffers sized at run time";
        }
      }
      EXPECT_EQ(stages, 2) << "the forward and the backward";
    }
}

// On a CUDA target the library's attention is an extern stage on the device
// (runtime/attention_cuda.h); a head_dim over its kernels' is an error when
// the library is built, naming the fix, not a failure inside a step.
TEST(Kernels, CudaLibraryAttentionIsADeviceCallAndRefusesAWideHead) {
  for (int64_t d : {64, 256}) {
    Graph g;
    const Partition p = attention_partition(g, {128, false, "library", d, 1});
    for (const Stage& st : p.stages) {
      if (!st.library) continue;
      if (d == 64) {
        const LoweredStage ls = lower_stage(g, st, false, {}, 0, Halide::DeviceAPI::CUDA, true);
        EXPECT_EQ(ls.funcs.out.extern_function_name().rfind("_cuda"), ls.funcs.out.extern_function_name().size() - 5)
            << ls.funcs.out.extern_function_name();
        continue;
      }
      try {
        lower_stage(g, st, false, {}, 0, Halide::DeviceAPI::CUDA, true);
        ADD_FAILURE() << "head_dim 256 lowered for the CUDA kernels";
      } catch (const UserError& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("head_dim 256, over the 128"), std::string::npos) << what;
        EXPECT_NE(what.find("\"attention_kernel\": \"halide\""), std::string::npos) << what;
      }
    }
  }
}

// The library kernels write the stage's outputs themselves (the forward its
// output and log-sum-exp, the log-sum-exp alone, the backward dK, and dV and dQ through their
// buffers), so a stage whose operands are buffers allocates nothing: a
// copy of [head_dim + 1, seq, heads] and one of [head_dim, seq, group + 2,
// kv_heads] floats before. The weight-gradient GEMM likewise.
// Where q, k, v and O are saved in bf16, the stages read their copies in
// place, the CPU library's and the CUDA kernels': before, each call decoded
// them into f32 copies first (at 4,096 tokens, 8 MiB in the forward and 12
// MiB in the backward here).
TEST(Kernels, LibraryStagesWriteTheirOutputsInPlace) {
  for (const bool stored : {false, true}) {
    AttentionCase c{4096, false, "library", 64, 1};
    c.stored = stored;
    Graph g0;
    std::unique_ptr<Graph> rebuilt;
    const Partition p = attention_partition(g0, c, &rebuilt);
    ASSERT_EQ(rebuilt != nullptr, stored) << "the saved values have bf16 copies";
    const Graph& g = stored ? *rebuilt : g0;
    std::vector<std::string> library;
    for (const Stage& st : p.stages) {
      if (!st.library || st.gemm) continue;
      const std::string kind = op_name(g.node(st.root).op);
      if (kind.rfind("attention", 0) != 0) continue;
      library.push_back(kind);
      int copies = 0;
      for (int in : st.inputs) copies += g.node(in).op == Op::StoreBf16;
      EXPECT_EQ(copies, stored ? (kind == "attention" ? 3 : 4) : 0) << kind << ": q, k, v (and O) read as bf16 copies";
      // (on a CUDA target, the CUDA kernels' entry points)
      for (const bool cuda : {false, true}) {
        const Allocated a = cuda ? allocations_of(g, st, Halide::Target("host-cuda-cuda_capability_80"), Halide::DeviceAPI::CUDA)
                                 : allocations_of(g, st, Halide::get_host_target());
        EXPECT_TRUE(a.memory == 0 && a.unsized.empty())
            << kind << (stored ? " reading bf16 copies" : "") << (cuda ? " on CUDA" : "") << " allocates " << a.memory
            << " bytes and " << a.unsized.size() << " buffers sized at run time";
      }
    }
    EXPECT_EQ(library, (std::vector<std::string>{"attention", "attention_grad_k"}));
  }
  Graph lg;
  const Partition lp = attention_partition(lg, {4096, false, "library", 64, 1, false, true});
  ASSERT_TRUE(lp.stages.size() == 1 && lp.stages[0].library);
  const Allocated la = allocations_of(lg, lp.stages[0], Halide::get_host_target());
  EXPECT_TRUE(la.memory == 0 && la.unsized.empty()) << "the log-sum-exp alone allocates " << la.memory << " bytes";

  Graph wg;
  const Axis S{"seq", 1000}, M{"model", 64}, F{"ffn", 96};
  Value x = input(wg, "x", DType::f32, {S, M});
  Value dy = input(wg, "dy", DType::f32, {S, F});
  Value dw = contract_to(dy, x, {"ffn", "model"});
  Schedule sched;
  const Partition wp = partition(wg, {dw.id}, sched);
  ASSERT_EQ(wp.stages.size(), 1u);
  ASSERT_TRUE(wp.stages[0].library) << "a sum over the tokens goes to the library GEMM";
  const Allocated a = allocations_of(wg, wp.stages[0], Halide::get_host_target());
  EXPECT_TRUE(a.memory == 0 && a.unsized.empty()) << "the weight gradient allocates " << a.memory << " bytes and "
                                                  << a.unsized.size() << " buffers sized at run time";
}

// Ring attention's key blocks through the library (the _ring entry points,
// which take the tokens' indices): the rank's own block, a block every query
// sees whole, one no query sees (output 0, log-sum-exp -1e30, no gradient),
// and zigzag blocks half seen; packed documents, bf16, a padded head_dim,
// lengths that are not whole blocks, the log-sum-exp alone. Halide's ring
// kernels on two of them, the same check. Before, every ring block was
// Halide's (0.84x SDPA where the library's is 1.64x; bench/attention_bench).
TEST(Kernels, LibraryRingBlocksMatchTheInterpreter) {
  auto ring = [](AttentionCase c, int rank, int from, bool zigzag) {
    c.ring_rank = rank, c.ring_from = from, c.zigzag = zigzag;
    return c;
  };
  const AttentionCase plain{300, false, "library"}, packed{200, true, "library", 24, 2},
      bf16{300, false, "library", 16, 1, true}, lse{300, false, "library", 16, 1, false, true},
      packed_lse{300, true, "library", 16, 1, false, true};
  // (packed, rank 1 with rank 0's keys: a document crossing the ranks'
  // boundary, the first 26 queries seeing the last 26 keys)
  for (const AttentionCase& c :
       {ring(plain, 1, 1, false), ring(plain, 2, 1, false), ring(plain, 1, 3, false), ring(plain, 1, 2, true),
        ring(plain, 2, 1, true), ring(plain, 0, 0, true), ring(packed, 1, 0, false), ring(packed, 1, 2, true),
        ring(packed, 2, 2, true), ring(bf16, 1, 2, true), ring(bf16, 3, 1, false), ring(packed_lse, 1, 2, true),
        ring(lse, 2, 0, false), ring(AttentionCase{130, true, "halide"}, 1, 2, true),
        ring(AttentionCase{100, false, "halide"}, 2, 1, false)}) {
    Graph g;
    std::unique_ptr<Graph> rounded;
    const Partition p = attention_partition(g, c, &rounded);
    for (const Stage& st : p.stages) {
      const Graph& pg = rounded ? *rounded : g;
      if (is_ring_block(pg.node(st.root))) {
        EXPECT_EQ(st.library, c.kernel == "library") << ring_name(c);
      }
    }
    run_attention_cases({c});
  }
  // With each token's seq index as its index (rank 0's own block), the ring
  // entry points compute what the plain ones do, to the bit: the same blocks
  // in the same order, packed documents and bf16 included.
  using Halide::Runtime::Buffer;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const int bf16 : {0, 1}) {
    const int S = 300, H = 4, KV = 2, B = 2, D = 24;
    Buffer<float> q(D, H, S, B), k(D, KV, S, B), v(D, KV, S, B), dO(D, H, S, B);
    for (Buffer<float>* x : {&q, &k, &v, &dO}) x->for_each_value([&](float& e) { e = normal(rng); });
    Buffer<int32_t> pos(S, B), idx(S, B);
    for (int i = 0; i < S; ++i) pos(i, 0) = i, pos(i, 1) = i % 77, idx(i, 0) = idx(i, 1) = i;
    Buffer<float> o[2] = {Buffer<float>(D, H, S, B), Buffer<float>(D, H, S, B)},
                  lse[2] = {Buffer<float>(H, S, B), Buffer<float>(H, S, B)},
                  alone[2] = {Buffer<float>(H, S, B), Buffer<float>(H, S, B)},
                  dk[2] = {Buffer<float>(D, KV, S, B), Buffer<float>(D, KV, S, B)},
                  dv[2] = {Buffer<float>(D, KV, S, B), Buffer<float>(D, KV, S, B)},
                  dq[2] = {Buffer<float>(D, H, S, B), Buffer<float>(D, H, S, B)};
    ASSERT_EQ(halyard_attention_forward_lse(q, k, v, pos, lse[0], H, KV, D, 0, 0, bf16, o[0]), 0);
    ASSERT_EQ(halyard_attention_forward_lse_ring(q, k, v, pos, idx, idx, lse[1], H, KV, D, 0, 0, bf16, o[1]), 0);
    ASSERT_EQ(halyard_attention_lse(q, k, pos, H, KV, D, 0, 0, bf16, alone[0]), 0);
    ASSERT_EQ(halyard_attention_lse_ring(q, k, pos, idx, idx, H, KV, D, 0, 0, bf16, alone[1]), 0);
    ASSERT_EQ(halyard_attention_backward(q, k, v, pos, o[0], dO, lse[0], dv[0], dq[0], H, KV, 0, 0, bf16, dk[0]), 0);
    ASSERT_EQ(halyard_attention_backward_ring(q, k, v, pos, o[0], dO, lse[0], idx, idx, dv[1], dq[1], H, KV, 0, 0, bf16,
                                              dk[1]), 0);
    for (auto* x : {&o, &lse, &alone, &dk, &dv, &dq})
      EXPECT_EQ(std::memcmp((*x)[0].data(), (*x)[1].data(), (*x)[0].size_in_bytes()), 0)
          << (x == &o ? "output" : x == &lse ? "log-sum-exp" : x == &alone ? "log-sum-exp alone" : x == &dk ? "dK" : x == &dv ? "dV" : "dQ")
          << (bf16 ? ", bf16" : "");
  }
}

// A ring block's backward that adds its dQ part to the running sum of the
// blocks before (halyard_attention_backward_ring_add: what a ring's
// library backward does after its first block, schedules/partition.h:
// Stage::dq_sum_in) writes the sum plus the part that the plain entry
// point writes, to the bit (the Add it replaces), over the sum itself or
// into another buffer; dK and dV are the plain entry point's. In every
// ISA, f32 and bf16, a head_dim of whole vectors (dK and dV accumulated in
// place) and a padded one.
TEST(Kernels, RingBackwardAddsItsDqPartToTheRunningSum) {
  using Halide::Runtime::Buffer;
  in_every_isa([] {
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (const int bf16 : {0, 1})
      for (const int D : {16, 24}) {
        const int S = 300, H = 4, KV = 2, B = 2;
        testing::RingBlock r = testing::ring_block(S, 4, 2, 1, true);
        Buffer<float> q(D, H, S, B), k(D, KV, S, B), v(D, KV, S, B), dO(D, H, S, B), o(D, H, S, B), lse(H, S, B);
        for (Buffer<float>* x : {&q, &k, &v, &dO}) x->for_each_value([&](float& e) { e = normal(rng); });
        Buffer<int32_t> pos(S, B);
        for (int i = 0; i < S; ++i) pos(i, 0) = i, pos(i, 1) = i % 77;
        ASSERT_EQ(halyard_attention_forward_lse_ring(q, k, v, pos, r.kidx, r.qidx, lse, H, KV, D, 0, 0, bf16, o), 0);
        Buffer<float> dk(D, KV, S, B), dv(D, KV, S, B), part(D, H, S, B), sum(D, H, S, B);
        ASSERT_EQ(halyard_attention_backward_ring(q, k, v, pos, o, dO, lse, r.kidx, r.qidx, dv, part, H, KV, 0, 0, bf16, dk),
                  0);
        sum.for_each_value([&](float& e) { e = normal(rng); });
        Buffer<float> expect(D, H, S, B);
        expect.for_each_element([&](const int* at) { expect(at) = sum(at) + part(at); });
        const std::string what = std::string(runtime::attention_cpu::isa()) + (bf16 ? ", bf16" : ", f32") + ", head_dim " +
                                 std::to_string(D);
        for (const bool in_place : {false, true}) {
          Buffer<float> dk2(D, KV, S, B), dv2(D, KV, S, B), out(D, H, S, B), running = sum.copy();
          Buffer<float>& written = in_place ? running : out;
          ASSERT_EQ(halyard_attention_backward_ring_add(q, k, v, pos, o, dO, lse, r.kidx, r.qidx, running, dv2, written, H,
                                                        KV, 0, 0, bf16, dk2),
                    0);
          EXPECT_EQ(std::memcmp(written.data(), expect.data(), expect.size_in_bytes()), 0) << what << ", dQ";
          EXPECT_EQ(std::memcmp(dk2.data(), dk.data(), dk.size_in_bytes()), 0) << what << ", dK";
          EXPECT_EQ(std::memcmp(dv2.data(), dv.data(), dv.size_in_bytes()), 0) << what << ", dV";
        }
      }
  });
}

// The library's operands as bf16 (uint16 buffers: the copies of values a
// schedule stores in bf16, read in place) give the bits that f32 operands
// holding the same values give (tests/attention_against_cpu.h): the
// forward, the log-sum-exp alone and the backward (O and dO in bf16 too),
// plain and a ring block's, in f32 and in mixed precision, packed documents
// and a padded head_dim, in every ISA. An operand of another type is
// refused, by name.
TEST(Kernels, LibraryAttentionReadsBf16OperandsAsTheValuesTheyHold) {
  using Halide::Runtime::Buffer;
  in_every_isa([] {
    for (const int bf16 : {0, 1})
      for (const int D : {16, 24}) {
        const int H = 4, KV = 2;
        testing::RingBlock ring = testing::ring_block(300, 4, 1, 2, true);
        for (testing::RingBlock* r : {static_cast<testing::RingBlock*>(nullptr), &ring})
          for (const bool rounding : {false, true}) {
            if (rounding && !bf16) continue;  // (f32 products take operands as they are)
            testing::expect_bf16_operands_give_f32_bits(
                D, H, KV, 300, 77,
                [&](halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, Buffer<int32_t>& pos,
                    Buffer<float>& lse, Buffer<float>& o) {
                  ASSERT_EQ(r ? halyard_attention_forward_lse_ring(q, k, v, pos, r->kidx, r->qidx, lse, H, KV, D, 0, 0,
                                                                   bf16, o)
                              : halyard_attention_forward_lse(q, k, v, pos, lse, H, KV, D, 0, 0, bf16, o),
                            0);
                },
                [&](halide_buffer_t* q, halide_buffer_t* k, Buffer<int32_t>& pos, Buffer<float>& lse) {
                  ASSERT_EQ(r ? halyard_attention_lse_ring(q, k, pos, r->kidx, r->qidx, H, KV, D, 0, 0, bf16, lse)
                              : halyard_attention_lse(q, k, pos, H, KV, D, 0, 0, bf16, lse),
                            0);
                },
                [&](halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, Buffer<int32_t>& pos,
                    halide_buffer_t* o, halide_buffer_t* dO, Buffer<float>& lse, Buffer<float>& dv, Buffer<float>& dq,
                    Buffer<float>& dk) {
                  ASSERT_EQ(r ? halyard_attention_backward_ring(q, k, v, pos, o, dO, lse, r->kidx, r->qidx, dv, dq, H,
                                                                KV, 0, 0, bf16, dk)
                              : halyard_attention_backward(q, k, v, pos, o, dO, lse, dv, dq, H, KV, 0, 0, bf16, dk),
                            0);
                },
                std::string(runtime::attention_cpu::isa()) + (bf16 ? ", bf16" : ", f32"), r, true, rounding);
          }
      }
  });
  Halide::Runtime::Buffer<float> q(16, 2, 8, 1), k(16, 1, 8, 1), v(16, 1, 8, 1), o(16, 2, 8, 1);
  Halide::Runtime::Buffer<int32_t> pos(8, 1), wrong(16, 1, 8, 1);
  ::testing::internal::CaptureStderr();
  const int rc = halyard_attention_forward(q, wrong, v, pos, 2, 1, 16, 0, 0, 0, o);
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(rc, 0);
  EXPECT_THAT(said, ::testing::HasSubstr("q, k, v, O and dO must be f32, or bf16 as its 16 bits (uint16)"));
}

// A ring block's kernels are the library's (Schedule::attention_kernel) on
// a CPU cluster and on a CUDA one, whose stages lower to the CUDA entry
// points that take the token indices (runtime/attention_cuda.h:
// halyard_attention_*_ring_cuda); the "halide" choice keeps Halide's.
TEST(Kernels, RingBlocksAreTheLibrarysOnCpusAndOnCuda) {
  Schedule s = Schedule::named("ring_zigzag");
  s.mesh.sp = 4;
  for (const char* kernel : {"library", "halide"})
    for (const char* cluster : {"local-cpu", "8xH200"}) {
      s.attention_kernel = kernel;
      const Plan p = plan(llama::llama_builder(), {HALYARD_SOURCE_DIR "/examples/llama/configs/tiny.json", 1, 1024}, s,
                          Cluster::named(cluster));
      const bool cuda = std::string(cluster) != "local-cpu", library = std::string(kernel) == "library";
      const Graph& g = *p.model.graph;
      int ring = 0;
      std::set<std::string> called;
      for (const Stage& st : p.train.stages) {
        if (!is_ring_block(g.node(st.root))) continue;
        ++ring;
        EXPECT_EQ(st.library, library) << cluster << ": " << describe(g, st.root);
        if (cuda && library) {
          LoweredStage ls = lower_stage(g, st, false, {}, 0, Halide::DeviceAPI::CUDA, true);
          called.insert(ls.funcs.out.extern_function_name());
        }
      }
      EXPECT_GE(ring, 3) << cluster;
      if (cuda && library) {
        EXPECT_EQ(called, (std::set<std::string>{"halyard_attention_forward_lse_ring_cuda",
                                                 "halyard_attention_backward_ring_cuda",
                                                 "halyard_attention_backward_ring_add_cuda"}))
            << ::testing::PrintToString(called);
      }
    }
}

// Blocks a schedule may ask for (kernel_tiles) where the key block does not
// divide the query block: 256 queries and 96 keys over 512 tokens. The
// packed keys were padded to whole query blocks (512), and the last key
// block (480 to 575) was read past them (ASan: the sanitizer run has this
// test). The results agree with the default blocks' to rounding.
TEST(Kernels, LibraryAttentionTakesKeyBlocksThatDoNotDivideTheQueryBlock) {
  using Halide::Runtime::Buffer;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int S = 512, H = 4, KV = 2, D = 16;
  Buffer<float> q(D, H, S, 1), k(D, KV, S, 1), v(D, KV, S, 1), dO(D, H, S, 1);
  for (Buffer<float>* x : {&q, &k, &v, &dO}) x->for_each_value([&](float& e) { e = normal(rng); });
  Buffer<int32_t> pos(S, 1);
  for (int i = 0; i < S; ++i) pos(i, 0) = i;
  std::vector<Buffer<float>> got[2];
  for (int x = 0; x < 2; ++x) {
    const int qb = x ? 256 : 0, kb = x ? 96 : 0;
    Buffer<float> o(D, H, S, 1), lse(H, S, 1), dk(D, KV, S, 1), dv(D, KV, S, 1), dq(D, H, S, 1);
    ASSERT_EQ(halyard_attention_forward_lse(q, k, v, pos, lse, H, KV, D, qb, kb, 0, o), 0);
    ASSERT_EQ(halyard_attention_backward(q, k, v, pos, o, dO, lse, dv, dq, H, KV, qb, kb, 0, dk), 0);
    got[x] = {o, lse, dk, dv, dq};
  }
  for (size_t t = 0; t < got[0].size(); ++t) {
    double diff = 0, scale = 1e-30;
    for (int e = 0; e < static_cast<int>(got[0][t].number_of_elements()); ++e) {
      diff = std::max(diff, static_cast<double>(std::abs(got[0][t].data()[e] - got[1][t].data()[e])));
      scale = std::max(scale, static_cast<double>(std::abs(got[0][t].data()[e])));
    }
    EXPECT_LE(diff / scale, 1e-5) << (const char*[]){"output", "log-sum-exp", "dK", "dV", "dQ"}[t];
  }
}

TEST(Kernels, LibraryAttentionMatchesTheInterpreterInEveryIsa) {
  in_every_isa([] {
    AttentionCase zigzag{200, true, "library", 24, 2};
    zigzag.ring_rank = 1, zigzag.ring_from = 2, zigzag.zigzag = true;
    run_attention_cases({{300, false, "library"}, {200, true, "library", 24, 2}, zigzag});
  });
}

// The same bits on an AVX2 and an AVX-512 machine (sums in one order on
// every ISA; tests/fixtures/presets_golden.txt relies on it): the library
// kernels' avx2 and avx512 variants, and Halide's kernels compiled for an
// AVX2 target and for this host. 320 tokens sum rows in blocks of 16 keys,
// 200 in blocks of 8 (the block a row's lanes are summed in). The x86
// baseline variant has no FMA and rounds otherwise.
TEST(Kernels, AttentionGivesTheSameBitsOnAvx2AndAvx512) {
  const Halide::Target host = Halide::get_host_target();
  if (!host.has_feature(Halide::Target::AVX512) || !host.has_feature(Halide::Target::FMA))
    GTEST_SKIP() << "this CPU does not run AVX-512 (" << host.to_string() << ")";
  const Halide::Target avx2("x86-64-linux-avx-avx2-f16c-fma-sse41");
  for (AttentionCase c : {AttentionCase{320, false, "halide"}, AttentionCase{200, true, "halide", 24, 2}}) {
    uint64_t wide = 0, narrow = 0;
    attention_case(c, &host, &wide);
    attention_case(c, &avx2, &narrow);
    EXPECT_EQ(wide, narrow) << "Halide's kernels, seq " << c.seq << ": AVX-512 and AVX2 differ";
    c.kernel = "library";
    for (const char* isa : {"avx512", "avx2"}) {
      setenv("HALYARD_CPU_ISA", isa, 1);
      ASSERT_EQ(std::string(runtime::attention_cpu::isa()), isa);
      attention_case(c, nullptr, std::string(isa) == "avx512" ? &wide : &narrow);
    }
    unsetenv("HALYARD_CPU_ISA");
    EXPECT_EQ(wide, narrow) << "the library kernels, seq " << c.seq << ": avx512 and avx2 differ";
  }
}

}  // namespace
}  // namespace halyard
