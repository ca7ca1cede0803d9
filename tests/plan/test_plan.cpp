// The plan as data, without compiling a model: the op table drives the passes
// (an op added through the table alone is differentiated, interpreted and
// lowered), schedules round-trip and name their mistakes, and plan()'s
// counts equal the hand-counted formulas.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <set>

#include "dsl/autodiff.h"
#include "dsl/error.h"
#include "dsl/interpreter.h"
#include "dsl/op_table.h"
#include "dsl/ops.h"
#include "examples/llama/llama_builder.h"
#include "generators/lowering.h"
#include "schedules/plan.h"

namespace halyard {
namespace {

const std::string kMicro = HALYARD_SOURCE_DIR "/tests/fixtures/llama_micro.json";
const std::string kTiny = HALYARD_SOURCE_DIR "/examples/llama/configs/tiny.json";

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

TEST(OpTable, EveryBuiltinOpHasOneRow) {
  std::set<std::string> names;
  for (int i = 0; i <= static_cast<int>(Op::AllReduce); ++i) {
    const OpInfo& r = op_info(static_cast<Op>(i));
    EXPECT_FALSE(r.name.empty());
    EXPECT_TRUE(names.insert(r.name).second) << r.name;
    EXPECT_EQ(op_by_name(r.name), static_cast<Op>(i));
  }
  EXPECT_EQ(op_info(Op::Contract).cls, OpClass::Heavy);
  EXPECT_EQ(op_info(Op::RmsNorm).cls, OpClass::Cheap);
  EXPECT_TRUE(op_info(Op::SeqToHeads).collective);
  EXPECT_EQ(op_info(Op::ConcatSeq).cls, OpClass::Runtime);
  EXPECT_FALSE(op_info(Op::ConcatSeq).collective);
  EXPECT_THAT(error_of([] { op_by_name("gelu"); }), ::testing::HasSubstr("no op is named \"gelu\""));
}

// square(x) = x^2, added through the table alone (and its lowering).
Op square_op() {
  static const Op op = [] {
    OpInfo r;
    r.name = "square";
    r.cls = OpClass::Cheap;
    r.token_local = true;
    r.flops = [](const Graph&, const Node& n) { return static_cast<double>(n.type.numel()); };
    r.type = [](const Graph& g, const std::vector<int>& in, const Attrs&) {
      if (in.size() != 1) throw UserError("error: square takes 1 operand.");
      return g.node(in[0]).type;
    };
    r.vjp = [](Graph& g, const Node& n, Value dy, const std::vector<bool>&, const ForwardValue& fwd) {
      Value x = fwd(n.inputs[0]);
      return std::vector<Value>{dy * (x + x)};  // d(x^2) = 2x dx
    };
    r.pointwise = [](const std::vector<double>& a) { return a[0] * a[0]; };
    const Op op = register_op(r);
    register_pointwise_lowering(op, [](const std::vector<Halide::Expr>& a) { return a[0] * a[0]; });
    return op;
  }();
  return op;
}

TEST(OpTable, AnOpAddedThroughTheTableIsDifferentiatedInterpretedAndLowered) {
  const Op sq = square_op();
  Graph g;
  Value x = param(g, "x", DType::f64, {{"seq", 4}, {"model", 3}});
  Value y = g.add(sq, {x});
  Value ones = fill(g, y.type(), 1.0);
  Value loss = contract_to(y, ones, {});
  Gradients d = grad(loss, {x});
  verify(g);
  Interpreter<double> it(g);
  std::vector<double> xs = {1, -2, 3, 0.5, 4, -1, 2, 2, 0, -3, 1.5, 6};
  it.set("x", xs);
  it.run();
  double want = 0;
  for (double v : xs) want += v * v;
  EXPECT_DOUBLE_EQ(it.scalar(loss), want);
  for (size_t i = 0; i < xs.size(); ++i) EXPECT_DOUBLE_EQ(it.value(d[x])[i], 2 * xs[i]);
  EXPECT_EQ(op_flops(g, y.node()), 12.0);

  // Lowered: the stage computing x^2 + x (square inlined into the add).
  Graph h;
  Value hx = param(h, "x", DType::f32, {{"seq", 4}, {"model", 3}});
  Value hy = h.add(sq, {hx}) + hx;
  Partition p = partition(h, {hy.id}, Schedule::named("default"));
  ASSERT_EQ(p.stages.size(), 1u);
  LoweredStage ls = lower_stage(h, p.stages[0]);
  Halide::Buffer<float> in(3, 4);
  for (int s = 0; s < 4; ++s)
    for (int m = 0; m < 3; ++m) in(m, s) = static_cast<float>(xs[static_cast<size_t>(s * 3 + m)]);
  ls.inputs[0].set(in);
  Halide::Buffer<float> out = ls.pipeline.realize({3, 4});
  for (int s = 0; s < 4; ++s)
    for (int m = 0; m < 3; ++m) EXPECT_FLOAT_EQ(out(m, s), in(m, s) * in(m, s) + in(m, s));
  EXPECT_THAT(error_of([&] { register_op(op_info(sq)); }), ::testing::HasSubstr("an op of that name exists already"));
}

TEST(Schedule, PresetsAndFilesRoundTripThroughJson) {
  for (const std::string& n : Schedule::presets()) {
    const Schedule s = Schedule::named(n);
    EXPECT_EQ(Schedule::parse(s.to_json(), "round trip"), s) << n;
  }
  const Schedule f = Schedule::parse(R"({"name": "mine", "mesh": {"dp": 2, "sp": 4, "zero": 1},
      "split_sequence": "sp", "attention": [{"match": "model.layers.*.self_attn", "strategy": "ulysses"}],
      "values": [{"match": "op:rms_norm", "compute": "inline"}, {"match": "model.layers.1.mlp op:contract", "keep": "recompute"}],
      "seq_tile": 256, "loss_seq_tile": 128, "kernel_tiles": {"attention_keys": 32}, "attention_kernel": "halide",
      "weight_grad_kernel": "halide", "contract_kernel": "cublas", "contract_precision": "bf16",
      "grad_reduce_precision": "bf16"})", "mine.json");
  EXPECT_EQ(Schedule::parse(f.to_json(), "again"), f);
  EXPECT_EQ(f.mesh, (Mesh{2, 4, 1}));
  EXPECT_EQ(f.attention_kernel, "halide");
  EXPECT_EQ(f.weight_grad_kernel, "halide");
  EXPECT_EQ(f.contract_kernel, "cublas");
  EXPECT_EQ(f.contract_precision, "bf16");
  EXPECT_NE(f.str().find("contractions in bf16"), std::string::npos) << f.str();
  EXPECT_EQ(f.grad_reduce_precision, "bf16");
  EXPECT_NE(f.str().find("gradients summed from bf16"), std::string::npos) << f.str();
  // The first vocabulary still reads, as the same rules.
  const auto old = Schedule::parse(R"({"name": "checkpoint", "recompute": ["rms_norm", "rope", "silu", "mul"], "checkpoint": true})",
                                   "old.json").values;
  const auto now = Schedule::named("checkpoint").values;  // keep and compute rules set different fields: order apart
  EXPECT_TRUE(std::is_permutation(old.begin(), old.end(), now.begin(), now.end()));
}

TEST(Schedule, IllegalRulesNameTheValueTheRuleAndTheLegalChoices) {
  auto planned = [](const std::string& json) {
    return error_of([&] {
      plan(llama::llama_builder(), {kMicro, 1, 16}, Schedule::parse(json, "bad.json"), Cluster::named("local-cpu"));
    });
  };
  EXPECT_THAT(planned(R"({"values": [{"match": "op:contract", "compute": "inline"}]})"),
              ::testing::AllOf(::testing::HasSubstr("contract"), ::testing::HasSubstr("compute: inline"),
                               ::testing::HasSubstr("only cheap values can be computed inside their consumers"),
                               ::testing::HasSubstr("legal: compute \"root\", or keep \"recompute\"")));
  EXPECT_THAT(planned(R"({"values": [{"match": "model.layer.*.mlp", "keep": "recompute"}]})"),
              ::testing::AllOf(::testing::HasSubstr("matches no value of the model"),
                               ::testing::HasSubstr("model.layers.0.self_attn")));
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"values": [{"match": "op:conv", "keep": "save"}]})", "s"); }),
              ::testing::HasSubstr("names no op"));
  EXPECT_THAT(planned(R"({"values": [{"match": "*", "keep": "offload"}]})"),
              ::testing::AllOf(::testing::HasSubstr("cluster \"local-cpu\" has no host link"),
                               ::testing::HasSubstr("fix: keep \"save\" or \"recompute\" on CPU ranks")));
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"values": [{"match": "*", "keep": "host"}]})", "s"); }),
              ::testing::HasSubstr("legal: keep \"save\" | \"recompute\" | \"offload\""));
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"mesh": {"sp": 4}})", "s"); }),
              ::testing::HasSubstr("mesh sp=4 without split_sequence"));
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"mesh": {"tp": 2}})", "s"); }), ::testing::HasSubstr("legal: dp, sp, zero"));
  // Found by fuzzing (tests/fuzz/corpus/schedule): a ZeRO stage past int was
  // once truncated to 1, and a mesh whose rank count overflows was accepted.
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"mesh": {"zero": 4294967297}})", "s"); }),
              ::testing::HasSubstr("mesh.zero 4294967297"));
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"mesh": {"dp": 4611686018427387904, "sp": 4}, "split_sequence": "sp"})", "s"); }),
              ::testing::HasSubstr("overflows 64 bits"));
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"kernel_tiles": {"attention_keys": 12}})", "s"); }),
              ::testing::HasSubstr("a multiple of 8 up to 256"));
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"attention_kernel": "cudnn"})", "s"); }),
              ::testing::AllOf(::testing::HasSubstr("attention_kernel \"cudnn\""), ::testing::HasSubstr("legal: library, halide")));
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"weight_grad_kernel": "cublas"})", "s"); }),
              ::testing::AllOf(::testing::HasSubstr("weight_grad_kernel \"cublas\""), ::testing::HasSubstr("legal: library, halide")));
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"contract_kernel": "cublaslt"})", "s"); }),
              ::testing::AllOf(::testing::HasSubstr("contract_kernel \"cublaslt\""),
                               ::testing::HasSubstr("legal: auto, cublas, halide")));
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"contract_precision": "fp8"})", "s"); }),
              ::testing::AllOf(::testing::HasSubstr("contract_precision \"fp8\""), ::testing::HasSubstr("legal: f32, bf16")));
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"grad_reduce_precision": "f16"})", "s"); }),
              ::testing::AllOf(::testing::HasSubstr("grad_reduce_precision \"f16\""), ::testing::HasSubstr("legal: f32, bf16")));
}

// A Llama block's FLOPs, counted by hand, against the plan's stages.
TEST(Plan, FlopsPerStageEqualTheFormulasForALlamaBlock) {
  const auto cfg = llama::LlamaConfig::load(kMicro);
  const double B = 2, S = 32, M = static_cast<double>(cfg.hidden_size), H = static_cast<double>(cfg.num_attention_heads),
               KV = static_cast<double>(cfg.num_key_value_heads), D = static_cast<double>(cfg.head_dim),
               F = static_cast<double>(cfg.intermediate_size);
  const Plan p = plan(llama::llama_builder(), {kMicro, 2, 32}, Schedule::named("default"), Cluster::named("local-cpu"));
  double fwd_contract = 0, bwd_contract = 0, fwd_attention = 0;
  for (const StageCost& s : p.stages) {
    if (s.layer != "model.layers.0") continue;
    if (s.kind == "contract" || s.kind == "contract_seq") (s.backward ? bwd_contract : fwd_contract) += s.flops;
    if (s.kind == "attention" && !s.backward) fwd_attention += s.flops;
  }
  const double projections = 2 * B * S * M * (H * D + 2 * KV * D) + 2 * B * S * H * D * M + 3 * 2 * B * S * M * F;
  const double pairs = B * H * S * (S + 1) / 2;
  EXPECT_DOUBLE_EQ(fwd_contract, projections);
  // The backward of each contraction is two of them (input and weight gradients).
  EXPECT_DOUBLE_EQ(bwd_contract, 2 * projections);
  // Forward attention: q.k, the softmax and P.v (its row statistics are the backward's, which the forward reads).
  EXPECT_DOUBLE_EQ(fwd_attention, pairs * (4 * D + 5));
  std::printf("  layer 0: %.0f forward projection FLOPs, %.0f backward, %.0f forward attention\n", fwd_contract,
              bwd_contract, fwd_attention);
}

// A kernel over a value of 2^31 bytes or more is compiled with 64-bit
// addressing (the generator then gives the library Halide's large_buffers):
// the tiny Llama at 2^20 tokens holds [seq, ffn] values of 3 GiB, while
// its k projection reads 1 GiB and writes 256 MiB.
TEST(Plan, StagesOverValuesOf2GiBAndMoreNeed64BitAddressing) {
  const Plan big = plan(llama::llama_builder(), {kTiny, 1, int64_t{1} << 20}, Schedule::named("default"),
                        Cluster::named("local-cpu"));
  const Graph& g = *big.model.graph;
  std::map<std::string, bool> forward_large;
  int large = 0;
  for (const Stage& st : big.train.stages) {
    int64_t most = value_bytes(g.node(st.root).type);
    for (int v : st.extra_outputs) most += value_bytes(g.node(v).type);  // written together
    for (const std::vector<int>* vs : {&st.inputs, &st.inlined})
      for (int v : *vs) most = std::max(most, value_bytes(g.node(v).type));
    EXPECT_EQ(st.large_buffers, most > kMax32Bit) << g.node(st.root).name;
    large += st.large_buffers;
    forward_large.emplace(g.node(st.root).name, st.large_buffers);  // the first stage of a name is the forward's
  }
  EXPECT_TRUE(forward_large.at("model.layers.0.mlp.gate_proj"));
  EXPECT_FALSE(forward_large.at("model.layers.0.self_attn.k_proj"));
  EXPECT_GT(large, 0);
  const Plan small = plan(llama::llama_builder(), {kTiny, 1, 4096}, Schedule::named("default"), Cluster::named("local-cpu"));
  for (const Stage& st : small.train.stages) EXPECT_FALSE(st.large_buffers);
}

// Halide's GPU kernels index in 32 bits: on a GPU cluster a plan whose
// Halide kernel holds a tensor of 2^31 elements or more says so
// (Plan::gpu_unbuildable; the generator refuses it and the search skips
// it). Llama-3.2-1B at 32,768 tokens: whole, its logits hold 4.2G elements;
// in loss tiles of 16,736 tokens none does. CPU kernels index in 64 bits
// (large_buffers), and collectives and library calls are exempt.
TEST(Plan, GpuPlansSayWhatIsBeyondHalidesGpuIndexing) {
  const std::string one_b = HALYARD_SOURCE_DIR "/examples/llama/configs/llama-3.2-1b.json";
  ModelRequest req{one_b, 1, 32768};
  req.layers = 1;
  const Plan whole = plan(llama::llama_builder(), req, Schedule::named("default"), Cluster::named("8xH200"));
  EXPECT_NE(whole.gpu_unbuildable.find("beyond Halide's 32-bit GPU indexing"), std::string::npos) << whole.gpu_unbuildable;
  EXPECT_NE(whole.gpu_unbuildable.find("vocab=128256"), std::string::npos) << whole.gpu_unbuildable;
  Schedule tiled = Schedule::named("default");
  tiled.loss_seq_tile = 16736;
  tiled.values.push_back(recompute_seq_tiles_rule());
  EXPECT_EQ(plan(llama::llama_builder(), req, tiled, Cluster::named("8xH200")).gpu_unbuildable, "");
  EXPECT_EQ(plan(llama::llama_builder(), req, Schedule::named("default"), Cluster::named("local-cpu")).gpu_unbuildable, "");
  int refused = 0;
  for (const Stage& st : whole.train.stages) {
    const int big = gpu_index_overflow(*whole.model.graph, st);
    refused += big >= 0;
    if (big >= 0) {
      EXPECT_GT(whole.model.graph->node(big).type.numel(), kMax32Bit);
    }
    if (st.gemm) {
      EXPECT_LT(big, 0) << "cuBLAS writes the logits: " << whole.model.graph->node(st.root).name;
    }
  }
  EXPECT_GT(refused, 0);
}

// Ulysses: (2h + 2h_kv) N / P bytes per layer forward, (P-1)/P of it leaving the rank; the backward the same again.
TEST(Plan, AllToAllBytesEqualUlyssesFormula) {
  const auto cfg = llama::LlamaConfig::load(kTiny);
  for (int64_t sp : {2, 4}) {
    Schedule s = Schedule::named("ulysses");
    s.mesh.sp = sp;
    const Plan p = plan(llama::llama_builder(), {kTiny, 2, 128}, s, Cluster::named("local-cpu"));
    int64_t a2a = 0;
    for (const CollectiveCost& c : p.collectives)
      if (c.kind == "all_to_all") a2a += c.bytes_per_rank;
    const double n = 2 * 128, h = static_cast<double>(cfg.num_attention_heads * cfg.head_dim * 4),
                 h_kv = static_cast<double>(std::max<int64_t>(cfg.num_key_value_heads, sp) * cfg.head_dim * 4);
    const double per_layer = (2 * h + 2 * h_kv) * n / static_cast<double>(sp) * static_cast<double>(sp - 1) / static_cast<double>(sp);
    std::printf("  sp=%lld: %lld all-to-all bytes per rank per step; formula %.0f per layer and direction\n",
                static_cast<long long>(sp), static_cast<long long>(a2a), per_layer);
    EXPECT_DOUBLE_EQ(static_cast<double>(a2a), 2 * static_cast<double>(cfg.num_hidden_layers) * per_layer);
  }
}

// Staging of the all-to-alls: on the host one area as large as the largest
// (q's: its tokens' heads, sent and received); on a GPU q's, k's and v's
// run under the projections after them, each in a staging slot of its own
// (runtime::Model), so the three add up, and the gather of the positions
// (done where it stands, while they are in flight) takes a fourth. Tiny
// Llama, 4 ranks: k and v have 2 heads, so each rank receives one head,
// replicated: twice what it sends. The host also stages one block of
// ZeRO-1's reduce-scatter (Plan.HostGradientSumsStageOneBlockOfARing); the
// device's sums stage nothing of the host's.
TEST(Plan, OnAGpuAllToAllsInFlightTogetherEachHaveTheirStaging) {
  const auto cfg = llama::LlamaConfig::load(kTiny);
  Schedule s = Schedule::named("ulysses");
  s.mesh.sp = 4;
  s.mesh.zero = 1;
  const int64_t seq = 256, local = seq / 4;
  const int64_t q = 2 * local * cfg.num_attention_heads * cfg.head_dim * 4;  // sent and received alike
  const int64_t kv = 2 * seq * 1 * cfg.head_dim * 4;                         // one head of every token received
  const int64_t positions = 2 * seq * 4;                                      // every rank's, i32
  const Plan cpu = plan(llama::llama_builder(), {kTiny, 1, seq}, s, Cluster::named("local-cpu"));
  const Plan gpu = plan(llama::llama_builder(), {kTiny, 1, seq}, s, Cluster::named("8xH200"));
  std::printf("  staging: host %lld bytes, GPU %lld (q %lld, k and v %lld each)\n",
              static_cast<long long>(cpu.memory.collective_buffers), static_cast<long long>(gpu.memory.collective_buffers),
              static_cast<long long>(q), static_cast<long long>(kv));
  EXPECT_EQ(cpu.memory.collective_buffers, q + 4 * ((cpu.num_params + 3) / 4));
  EXPECT_EQ(gpu.memory.collective_buffers, q + 2 * kv + positions);
}

// The gradients' sum over 4 host ranks (runtime/comm_mpi.cpp) goes round a
// ring that stages one rank's block: with ZeRO-1 a quarter of the f32
// gradients, without it a quarter of the largest bucket (4 MiB or more of
// them); summed from bf16, ZeRO-1's rounded gradients go out and come in
// 2^20 at a time (2 + 2 bytes each: 4 MiB, here less than the whole 6.25
// MiB). One rank sums nothing.
TEST(Plan, HostGradientSumsStageOneBlockOfARing) {
  const int64_t seq = 256;
  auto staging = [&](int sp, int zero, const char* precision) {
    Schedule s = Schedule::named("ulysses");
    s.mesh.sp = sp;
    s.mesh.zero = zero;
    s.grad_reduce_precision = precision;
    const Plan p = plan(llama::llama_builder(), {kTiny, 1, seq}, s, Cluster::named("local-cpu"));
    return std::pair{p.memory.collective_buffers, p.num_params};
  };
  const auto [no_sum, params] = staging(1, 0, "f32");
  const int64_t zero1 = staging(4, 1, "f32").first, zero0 = staging(4, 0, "f32").first;
  const int64_t bf16 = staging(4, 1, "bf16").first;
  std::printf("  host staging: 1 rank %lld, 4 ranks ZeRO-1 %lld, without ZeRO %lld, ZeRO-1 from bf16 %lld bytes (%lld parameters)\n",
              static_cast<long long>(no_sum), static_cast<long long>(zero1), static_cast<long long>(zero0),
              static_cast<long long>(bf16), static_cast<long long>(params));
  EXPECT_EQ(no_sum, 0);  // no all-to-all and no sum
  const int64_t q = zero1 - 4 * ((params + 3) / 4);  // the all-to-alls' staging, the same in every 4-rank plan
  EXPECT_GT(q, 0);
  EXPECT_EQ(bf16, q + (int64_t{4} << 20));
  EXPECT_LT(4 << 20, 4 * params);
  EXPECT_GE(zero0 - q, (int64_t{4} << 20) / 4);  // a quarter of a bucket of at least 4 MiB
  EXPECT_LT(zero0 - q, zero1 - q);               // and less than a quarter of all of them
}

// The backward sends q, k and v again when their heads layout is
// recomputed: those all-to-alls start in the backward. Started right after
// the forward's projections (the inputs' producers), their outputs would
// live through both passes, as if saved (on a GPU with a staging slot each).
TEST(Plan, ABackwardsAllToAllOfAForwardValueStartsInTheBackward) {
  Schedule s = Schedule::named("ulysses");
  s.mesh.sp = 4;
  s.values.push_back({"model.layers.*.self_attn op:seq_to_heads", "recompute", "", ""});
  const Plan p = plan(llama::llama_builder(), {kTiny, 1, 256}, s, Cluster::named("local-cpu"));
  const Graph& g = *p.model.graph;
  auto root = [&](const PlannedCall& c) -> const Node& { return g.node(p.train.stages[static_cast<size_t>(c.stage)].root); };
  size_t first_backward_kernel = p.train_program.calls.size();
  for (size_t c = 0; c < p.train_program.calls.size() && first_backward_kernel == p.train_program.calls.size(); ++c) {
    const PlannedCall& call = p.train_program.calls[c];
    if (call.stage >= 0 && root(call).backward && !op_info(root(call).op).collective) first_backward_kernel = c;
  }
  int resent = 0;
  for (size_t c = 0; c < p.train_program.calls.size(); ++c) {
    const PlannedCall& call = p.train_program.calls[c];
    if (call.stage < 0 || call.wait || root(call).op != Op::SeqToHeads || !root(call).backward) continue;
    ++resent;
    EXPECT_GT(c, first_backward_kernel) << "call " << c << " (" << root(call).name << ") starts in the forward";
  }
  EXPECT_EQ(resent, 4 * 2) << "q, k and v sent again and the output's gradient, in both layers";
}

// Gradients summed from bf16 (grad_reduce_precision): the reduce-scatter is
// an all-to-all of half the bytes (ZeRO-1), and without ZeRO an all-gather
// of the f32 sums follows (runtime::Communicator::all_reduce_sum_bf16).
TEST(Plan, GradientsSummedFromBf16MoveHalfTheBytes) {
  auto reduction = [](int zero, const std::string& precision) {
    Schedule s = Schedule::named("ulysses");
    s.mesh = {1, 4, zero};
    s.grad_reduce_precision = precision;
    const Plan p = plan(llama::llama_builder(), {kTiny, 1, 256}, s, Cluster::named("local-cpu"));
    std::map<std::string, std::pair<std::string, int64_t>> out;  // op -> kind, bytes (over its buckets)
    for (const CollectiveCost& c : p.collectives)
      if (c.stage < 0) out[c.op].first = c.kind, out[c.op].second += c.bytes_per_rank;
    return std::make_pair(out, p.communication_s);
  };
  const auto [z1, t1] = reduction(1, "f32");
  const auto [z1_bf16, t1_bf16] = reduction(1, "bf16");
  // (Summed bucket by bucket, each bucket's bytes rounded down.)
  const int64_t share = z1.at("reduce_scatter_grads").second;  // 3/4 of the gradients' f32 bytes
  EXPECT_EQ(z1.at("reduce_scatter_grads").first, "all_reduce");
  EXPECT_EQ(z1_bf16.at("reduce_scatter_grads").first, "all_to_all");
  EXPECT_NEAR(static_cast<double>(z1_bf16.at("reduce_scatter_grads").second), share / 2.0, 8.0);
  EXPECT_EQ(z1_bf16.at("all_gather_params"), z1.at("all_gather_params"));
  EXPECT_LT(t1_bf16, t1);
  const auto [z0, t0] = reduction(0, "f32");
  const auto [z0_bf16, t0_bf16] = reduction(0, "bf16");
  EXPECT_NEAR(static_cast<double>(z0.at("all_reduce_grads").second), 2.0 * share, 8.0);
  EXPECT_EQ(z0_bf16.count("all_reduce_grads"), 0u);
  EXPECT_NEAR(static_cast<double>(z0_bf16.at("reduce_scatter_grads").second), share / 2.0, 8.0);
  EXPECT_EQ(z0_bf16.at("all_gather_grads").first, "all_gather");
  EXPECT_NEAR(static_cast<double>(z0_bf16.at("all_gather_grads").second), static_cast<double>(share), 8.0);
  EXPECT_LT(t0_bf16, t0);
  Schedule s = Schedule::named("ulysses");
  s.mesh = {1, 4, 1};
  s.grad_reduce_precision = "bf16";
  EXPECT_THAT(error_of([&] { plan(llama::llama_builder(), {kTiny, 1, 256, "bf16-mixed"}, s, Cluster::named("8xH200")); }),
              ::testing::AllOf(::testing::HasSubstr("sums the gradients from bf16"),
                               ::testing::HasSubstr("fix: plan precision f32")));
}

// The step on two tracks (plan(): lay_out_step), as runtime::Model runs it.
// Read back from the plan's starts: the kernels run one after another in
// the program's order; the collectives one after another, none before the
// kernel computing its input has ended; a collective with a later Wait
// ends before the first kernel reading its output starts, and one without
// holds the kernels until it ends. On a cluster whose links are slow
// enough to matter, ring passes and Ulysses all-to-alls then hide part of
// their time under the kernels; the rest is what the step waits for.
TEST(Plan, CollectivesFinishedLaterRunUnderTheKernels) {
  Cluster slow = Cluster::named("local-cpu");
  for (auto& [kind, link] : slow.collectives) link.beta_s_per_byte = 2e-9;  // 0.5 GB/s
  for (const char* name : {"ring", "ulysses_checkpoint"}) {
    SCOPED_TRACE(name);
    Schedule s = Schedule::named(name);
    s.mesh = {1, 4, 1};
    const Plan p = plan(llama::llama_builder(), {kTiny, 1, 2048}, s, slow);
    const Program& prog = p.train_program;
    const Graph& g = *p.model.graph;
    std::map<int, const StageCost*> kernel;
    std::map<int, const CollectiveCost*> collective;
    for (const StageCost& c : p.stages) kernel[c.stage] = &c;
    for (const CollectiveCost& c : p.collectives)
      if (c.stage >= 0) collective[c.stage] = &c;
    std::map<int, double> ends;  // buffer -> when its value exists
    double kernels_free = 0, comm_free = 0, hidden = 0;
    int finished_later = 0;
    std::set<int> waited;
    for (const PlannedCall& call : prog.calls)
      if (call.wait) waited.insert(call.stage);
    for (const PlannedCall& call : prog.calls) {
      if (call.stage < 0) continue;
      const Stage& st = p.train.stages[static_cast<size_t>(call.stage)];
      const size_t outputs = 1 + st.extra_outputs.size();
      if (auto c = collective.find(call.stage); c != collective.end()) {
        const CollectiveCost& cc = *c->second;
        if (call.wait) continue;
        EXPECT_GE(cc.start_s + 1e-12, comm_free) << cc.op << ": two transfers at once";
        EXPECT_GE(cc.start_s + 1e-12, ends[call.args.front()]) << cc.op << " starts before its input exists";
        comm_free = cc.start_s + cc.time_s;
        ends[call.args.back()] = comm_free;
        if (waited.count(call.stage)) ++finished_later;
        else kernels_free = comm_free;
        continue;
      }
      const StageCost& k = *kernel.at(call.stage);
      EXPECT_GE(k.start_s + 1e-12, kernels_free) << k.label << ": two kernels at once";
      for (size_t a = 0; a + outputs < call.args.size(); ++a) {
        const int b = call.args[a];
        if (ends.count(b)) {
          EXPECT_GE(k.start_s + 1e-12, ends[b]) << k.label << " reads " << g.node(prog.buffers[b].node).name;
        }
      }
      kernels_free = k.start_s + k.time_s;
      for (size_t a = call.args.size() - outputs; a < call.args.size(); ++a) ends[call.args[a]] = kernels_free;
    }
    for (const CollectiveCost& c : p.collectives) hidden += c.time_s;
    hidden -= p.exposed_communication_s;
    std::printf("  %s, sp 4, 2,048 tokens, links at 0.5 GB/s: compute %.4f s, communication %.4f s of which %.4f waited "
                "for, step %.4f s (%d collectives finished later)\n",
                name, p.compute_s, p.communication_s, p.exposed_communication_s, p.step_s, finished_later);
    EXPECT_GT(finished_later, 0);
    EXPECT_GT(hidden, 0.1 * p.communication_s) << "nothing ran under the kernels";
    EXPECT_GT(p.exposed_communication_s, 0);
    EXPECT_NEAR(p.step_s, p.compute_s + p.exposed_communication_s + p.optimizer_s + p.offload_s, 1e-9);
    EXPECT_LT(p.step_s, p.compute_s + p.communication_s + p.optimizer_s);
    EXPECT_GE(p.step_s, std::max(p.compute_s, p.communication_s));
  }
}

// The gradients' sum over the mesh goes bucket by bucket during the
// backward (runtime::Model: 4 MiB of f32 gradients, from the last parameter
// down, each once its gradients are final), so most of it runs under the
// backward's kernels; only the last bucket waits for the end. Summed from
// bf16 on a GPU, it runs whole after the backward.
TEST(Plan, GradientSumsRunUnderTheBackwardBucketByBucket) {
  Cluster slow = Cluster::named("local-cpu");
  for (auto& [kind, link] : slow.collectives) link.beta_s_per_byte = 1e-9;
  Schedule s = Schedule::named("ulysses");
  s.mesh = {1, 4, 0};
  const Plan p = plan(llama::llama_builder(), {kTiny, 1, 1024}, s, slow);
  std::vector<const CollectiveCost*> sums;
  for (const CollectiveCost& c : p.collectives)
    if (c.op == "all_reduce_grads") sums.push_back(&c);
  double kernels_end = 0;
  for (const StageCost& k : p.stages) kernels_end = std::max(kernels_end, k.start_s + k.time_s);
  // The buckets as the runtime cuts them: whole parameters, at least 4 MiB
  // each except the one reaching parameter 0.
  int64_t grads = 0;
  for (int id : p.param_ids) grads += 4 * p.model.graph->node(id).type.numel();
  ASSERT_GT(sums.size(), 1u) << "tiny Llama's " << grads << " gradient bytes in one bucket";
  EXPECT_LE(sums.size(), static_cast<size_t>(grads / (4 << 20)) + 1);
  double sent = 0;
  for (const CollectiveCost* c : sums) sent += static_cast<double>(c->bytes_per_rank);
  EXPECT_NEAR(sent, 2.0 * 3 / 4 * static_cast<double>(grads), static_cast<double>(sums.size()));
  EXPECT_LT(sums.front()->start_s, kernels_end - sums.front()->time_s) << "the first bucket waits for the backward's end";
  const double last_end = sums.back()->start_s + sums.back()->time_s;
  EXPECT_NEAR(p.step_s - p.optimizer_s, std::max(kernels_end, last_end), 1e-9);
  std::printf("  tiny Llama, 4 ranks, no ZeRO, links at 1 GB/s: %zu buckets, %.4f s of sums, the step waits %.4f s for them\n",
              sums.size(), p.communication_s, p.exposed_communication_s);

  s.grad_reduce_precision = "bf16";
  const Plan gpu = plan(llama::llama_builder(), {kTiny, 1, 1024}, s, Cluster::named("8xH200"));
  double gpu_kernels_end = 0;
  int whole = 0;
  for (const StageCost& k : gpu.stages) gpu_kernels_end = std::max(gpu_kernels_end, k.start_s + k.time_s);
  for (const CollectiveCost& c : gpu.collectives)
    if (c.stage < 0) {
      ++whole;
      EXPECT_GE(c.start_s + 1e-12, gpu_kernels_end) << c.op;
    }
  EXPECT_EQ(whole, 2) << "reduce-scatter and all-gather, once each";
}

// Where ranks share cores, the others are often still computing when one
// reaches a collective, and it stands still for the latest of them
// (Cluster::collective_lag_s): k / (k + 1) of the lag when it waits on k
// others, k the group's other ranks (one for a ring shift). The plan adds
// that wherever its kernels' track waits on a collective: at a Wait, at a
// collective not finished later, at the end of the gradients' sum, at
// each collective after it. (Measured on 4 ranks sharing 2 cores, steps
// stood still 4-6 ms a collective beyond the transfer: the 4-rank steps of
// scripts/plan_accuracy.sh were 10-27% faster in the plan than measured.)
TEST(Plan, RanksBehindAtACollectiveAddTheirLagWhereTheStepWaits) {
  EXPECT_DOUBLE_EQ(Cluster::lag_share("all_to_all", 4), 0.75);
  EXPECT_DOUBLE_EQ(Cluster::lag_share("all_reduce", 2), 0.5);
  EXPECT_DOUBLE_EQ(Cluster::lag_share("ring_shift", 4), 0.5);
  EXPECT_DOUBLE_EQ(Cluster::lag_share("all_gather", 1), 0);

  Cluster c = Cluster::named("local-cpu");
  Cluster lagging = c;
  lagging.collective_lag_s = 5e-3;
  EXPECT_DOUBLE_EQ(Cluster::parse(lagging.to_json(), "again").collective_lag_s, 5e-3);
  EXPECT_DOUBLE_EQ(Cluster::parse(c.to_json(), "again").collective_lag_s, 0);
  EXPECT_THAT(error_of([] { Cluster::parse(R"({"collective_lag_s": -1})", "c.json"); }),
              ::testing::HasSubstr("collective_lag_s -1"));

  for (const char* name : {"ring", "ulysses", "default"}) {
    SCOPED_TRACE(name);
    Schedule s = Schedule::named(name);
    const int64_t sp = std::string(name) == "default" ? 1 : 4;
    s.mesh = {1, sp, sp > 1 ? 1 : 0};
    const Plan p = plan(llama::llama_builder(), {kTiny, 1, 2048}, s, c);
    const Plan q = plan(llama::llama_builder(), {kTiny, 1, 2048}, s, lagging);
    // The waits, counted from the program: a collective's Wait, a collective
    // with none (waited for where it stands), and every collective outside
    // the program (ZeRO-1's reduce-scatter and all-gather, one after the other).
    std::map<int, const CollectiveCost*> collective;
    for (const CollectiveCost& cc : p.collectives)
      if (cc.stage >= 0) collective[cc.stage] = &cc;
    std::set<int> waited;
    for (const PlannedCall& call : p.train_program.calls)
      if (call.wait) waited.insert(call.stage);
    int waits = 0;
    double lags = 0;
    // (A collective over one rank waits on none.)
    for (const PlannedCall& call : p.train_program.calls) {
      auto it = call.stage >= 0 ? collective.find(call.stage) : collective.end();
      if (it == collective.end() || it->second->degree < 2 || (!call.wait && waited.count(call.stage))) continue;
      ++waits, lags += Cluster::lag_share(it->second->kind, it->second->degree);
    }
    for (const CollectiveCost& cc : p.collectives)
      if (cc.stage < 0 && cc.degree > 1) ++waits, lags += Cluster::lag_share(cc.kind, cc.degree);
    EXPECT_EQ(p.collective_waits, waits);
    EXPECT_DOUBLE_EQ(p.collective_lags, lags);
    EXPECT_EQ(q.collective_waits, waits);
    // The lag shifts the kernels after each wait; a later wait may absorb
    // some of it where it would have waited for a transfer anyway.
    EXPECT_LE(q.step_s - p.step_s, lags * 5e-3 + 1e-9);
    EXPECT_GE(q.step_s - p.step_s, lags * 5e-3 - p.exposed_communication_s - 1e-9);
    EXPECT_DOUBLE_EQ(q.compute_s, p.compute_s);
    std::printf("  %s, %lld ranks, 2,048 tokens: %d collectives waited on, %.2f lags; a 5 ms lag adds %.4f s to %.4f s\n",
                name, static_cast<long long>(sp), waits, lags, q.step_s - p.step_s, p.step_s);
    if (sp == 1) {
      EXPECT_EQ(waits, 0);
      EXPECT_DOUBLE_EQ(q.step_s, p.step_s);
    } else {
      EXPECT_GT(waits, 2);
    }
  }
}

// A rank's threads, as the runtime gives them (cores / ranks on the node),
// decide the per-thread scratch the plan counts. A calibrated profile says
// the node's cores: one rank on 2 cores runs 2 threads, and its plan counts
// two threads' packed keys and values in the attention kernels. (The
// profile used to say nothing, and its one rank per node read as 1 thread:
// the 1-rank rows of scripts/plan_accuracy.sh were under-predicted.)
TEST(Plan, PerThreadScratchFollowsTheCoresOfANode) {
  Cluster c = Cluster::named("local-cpu");
  c.ranks = c.ranks_per_node = 1;
  EXPECT_EQ(c.threads_per_rank(1), 1);  // cores unknown: ranks_per_node / ranks
  c.cores_per_node = 2;
  EXPECT_EQ(c.threads_per_rank(1), 2);
  c.ranks = c.ranks_per_node = 4;
  EXPECT_EQ(c.threads_per_rank(4), 1);  // 4 ranks on 2 cores: 1 each, as default_threads_per_rank
  EXPECT_EQ(c.threads_per_rank(1), 2);
  c.cores_per_node = 16;
  EXPECT_EQ(c.threads_per_rank(4), 4);
  EXPECT_EQ(c.threads_per_rank(8), 4);  // 8 ranks over nodes of 4: 4 on each node
  EXPECT_EQ(Cluster::parse(c.to_json(), "again").cores_per_node, 16);
  EXPECT_EQ(Cluster::parse(R"({"ranks": 2})", "old.json").cores_per_node, 0);
  EXPECT_THAT(error_of([] { Cluster::parse(R"({"cores_per_node": -2})", "c.json"); }),
              ::testing::HasSubstr("cores_per_node -2"));

  auto scratch = [](int64_t cores) {
    Cluster one = Cluster::named("local-cpu");
    one.ranks = one.ranks_per_node = 1;
    one.cores_per_node = cores;
    Schedule s = Schedule::named(HALYARD_SOURCE_DIR "/examples/llama/schedules/checkpoint_tiled.json");
    return plan(llama::llama_builder(), {kTiny, 1, 4096}, s, one).memory.kernel_scratch;
  };
  const int64_t one = scratch(1), two = scratch(2);
  std::printf("  tiny Llama, 4,096 tokens, 1 rank: kernel scratch %.2f MiB on 1 core, %.2f MiB on 2\n", one / 1048576.0,
              two / 1048576.0);
  EXPECT_GT(two, one);
}

// More memory per rank is never predicted for more ranks, and recomputation
// trades time for memory.
TEST(Plan, MemoryAndTimeMoveTheRightWay) {
  auto at = [](const char* sched, int64_t sp) {
    Schedule s = Schedule::named(sched);
    s.mesh.sp = sp;
    return plan(llama::llama_builder(), {kTiny, 1, 4096}, s, Cluster::named("local-cpu"));
  };
  const Plan u1 = at("ulysses", 1), u4 = at("ulysses", 4), c4 = at("ulysses_checkpoint", 4);
  EXPECT_LT(u4.memory.activations, u1.memory.activations);
  EXPECT_LT(c4.memory.activations, u4.memory.activations);
  EXPECT_GT(c4.compute_s, u4.compute_s);
  EXPECT_GT(u4.communication_s, 0);
  EXPECT_EQ(u1.communication_s, 0);
  std::printf("%s", c4.report().c_str());
}

// The MLP and the LM head + loss tiled apart: the [seq, ffn] buffers come in
// tiles of one size, the [seq, vocab] ones in tiles of the other.
TEST(Plan, TileSizesPerTiledRegion) {
  Schedule s = Schedule::named("tiled");
  s.seq_tile = 256;
  s.loss_seq_tile = 128;
  const Plan p = plan(llama::llama_builder(), {kMicro, 1, 1024}, s, Cluster::named("local-cpu"));
  std::set<int64_t> ffn, vocab;
  for (const PlannedBuffer& b : p.train_program.buffers) {
    const Node& n = p.model.graph->node(b.node);
    if (!n.type.has("seq")) continue;
    if (n.type.has("ffn")) ffn.insert(n.type.size("seq"));
    if (n.type.has("vocab")) vocab.insert(n.type.size("seq"));
  }
  EXPECT_EQ(ffn, std::set<int64_t>{256});
  EXPECT_EQ(vocab, std::set<int64_t>{128});
  EXPECT_THAT(s.str(), ::testing::HasSubstr("tile_sequence(256), loss tile 128"));
}

// The most buffers alive at once, over the train program's calls, among those whose node `is`.
int most_alive(const Plan& p, const std::function<bool(const Node&)>& is) {
  int most = 0;
  for (int c = 0; c < static_cast<int>(p.train_program.calls.size()); ++c) {
    int alive = 0;
    for (const PlannedBuffer& b : p.train_program.buffers)
      if (b.kind == BufferKind::Arena && is(p.model.graph->node(b.node)))
        for (auto [first, last] : b.device_ranges()) alive += first <= c && c <= last;
    most = std::max(most, alive);
  }
  return most;
}

// A gradient summed from parts that kernels write is summed as they come,
// so each part dies once added. The MLP tiles' input gradients from the
// gate and up projections (two parts a tile) all lived until the tiles
// were joined, as inputs of one kernel: 32 of them with 16 tiles, two
// values as long as the sequence, at the peak of autosp's plans on 4 CPU
// ranks. A ring's blocks of dQ likewise (4 on 4 ranks, each as long as
// the rank's sequence).
TEST(Plan, GradientPartsDieOnceSummed) {
  for (int64_t tiles : {4, 16}) {
    Schedule s = Schedule::named("tiled");
    s.seq_tile = 2048 / tiles;
    const Plan p = plan(llama::llama_builder(), {kMicro, 1, 2048}, s, Cluster::named("local-cpu"));
    const int parts = most_alive(p, [&](const Node& n) {
      return n.backward && n.op == Op::Contract && n.type.has("seq") && n.type.size("seq") == s.seq_tile &&
             !n.type.has("ffn") && (n.name.find("gate_proj") != std::string::npos || n.name.find("up_proj") != std::string::npos);
    });
    EXPECT_LE(parts, 2) << tiles << " tiles";
    // The norm before the MLP is computed per tile: its output never
    // exists whole, and each tile's part of the residual stream's gradient
    // (the norm's backward on the tile's rows) dies once added into the
    // running sum, which holds the bytes of the gradient the tiles read
    // their rows of. At 32,768 tokens on 4 x 128 MiB, autosp's peak, each
    // layer's last MLP tile, held the whole norm and 16 tiles' parts; the
    // longest length it plans grew from 33.0K to 34.9K tokens.
    const Graph& g = *p.model.graph;
    for (const PlannedBuffer& b : p.train_program.buffers) {
      const Node& n = g.node(b.node);
      if (b.kind == BufferKind::Arena && n.name.find("post_attention_layernorm") != std::string::npos &&
          n.type.has("seq"))
        EXPECT_EQ(n.type.size("seq"), s.seq_tile) << describe(g, b.node);
    }
    // (Two where the final norm's first two tiles start its gradient's sum.)
    EXPECT_LE(most_alive(p, [&](const Node& n) { return n.op == Op::RmsNormGradX && n.type.size("seq") == s.seq_tile; }), 2)
        << tiles << " tiles";
    int over_rows = 0;
    for (const PlannedBuffer& b : p.train_program.buffers) over_rows += b.handed_over >= 0 && b.handed_over < b.last;
    EXPECT_GE(over_rows, 2) << tiles << " tiles";  // a layer's residual stream's gradient, at least, in each layer
  }
  Schedule s = Schedule::named("ring_zigzag");
  s.mesh.sp = 4;
  const Plan p = plan(llama::llama_builder(), {kMicro, 1, 2048}, s, Cluster::named("local-cpu"));
  EXPECT_LE(most_alive(p, [](const Node& n) { return n.op == Op::AttentionGradQ; }), 2);
}

// An elementwise stage writes its output over an input of its type that
// dies there (PlannedBuffer::in_place_of): the running sum of a ring's dQ
// blocks takes over the last sum's bytes, so of the three buffers each add
// held (the sum so far, the block's part, the new sum) two remain; the
// merge of the ring's blocks takes over one block's output. At 32,768 tokens, autosp's least plan on 4 CPU ranks
// needed 146.4 MiB with them apart and 140.6 MiB so. The arena's fullest
// call lists what it holds there, largest first, and the report prints it.
TEST(Plan, ElementwiseStagesWriteOverAnInputDyingThere) {
  Schedule s = Schedule::named("ring_zigzag");
  s.mesh.sp = 4;
  const Plan p = plan(llama::llama_builder(), {kTiny, 1, 4096}, s, Cluster::named("local-cpu"));
  const Graph& g = *p.model.graph;
  const std::vector<PlannedBuffer>& b = p.train_program.buffers;
  int dq_sums = 0, in_place = 0;
  for (const PlannedBuffer& o : b) {
    const Node& n = g.node(o.node);
    const bool dq_sum = o.kind == BufferKind::Arena && n.backward && n.op == Op::Add && n.type.has("heads") &&
                        g.node(n.inputs[0]).op != Op::Contract;  // (not the projections' input gradients)
    if (dq_sum) {
      ++dq_sums;
      EXPECT_GE(o.in_place_of, 0) << n.name;
    }
    if (o.in_place_of < 0) continue;
    ++in_place;
    const PlannedBuffer& i = b[static_cast<size_t>(o.in_place_of)];
    EXPECT_EQ(i.offset, o.offset);
    EXPECT_EQ(i.last, o.first);
    EXPECT_EQ(g.node(i.node).type, n.type);
  }
  EXPECT_GT(dq_sums, 0);
  // The ring's blocks are merged as they arrive (schedules/sharding.cpp):
  // each merge reads the blocks so far and the new block's output at its
  // own position (and q, k and v, whose RoPE the stage inlines, not at
  // all), and takes over the bytes of one of them. So at most two of the
  // ring's attention-shaped outputs are alive at a time, where the merge of
  // all blocks at once held one per rank (4 here: at 35,712 tokens on 4 x
  // 128 MiB, 35 MiB of autosp's 81.5 MiB peak, in a backward's recompute).
  int merges = 0;
  for (const PlannedBuffer& o : b)
    if (o.kind == BufferKind::Arena && g.node(o.node).op == Op::AttentionMerge) {
      ++merges;
      ASSERT_GE(o.in_place_of, 0) << g.node(o.node).name;
      const Op over = g.node(b[static_cast<size_t>(o.in_place_of)].node).op;
      EXPECT_TRUE(over == Op::Attention || over == Op::AttentionMerge) << op_name(over);
    }
  EXPECT_EQ(merges, 2 * 3);  // 2 layers, 3 merges each (4 blocks)
  // So too where the backward recomputes the layers (autodiff recomputes a
  // merge's blocks in order, each merged as it comes).
  Schedule recomputed = s;
  recomputed.values.push_back({"model.layers.*", "recompute", "", ""});
  const Plan r = plan(llama::llama_builder(), {kTiny, 1, 4096}, recomputed, Cluster::named("local-cpu"));
  for (const Plan* x : {&p, &r}) {
    int held_most = 0;  // layer 1's outputs holding bytes at one call (a merge's output from the call after it)
    for (int c = 0; c < static_cast<int>(x->train_program.calls.size()); ++c) {
      int held = 0;
      for (const PlannedBuffer& y : x->train_program.buffers) {
        const Node& n = x->model.graph->node(y.node);
        if (y.kind == BufferKind::Arena && (n.op == Op::Attention || n.op == Op::AttentionMerge) &&
            n.name.find("layers.1.") != std::string::npos)
          for (auto [first, last] : y.held_ranges()) held += first <= c && c <= last;
      }
      held_most = std::max(held_most, held);
    }
    EXPECT_EQ(held_most, 2) << (x == &r ? "recomputed" : "saved");
  }
  std::printf("  ring (zigzag) on 4 ranks, 4,096 tokens: %d buffers written in place, %d of them dQ's sums, %d merges\n",
              in_place, dq_sums, merges);

  const Plan::ArenaPeak peak = p.arena_peak();
  ASSERT_GE(peak.call, 0);
  EXPECT_LE(peak.live_bytes, p.train_program.arena_bytes);
  int64_t listed = 0;
  for (size_t k = 0; k < peak.buffers.size(); ++k) {
    listed += arena_aligned(b[static_cast<size_t>(peak.buffers[k])].bytes);
    if (k > 0) EXPECT_GE(b[static_cast<size_t>(peak.buffers[k - 1])].bytes, b[static_cast<size_t>(peak.buffers[k])].bytes);
  }
  EXPECT_EQ(listed, peak.live_bytes);
  EXPECT_THAT(p.report(), ::testing::HasSubstr("activations at their fullest: "));
  // The plan's JSON lists every value alive there, largest first, as the
  // report lists the first 8.
  const nlohmann::json j = nlohmann::json::parse(p.to_json());
  const nlohmann::json& a = j.at("arena_peak");
  EXPECT_EQ(a.at("call").get<int>(), peak.call + 1);
  EXPECT_EQ(a.at("calls").get<size_t>(), p.train_program.calls.size());
  EXPECT_EQ(a.at("live_bytes").get<int64_t>(), peak.live_bytes);
  ASSERT_EQ(a.at("values").size(), peak.buffers.size());
  for (size_t k = 0; k < peak.buffers.size(); ++k) {
    const PlannedBuffer& x = b[static_cast<size_t>(peak.buffers[k])];
    EXPECT_EQ(a["values"][k].at("bytes").get<int64_t>(), x.bytes);
    EXPECT_EQ(a["values"][k].at("label").get<std::string>(), g.node(x.node).name);
    EXPECT_EQ(a["values"][k].at("op").get<std::string>(), op_name(g.node(x.node).op));
  }
  EXPECT_THAT(p.report(), ::testing::HasSubstr("(" + a.at("layer").get<std::string>() +
                                               (a.at("backward").get<bool>() ? " backward)" : " forward)")));
}

// Buffers written over others share bytes; a read must find there the
// value it reads. Checked here apart from plan_program's own reasoning:
// every write into shared bytes (a buffer written in place, over the
// buffer before it) changes rows of them, all of them or, for a running
// sum adding one tile padded to the sequence, that tile's rows; a read of
// a buffer, whole or through a view of some rows, must come after the
// buffer is written and before any later write into the same bytes
// changes a row it reads. Over tiled plans of every strategy, sp 1 and 4,
// on CPU ranks and a GPU cluster (offloaded values included).
TEST(Plan, NoReadFindsItsRowsOverwritten) {
  const std::string fixtures = HALYARD_SOURCE_DIR "/tests/fixtures/";
  struct Case {
    std::string schedule;
    int sp;
    const char* cluster;
  };
  const Case cases[] = {{"tiled", 1, "local-cpu"},
                        {fixtures + "ulysses_checkpoint_tiled.json", 4, "local-cpu"},
                        {fixtures + "ring_checkpoint_tiled.json", 4, "local-cpu"},
                        {fixtures + "zigzag_checkpoint_tiled.json", 4, "local-cpu"},
                        {fixtures + "hybrid_checkpoint_tiled_2x2.json", 4, "local-cpu"},
                        {fixtures + "bf16_checkpoint_tiled_micro.json", 1, "local-cpu"},
                        {fixtures + "gpu_inline_tiled.json", 1, "8xH200"}};
  int checked_rows = 0;
  for (const Case& c : cases) {
    Schedule s = Schedule::named(c.schedule);
    s.mesh.sp = c.sp;
    s.seq_tile = 256;
    s.loss_seq_tile = 256;
    if (std::string(c.cluster) != "local-cpu") s.values.push_back({"model.layers.*.mlp.residual", "offload", "", ""});
    const Plan p = plan(llama::llama_builder(), {kTiny, 1, 2048}, s, Cluster::named(c.cluster));
    const Graph& g = *p.model.graph;
    const std::vector<PlannedBuffer>& b = p.train_program.buffers;
    const std::vector<PlannedCall>& calls = p.train_program.calls;
    // The writes into each buffer's bytes after its own, by call: rows changed.
    struct Write {
      int call;
      int64_t lo, hi;
    };
    std::vector<std::vector<Write>> later(b.size());
    for (size_t o = 0; o < b.size(); ++o) {
      if (b[o].in_place_of < 0) continue;
      const Node& sum = g.node(b[o].node);
      int64_t lo = 0, hi = INT64_MAX;
      const int over = b[static_cast<size_t>(b[o].in_place_of)].node;
      if (sum.op == Op::Add)
        for (size_t k = 0; k < 2; ++k)
          if (sum.inputs[k] == over && g.node(sum.inputs[1 - k]).op == Op::PadSeq) {
            const Node& pad = g.node(sum.inputs[1 - k]);
            lo = pad.attrs.offset, hi = lo + g.node(pad.inputs[0]).type.size("seq");
            ++checked_rows;
          }
      for (int h = b[o].in_place_of; h >= 0; h = b[static_cast<size_t>(h)].in_place_of)
        later[static_cast<size_t>(h)].push_back({b[o].first, lo, hi});
    }
    for (size_t call = 0; call < calls.size(); ++call)
      for (size_t k = 0; k < calls[call].args.size(); ++k) {
        int a = calls[call].args[k];
        int64_t lo = 0, hi = INT64_MAX;
        if (b[static_cast<size_t>(a)].kind == BufferKind::View) {
          lo = b[static_cast<size_t>(a)].offset, hi = lo + g.node(b[static_cast<size_t>(a)].node).type.size("seq");
          a = b[static_cast<size_t>(a)].index;
        }
        const PlannedBuffer& x = b[static_cast<size_t>(a)];
        if (x.kind != BufferKind::Arena) continue;
        const bool written_here = k + 1 == calls[call].args.size() && x.first == static_cast<int>(call);
        for (const Write& w : later[static_cast<size_t>(a)])
          EXPECT_FALSE(w.call < static_cast<int>(call) && w.lo < hi && lo < w.hi && !written_here)
              << c.schedule << ": call " << call << " reads " << describe(g, x.node) << " rows [" << lo << ", " << hi
              << ") after call " << w.call << " wrote rows [" << w.lo << ", " << w.hi << ") of its bytes";
      }
  }
  EXPECT_GT(checked_rows, 0);
  std::printf("  %zu tiled plans; %d running sums over tile rows among the buffers written in place\n",
              std::size(cases), checked_rows);
}

// A ring's dQ sums one part per key block. The library backward of each
// block after the first adds its part to the running sum of the blocks
// before and writes the sum over it: no later block's part is a buffer,
// and the sum holds one buffer's bytes through the ring. (At 32,768 tokens
// on 4 x 128 MiB the peak, layer 1's attention backward, held a part
// beside the sum.) Halide's attention kernels keep the adds.
TEST(Plan, RingBlocksAddTheirDqPartsToTheRunningSumInPlace) {
  for (const char* kernel : {"library", "halide"}) {
    Schedule s = Schedule::named("ring_zigzag");
    s.mesh.sp = 4;
    s.attention_kernel = kernel;
    const Plan p = plan(llama::llama_builder(), {kTiny, 1, 4096}, s, Cluster::named("local-cpu"));
    const Graph& g = *p.model.graph;
    const std::vector<PlannedBuffer>& b = p.train_program.buffers;
    auto buffer_of = [&](int node) {
      for (size_t i = 0; i < b.size(); ++i)
        if (b[i].node == node) return static_cast<int>(i);
      return -1;
    };
    int adding = 0;
    for (const Stage& st : p.train.stages) {
      if (st.dq_sum_in < 0) continue;
      ++adding;
      EXPECT_TRUE(st.library && is_ring_block(g.node(st.root)));
      EXPECT_EQ(g.node(st.root).op, Op::AttentionGradK);
      const Node& sum = g.node(st.extra_outputs.back());
      ASSERT_EQ(sum.op, Op::Add);
      EXPECT_THAT(sum.inputs, ::testing::UnorderedElementsAre(st.dq_part, st.dq_sum_in));
      EXPECT_EQ(g.node(st.dq_part).op, Op::AttentionGradQ);
      EXPECT_EQ(st.computes(st.extra_outputs.back()), st.dq_part);
      EXPECT_FALSE(p.train.materialized[static_cast<size_t>(st.dq_part)]);
      EXPECT_EQ(buffer_of(st.dq_part), -1);
      EXPECT_NE(std::find(st.inputs.begin(), st.inputs.end(), st.dq_sum_in), st.inputs.end());
      const int out = buffer_of(st.extra_outputs.back());
      ASSERT_GE(out, 0);
      EXPECT_EQ(b[static_cast<size_t>(out)].in_place_of, buffer_of(st.dq_sum_in));
    }
    int parts = 0;
    for (const PlannedBuffer& x : b) parts += g.node(x.node).op == Op::AttentionGradQ;
    const bool library = std::string(kernel) == "library";
    // 2 layers, 4 blocks each: the first block's part starts each sum.
    EXPECT_EQ(adding, library ? 6 : 0) << kernel;
    EXPECT_EQ(parts, library ? 2 : 8) << kernel;
  }
}

// "seq_tiles" matches the tiles, not every wide value: with only the loss
// tiled, "seq_tiles: recompute" recomputes the logits tile by tile and
// leaves the whole MLP as the other rules say (saved here). It used to
// match the MLP's [seq, ffn] values too, so that AutoSP's GPU plans, whose
// loss is tiled for Halide's 32-bit indexing, recomputed every layer's gate
// and up projections: 35 TFLOP more a step for Llama-3.2-1B at 32k tokens.
TEST(Plan, LossTilesRecomputeOnlyTheLoss) {
  Schedule whole = Schedule::named("default"), tiled = whole;
  tiled.loss_seq_tile = 1024;
  tiled.values.push_back(recompute_seq_tiles_rule());
  const Plan a = plan(llama::llama_builder(), {kTiny, 1, 4096}, whole, Cluster::named("local-cpu"));
  const Plan b = plan(llama::llama_builder(), {kTiny, 1, 4096}, tiled, Cluster::named("local-cpu"));
  auto flops = [](const Plan& p, const std::string& layer, bool backward) {
    double f = 0;
    for (const StageCost& c : p.stages)
      if (c.layer == layer && c.backward == backward) f += c.flops;
    return f;
  };
  for (const char* layer : {"model.layers.0", "model.layers.1"}) {
    EXPECT_DOUBLE_EQ(flops(b, layer, true), flops(a, layer, true)) << layer;
    EXPECT_DOUBLE_EQ(flops(b, layer, false), flops(a, layer, false)) << layer;
  }
  // The loss's backward recomputes its tiles' logits: the forward's product
  // once more (the forward's FLOPs but the loss's own sums, under 1%).
  EXPECT_NEAR(flops(b, "lm_head", true) - flops(a, "lm_head", true), flops(a, "lm_head", false), 1e-2 * flops(a, "lm_head", false));
  for (const Node& n : b.model.graph->nodes())
    if (n.type.has("ffn") && !n.backward) {
      EXPECT_FALSE(n.attrs.seq_tile) << n.name;
    }
}

// keep "offload": a value saved for the backward leaves the device after
// its last forward use and comes back before its first backward one, and
// its arena bytes serve other buffers in between; the host holds it in a
// second arena. Both arenas are sound (no two buffers whose live ranges
// meet share a byte), the device arena shrinks, and the plan prices the
// copies over the cluster's host link.
// {"store": "bf16"}: every activation the backward reads is a bf16 copy
// (softmax statistics and counts stay f32, as the op table says), the f32
// values die in the forward, and the saved bytes halve.
TEST(Plan, SavedValuesStoredInBf16) {
  for (const char* preset : {"default", "checkpoint", "tiled", "ulysses_checkpoint"}) {
    Schedule f32 = Schedule::named(preset), bf16 = f32;
    if (f32.split_sequence.empty()) f32.mesh.sp = bf16.mesh.sp = 1;
    else f32.mesh.sp = bf16.mesh.sp = 2;
    bf16.values.push_back({"*", "", "", "bf16"});
    const Plan a = plan(llama::llama_builder(), {kTiny, 1, 4096}, f32, Cluster::named("local-cpu"));
    const Plan b = plan(llama::llama_builder(), {kTiny, 1, 4096}, bf16, Cluster::named("local-cpu"));
    EXPECT_EQ(a.stored_bf16(), 0);
    EXPECT_GT(b.stored_bf16(), 0) << preset;
    const Graph& g = *b.model.graph;
    int64_t saved_a = 0, saved_b = 0;  // forward buffers the backward reads
    auto saved = [](const Plan& p, int64_t& bytes) {
      const Graph& pg = *p.model.graph;
      std::set<int> read;
      for (const Stage& st : p.train.stages)
        if (pg.node(st.root).backward)
          for (int in : st.inputs) {
            const Node* x = &pg.node(in);
            while (x->op == Op::SliceSeq) x = &pg.node(x->inputs[0]);  // a tile reads its buffer
            if (!x->backward && x->op != Op::Param && x->op != Op::Input) read.insert(x->id);
          }
      for (int id : read) bytes += value_bytes(pg.node(id).type);
      return read;
    };
    saved(a, saved_a);
    for (int id : saved(b, saved_b)) {
      const Node& x = g.node(id);
      if (x.type.dtype == DType::f32) {
        EXPECT_TRUE(op_info(x.op).store_f32 || !x.type.has("seq")) << preset << ": " << describe(g, id) << " read in f32";
      } else if (x.type.dtype == DType::bf16) {
        EXPECT_EQ(x.op, Op::StoreBf16) << preset << ": " << describe(g, id);
      }
    }
    // The backward reads no f32 value that has a copy; it decodes inside its kernels.
    for (const Stage& st : b.train.stages) {
      EXPECT_NE(g.node(st.root).op, Op::LoadBf16) << preset;
      for (int in : st.inputs) {
        if (!g.node(st.root).backward || g.node(in).backward) continue;
        for (const Node& n : g.nodes())
          EXPECT_FALSE(n.op == Op::StoreBf16 && n.inputs[0] == in) << preset << ": " << describe(g, in);
      }
    }
    const double ratio = static_cast<double>(saved_b) / static_cast<double>(saved_a);
    std::printf("  %-18s saved for the backward %7.1f MiB f32, %7.1f MiB bf16 (%.2fx); activations %7.1f -> %7.1f MiB; "
                "%d values stored\n", preset, static_cast<double>(saved_a) / (1 << 20), static_cast<double>(saved_b) / (1 << 20),
                ratio, static_cast<double>(a.memory.activations) / (1 << 20),
                static_cast<double>(b.memory.activations) / (1 << 20), b.stored_bf16());
    EXPECT_LT(ratio, 0.56) << preset;  // half, but for the f32 statistics
    EXPECT_LT(b.memory.activations, a.memory.activations) << preset;
    // Attention and its row statistics stay one forward kernel, dK, dV and dQ one backward kernel.
    auto attention_stages = [](const Plan& p) {
      int k = 0;
      for (const StageCost& c : p.stages) k += c.kind.rfind("attention", 0) == 0;
      return k;
    };
    EXPECT_EQ(attention_stages(b), attention_stages(a)) << preset;
  }
}

// contract_precision "bf16" (schedules/precision.h: round_contractions):
// every contraction, forward and backward, reads bf16 copies of its f32
// operands; each value has one copy, whoever made it (a store rule too),
// which the forward's projection and the backward's weight gradient share;
// a weight has one copy in the forward and one in the backward. Nothing
// else changes: the other kernels read what they read in f32. On a GPU
// cluster the plan prices those contractions at the bf16 peak.
TEST(Plan, ContractionsInBf16ReadOneCopyPerValue) {
  for (const char* preset : {"default", "checkpoint", "tiled", "ulysses_checkpoint"}) {
    for (bool store : {false, true}) {
      Schedule f32 = Schedule::named(preset), bf16 = f32;
      if (!f32.split_sequence.empty()) f32.mesh.sp = 2;
      bf16 = f32;
      bf16.contract_precision = "bf16";
      if (store) f32.values.push_back({"*", "", "", "bf16"}), bf16.values.push_back({"*", "", "", "bf16"});
      const Plan a = plan(llama::llama_builder(), {kTiny, 1, 1024}, f32, Cluster::named("local-cpu"));
      const Plan b = plan(llama::llama_builder(), {kTiny, 1, 1024}, bf16, Cluster::named("local-cpu"));
      const Graph& g = *b.model.graph;
      const std::string what = std::string(preset) + (store ? " + store bf16" : "");
      std::map<std::pair<int, bool>, int> copies;  // (value, in the backward) -> its copies
      int contractions = 0, weight_copies = 0, shared = 0;
      for (const Node& n : g.nodes()) {
        if (n.op == Op::StoreBf16) {
          const bool weight = g.node(n.inputs[0]).op == Op::Param;
          ++copies[{n.inputs[0], weight && n.backward}];
          weight_copies += weight;
        }
        if (n.op != Op::Contract) continue;
        ++contractions;
        for (int i : n.inputs) {
          const Node& x = g.node(i);
          EXPECT_EQ(x.op, Op::LoadBf16) << what << ": " << describe(g, n.id) << " reads " << describe(g, i);
        }
      }
      for (const auto& [v, k] : copies) EXPECT_EQ(k, 1) << what << ": " << describe(g, v.first) << " has " << k << " copies";
      // A forward copy a backward contraction reads: the activation its weight gradient needs.
      for (const Node& n : g.nodes())
        if (n.op == Op::Contract && n.backward)
          for (int i : n.inputs) shared += !g.node(g.node(i).inputs[0]).backward && g.node(g.node(i).inputs[0]).op == Op::StoreBf16;
      EXPECT_GT(contractions, 0);
      EXPECT_GT(shared, 0) << what;
      // Every weight a contraction reads, once a pass: q, k, v, o, gate, up, down per layer and the LM head.
      int weights = 0;
      for (const Value& v : b.model.params) weights += g.node(v.id).type.rank() >= 2 && v.node().name.find("embed") == std::string::npos;
      EXPECT_EQ(weight_copies, 2 * weights) << what;
      // The rest of the graph is the f32 schedule's: the same ops but the copies and their loads.
      auto ops = [](const Plan& p) {
        std::map<Op, int> k;
        for (const Node& n : p.model.graph->nodes())
          if (n.op != Op::StoreBf16 && n.op != Op::LoadBf16) ++k[n.op];
        return k;
      };
      EXPECT_EQ(ops(a), ops(b)) << what;
      std::printf("  %-28s %3d contractions, %3d copies (%d of weights); activations %6.1f -> %6.1f MiB\n", what.c_str(),
                  contractions, b.stored_bf16(), weight_copies, static_cast<double>(a.memory.activations) / (1 << 20),
                  static_cast<double>(b.memory.activations) / (1 << 20));
    }
  }
  // On a GPU cluster an f32 plan prices f32 kernels at the f32 peak and the
  // contractions that read bf16 copies at the bf16 peak, as bf16-mixed
  // prices every kernel.
  const Cluster h200 = Cluster::named("8xH200");
  auto contract_s = [](const Plan& p) {
    double t = 0;
    for (const StageCost& c : p.stages) t += c.kind.rfind("contract", 0) == 0 ? c.time_s : 0;
    return t;
  };
  Schedule s = Schedule::named("default");
  const Plan f32 = plan(llama::llama_builder(), {kTiny, 1, 4096}, s, h200);
  const Plan mixed = plan(llama::llama_builder(), {kTiny, 1, 4096, "bf16-mixed"}, s, h200);
  s.contract_precision = "bf16";
  const Plan bf16 = plan(llama::llama_builder(), {kTiny, 1, 4096}, s, h200);
  const double peaks = h200.peak_flops.at("bf16") / h200.peak_flops.at("f32");
  std::printf("  8xH200, tiny at 4096: contractions %.3f ms in f32, %.3f ms reading bf16 copies, %.3f ms bf16-mixed "
              "(peaks %.1fx apart)\n", 1e3 * contract_s(f32), 1e3 * contract_s(bf16), 1e3 * contract_s(mixed), peaks);
  EXPECT_GT(contract_s(f32), 2 * contract_s(bf16));  // (small GEMMs: calls and bytes weigh too)
  EXPECT_LT(contract_s(f32), peaks * contract_s(bf16));  // (the bytes and calls cost the same)
  EXPECT_NEAR(contract_s(bf16), contract_s(mixed), 0.5 * contract_s(mixed));  // (bf16-mixed moves half the bytes)
  EXPECT_LT(bf16.compute_s, f32.compute_s);
  EXPECT_THAT(error_of([&] { plan(llama::llama_builder(), {kTiny, 1, 1024, "bf16-mixed"}, s, Cluster::named("8xH200")); }),
              ::testing::AllOf(::testing::HasSubstr("contract_precision \"bf16\""), ::testing::HasSubstr("fix:")));
}

// A cluster says what its ranks are; a plan on GPUs counts the kernels a GPU
// library runs (the CUDA attention kernels, Halide's weight gradients,
// contractions through cuBLAS), as halyard_aot builds them for a GPU target,
// whether or not the cluster has a host link. Before, it counted the CPU
// library's.
TEST(Plan, AGpuClusterPlansTheKernelsOfAGpu) {
  const Cluster h200 = Cluster::named("8xH200");
  EXPECT_EQ(h200.device, "cuda");
  EXPECT_EQ(Cluster::named("local-cpu").device, "cpu");
  EXPECT_EQ(Cluster::parse(h200.to_json(), "again").device, "cuda");
  EXPECT_EQ(Cluster::parse(R"({"host_link": {"alpha_s": 1e-5, "beta_s_per_byte": 1e-10}})", "old.json").device, "cuda");
  EXPECT_THAT(error_of([] { Cluster::parse(R"({"device": "tpu"})", "c.json"); }),
              ::testing::AllOf(::testing::HasSubstr("device \"tpu\""), ::testing::HasSubstr("legal: \"cpu\" or \"cuda\"")));
  EXPECT_THAT(error_of([] { Cluster::parse(R"({"device": "cpu", "host_link": {"beta_s_per_byte": 1e-10}})", "c.json"); }),
              ::testing::AllOf(::testing::HasSubstr("device \"cpu\" and a host_link"), ::testing::HasSubstr("fix:")));
  Cluster no_link = h200;
  no_link.host_link = {};
  const Schedule s = Schedule::named("default");
  for (const Cluster& c : {h200, no_link}) {
    const Plan p = plan(llama::llama_builder(), {kTiny, 1, 1024}, s, c);
    EXPECT_EQ(p.schedule.attention_kernel, "library");
    EXPECT_EQ(p.schedule.weight_grad_kernel, "halide");
    EXPECT_EQ(p.schedule.contract_kernel, "cublas");
    int gemms = 0, attention = 0;
    for (const Stage& st : p.train.stages) {
      const Op op = p.model.graph->node(st.root).op;
      const bool is_attention = op == Op::Attention || op == Op::AttentionGradK;
      EXPECT_EQ(st.library, is_attention) << describe(*p.model.graph, st.root);
      attention += st.library;
      gemms += st.gemm;
    }
    EXPECT_GT(gemms, 0);
    EXPECT_GE(attention, 2 * 2);  // tiny.json has 2 layers: a forward and a backward each
    // What halyard_aot plans for a CUDA target is the same plan.
    const Plan aot = plan(llama::llama_builder(), {kTiny, 1, 1024}, s.on_gpu(true), c);
    EXPECT_EQ(aot.memory.total(), p.memory.total());
    EXPECT_DOUBLE_EQ(aot.step_s, p.step_s);
  }
  const Plan cpu = plan(llama::llama_builder(), {kTiny, 1, 1024}, s, Cluster::named("local-cpu"));
  EXPECT_EQ(cpu.schedule.attention_kernel, "library");
  int library = 0;
  for (const Stage& st : cpu.train.stages) library += st.library;
  EXPECT_GT(library, 0);
}

// Offloading a bf16 copy moves half the bytes.
TEST(Plan, OffloadedBf16CopiesMoveHalfTheBytes) {
  const Cluster h200 = Cluster::named("8xH200");
  Schedule off = Schedule::named("default"), off_bf16 = off;
  off.values.push_back({"*", "offload", "", ""});
  off_bf16.values.push_back({"*", "offload", "", "bf16"});
  const Plan a = plan(llama::llama_builder(), {kTiny, 1, 4096}, off, h200);
  const Plan b = plan(llama::llama_builder(), {kTiny, 1, 4096}, off_bf16, h200);
  const double ratio = static_cast<double>(b.train_program.offload_bytes) / static_cast<double>(a.train_program.offload_bytes);
  std::printf("  offload arena %.1f MiB f32, %.1f MiB bf16 (%.2fx); offload time %.3f -> %.3f ms\n",
              static_cast<double>(a.train_program.offload_bytes) / (1 << 20),
              static_cast<double>(b.train_program.offload_bytes) / (1 << 20), ratio, 1e3 * a.offload_s, 1e3 * b.offload_s);
  EXPECT_LT(ratio, 0.56);
  EXPECT_GT(ratio, 0.4);
  EXPECT_LT(b.offload_s, a.offload_s);
  int copies_away = 0;
  for (const PlannedBuffer& pb : b.train_program.buffers)
    if (pb.evict >= 0) copies_away += b.model.graph->node(pb.node).op == Op::StoreBf16;
  EXPECT_GT(copies_away, 0);
}

TEST(Plan, StoreRulesAreChecked) {
  EXPECT_THAT(error_of([] { Schedule::parse(R"({"values": [{"match": "*", "store": "fp8"}]})", "s.json"); }),
              ::testing::AllOf(::testing::HasSubstr("store \"fp8\""), ::testing::HasSubstr("store \"f32\" | \"bf16\"")));
  const Schedule s = Schedule::parse(R"({"values": [{"match": "op:attention", "store": "bf16"}]})", "s.json");
  EXPECT_EQ(Schedule::parse(s.to_json(), "again"), s);
  EXPECT_THAT(error_of([] {
                plan(llama::llama_builder(), {kMicro, 1, 16},
                     Schedule::parse(R"({"values": [{"match": "op:attention_lse", "store": "bf16"}]})", "s.json"),
                     Cluster::named("local-cpu"));
              }),
              ::testing::AllOf(::testing::HasSubstr("attention_lse is kept in f32"), ::testing::HasSubstr("legal:")));
  EXPECT_THAT(error_of([&] { plan(llama::llama_builder(), {kMicro, 1, 16, "bf16-mixed"}, s, Cluster::named("8xH200")); }),
              ::testing::AllOf(::testing::HasSubstr("counts every value in bf16 already"), ::testing::HasSubstr("fix:")));
}

TEST(Plan, OffloadedValuesLeaveTheDeviceBetweenForwardAndBackward) {
  const Cluster h200 = Cluster::named("8xH200");
  const Plan kept = plan(llama::llama_builder(), {kTiny, 1, 1024}, Schedule::named("default"), h200);
  Schedule s = Schedule::named("default");
  s.values.push_back({"*", "offload", "", ""});
  const Plan off = plan(llama::llama_builder(), {kTiny, 1, 1024}, s, h200);
  const Program& prog = off.train_program;
  int offloaded = 0;
  for (size_t b = 0; b < prog.buffers.size(); ++b) {
    const PlannedBuffer& pb = prog.buffers[b];
    if (pb.evict < 0) continue;
    ++offloaded;
    ASSERT_LT(pb.evict, pb.reload);
    EXPECT_EQ(prog.calls[static_cast<size_t>(pb.evict)].move, PlannedCall::Move::Evict);
    EXPECT_EQ(prog.calls[static_cast<size_t>(pb.reload)].move, PlannedCall::Move::Reload);
    EXPECT_EQ(prog.calls[static_cast<size_t>(pb.evict)].args, std::vector<int>{static_cast<int>(b)});
    for (int c = pb.evict + 1; c < pb.reload; ++c)  // nothing reads it, nor a view of it, while it is away
      for (int a : prog.calls[static_cast<size_t>(c)].args)
        for (int v = a; v >= 0; v = prog.buffers[static_cast<size_t>(v)].kind == BufferKind::View ? prog.buffers[static_cast<size_t>(v)].index : -1)
          EXPECT_NE(v, static_cast<int>(b)) << "call " << c;
  }
  EXPECT_GE(offloaded, 2 * 8);  // each layer's norms, q and k after RoPE, v, attention, gate, up, SiLU·up
  for (const PlannedBuffer& pb : off.forward_program.buffers) EXPECT_LT(pb.evict, 0);  // no backward to wait for
  // Sound arenas: buffers whose ranges meet never share bytes.
  auto sound = [&](auto ranges, auto offset) {
    for (size_t i = 0; i < prog.buffers.size(); ++i)
      for (size_t j = i + 1; j < prog.buffers.size(); ++j) {
        const PlannedBuffer &a = prog.buffers[i], &b = prog.buffers[j];
        if (ranges(a).empty() || ranges(b).empty()) continue;
        bool meet = false;
        for (auto [a0, a1] : ranges(a))
          for (auto [b0, b1] : ranges(b)) meet = meet || (a0 <= b1 && b0 <= a1);
        if (meet) {
          EXPECT_TRUE(offset(a) + a.bytes <= offset(b) || offset(b) + b.bytes <= offset(a))
              << off.model.graph->node(a.node).name << " and " << off.model.graph->node(b.node).name;
        }
      }
  };
  // (A buffer written in place holds its bytes from the call after the one
  // where the input it takes over dies: held_ranges.)
  sound([](const PlannedBuffer& b) { return b.kind == BufferKind::Arena ? b.held_ranges() : std::vector<std::pair<int, int>>{}; },
        [](const PlannedBuffer& b) { return b.offset; });
  sound([](const PlannedBuffer& b) { return b.evict >= 0 ? std::vector<std::pair<int, int>>{{b.evict, b.reload}} : std::vector<std::pair<int, int>>{}; },
        [](const PlannedBuffer& b) { return b.host_offset; });
  std::printf("  tiny Llama seq 1024 on 8xH200: arena %.2f MiB kept, %.2f MiB with every saved value offloaded "
              "(%d values, %.2f MiB on the host), copies %.3f ms a step\n",
              kept.train_program.arena_bytes / 1048576.0, prog.arena_bytes / 1048576.0, offloaded,
              prog.offload_bytes / 1048576.0, off.offload_s * 1e3);
  EXPECT_LT(prog.arena_bytes, kept.train_program.arena_bytes * 3 / 4);
  EXPECT_GT(prog.offload_bytes, 0);
  EXPECT_LT(off.memory.total(), kept.memory.total());
  EXPECT_EQ(off.memory.offloaded, prog.offload_bytes);
  EXPECT_GT(off.offload_s, 0);
  EXPECT_DOUBLE_EQ(off.step_s, off.compute_s + off.exposed_communication_s + off.optimizer_s + off.offload_s);
  EXPECT_EQ(kept.offload_s, 0);
  EXPECT_THAT(off.report(), ::testing::HasSubstr("offloaded to the host"));
  EXPECT_THAT(off.summary_json(), ::testing::HasSubstr("\"offloaded_bytes_per_rank\""));
  EXPECT_THAT(kept.summary_json(), ::testing::Not(::testing::HasSubstr("offloaded")));
}

// Scoring a plan compiles nothing: Llama-3.1-8B, 131,072 tokens over 8 ranks.
TEST(Plan, ScoringAnEightBillionParameterPlan) {
  Schedule s = Schedule::named("ulysses_checkpoint");
  s.mesh.sp = 8;
  const std::string cfg = HALYARD_SOURCE_DIR "/examples/llama/configs/llama-3.1-8b.json";
  const auto t0 = std::chrono::steady_clock::now();
  const Plan p = plan(llama::llama_builder(), {cfg, 1, 131072}, s, Cluster::named("8xA100-80GB"));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("  Llama-3.1-8B, seq 131072, sp=8: plan scored in %.1f ms (%d nodes, %zu stages); %lld parameters; "
              "predicted peak %.1f GiB per rank, step %.2f s\n",
              ms, p.model.graph->size(), p.train.stages.size(), static_cast<long long>(p.num_params),
              static_cast<double>(p.memory.total()) / (1 << 30), p.step_s);
  EXPECT_NEAR(static_cast<double>(p.num_params), 8.03e9, 0.01e9);
  EXPECT_GT(p.step_s, 0);
}

}  // namespace
}  // namespace halyard
