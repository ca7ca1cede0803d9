// Partitioning and the static memory plan, without compiling anything:
// layers share kernels, live buffers never overlap in the arena, recomputing
// cheap ops shrinks it, and bad schedules are user errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "dsl/autodiff.h"
#include "dsl/error.h"
#include "dsl/op_table.h"
#include "examples/llama/llama_model.h"
#include "schedules/partition.h"
#include "schedules/program.h"
#include "schedules/sharding.h"
#include "schedules/tiling.h"

namespace halyard {
namespace {

struct Planned {
  llama::LlamaGraph m;
  Partition part;
  Program prog;
};

// Differentiates a forward graph under schedule s and plans its train step.
void plan_step(Value loss, const std::vector<Value>& wrt, const Schedule& s, Partition& part, Program& prog) {
  Gradients g = grad(loss, wrt, GradOptions{s.rematerialize()});
  std::vector<int> params, grads, outs;
  for (const Value& v : wrt) {
    params.push_back(v.id);
    grads.push_back(g[v].id);
  }
  outs = grads;
  outs.push_back(loss.id);
  part = partition(*loss.graph, outs, s);
  prog = plan_program(*loss.graph, part, params, grads, loss.id);
}

Planned plan(int layers, const std::string& schedule, int64_t seq = 64) {
  auto cfg = llama::LlamaConfig::load(HALYARD_SOURCE_DIR "/tests/fixtures/llama_micro.json");
  cfg.num_hidden_layers = layers;
  Planned p{llama::build_llama(cfg, 1, seq), {}, {}};
  plan_step(p.m.loss, p.m.params, Schedule::named(schedule), p.part, p.prog);
  return p;
}

size_t distinct_kernels(const Partition& p) {
  std::set<std::string> s;
  for (const Stage& st : p.stages) s.insert(st.signature);
  return s.size();
}

TEST(Partition, LayersShareKernels) {
  const size_t two = distinct_kernels(plan(2, "default").part);
  const size_t eight = distinct_kernels(plan(8, "default").part);
  std::printf("  distinct kernels: %zu for 2 layers, %zu for 8 layers\n", two, eight);
  EXPECT_EQ(two, eight);
  EXPECT_GT(plan(8, "default").part.stages.size(), plan(2, "default").part.stages.size());
}

// Sequence tiling: the plan of the tiled graph, as halyard_aot makes it.
struct TiledPlan {
  RebuiltGraph m;
  Partition part;
  Program prog;
};

TiledPlan plan_tiled(const std::string& schedule, int64_t seq, int64_t tile) {
  auto cfg = llama::LlamaConfig::load(HALYARD_SOURCE_DIR "/tests/fixtures/llama_micro.json");
  auto src = llama::build_llama(cfg, 1, seq);
  Schedule s = Schedule::named(schedule);
  s.seq_tile = tile;
  s.values.push_back(recompute_seq_tiles_rule());
  TiledPlan p{tile_sequence(*src.graph, src.loss.id, tile), {}, {}};
  plan_step(p.m.loss, p.m.params, s, p.part, p.prog);
  return p;
}

// Buffers that share bytes are never held at the same call. A buffer
// written in place holds its bytes from the call after the handover; the
// buffer it took over holds them up to that call (PlannedBuffer::
// held_ranges), even where later tiles still read their own rows of it.
TEST(Partition, LiveBuffersNeverOverlap) {
  for (const char* sched : {"default", "recompute", "tiled"}) {
    const bool tiled = std::string(sched) == "tiled";
    const Planned untiled = tiled ? Planned{} : plan(2, sched);
    const TiledPlan t = tiled ? plan_tiled("recompute", 256, 64) : TiledPlan{};
    struct {
      const Program& prog;
      const Partition& part;
    } p{tiled ? t.prog : untiled.prog, tiled ? t.part : untiled.part};
    const auto& b = p.prog.buffers;
    const Graph& g = tiled ? *t.m.graph : *untiled.m.graph;
    int64_t total = 0;
    for (size_t x = 0; x < b.size(); ++x) {
      if (b[x].kind != BufferKind::Arena) continue;
      total += b[x].bytes;
      EXPECT_EQ(b[x].offset % 128, 0);
      EXPECT_LE(b[x].offset + b[x].bytes, p.prog.arena_bytes);
      for (size_t y = x + 1; y < b.size(); ++y) {
        if (b[y].kind != BufferKind::Arena) continue;
        bool live_together = false;
        for (auto [x0, x1] : b[x].held_ranges())
          for (auto [y0, y1] : b[y].held_ranges()) live_together = live_together || (x0 <= y1 && y0 <= x1);
        const bool overlap = b[x].offset < b[y].offset + b[y].bytes && b[y].offset < b[x].offset + b[x].bytes;
        EXPECT_FALSE(live_together && overlap) << sched << ": buffers " << x << " and " << y;
      }
    }
    std::printf("  %s: arena %lld bytes for %lld bytes of activations (%zu stages)\n", sched,
                static_cast<long long>(p.prog.arena_bytes), static_cast<long long>(total), p.part.stages.size());
    EXPECT_LT(p.prog.arena_bytes, total);  // reuse happened
    // Each handover: at the call that writes the output, over the input's
    // bytes (the same type), by an elementwise op. The input dies there, or
    // (a running sum adding one tile's rows) is read after it only through
    // views of other tiles' rows.
    int in_place = 0, over_rows = 0;
    for (const PlannedBuffer& o : b) {
      if (o.in_place_of < 0) continue;
      ++in_place;
      const PlannedBuffer& i = b[static_cast<size_t>(o.in_place_of)];
      EXPECT_EQ(i.handed_over, o.first);
      EXPECT_EQ(i.offset, o.offset);
      EXPECT_EQ(g.node(i.node).type, g.node(o.node).type);
      EXPECT_TRUE(op_info(g.node(o.node).op).elementwise);
      if (i.last == o.first) continue;
      ++over_rows;
      const Node& sum = g.node(o.node);
      ASSERT_EQ(sum.op, Op::Add);
      const Node& part = g.node(sum.inputs[sum.inputs[0] == i.node ? 1 : 0]);
      ASSERT_EQ(part.op, Op::PadSeq);
      const int64_t lo = part.attrs.offset, hi = lo + g.node(part.inputs[0]).type.size("seq");
      std::set<int> holders;  // the buffers whose bytes the sum took over
      for (int h = o.in_place_of; h >= 0; h = b[static_cast<size_t>(h)].in_place_of) holders.insert(h);
      for (size_t c = static_cast<size_t>(o.first) + 1; c < p.prog.calls.size(); ++c)
        for (int a : p.prog.calls[c].args) {
          EXPECT_FALSE(holders.count(a)) << "read whole after its handover";
          const PlannedBuffer& v = b[static_cast<size_t>(a)];
          if (v.kind == BufferKind::View && holders.count(v.index)) {
            const int64_t rows = g.node(v.node).type.size("seq");
            EXPECT_TRUE(v.offset + rows <= lo || hi <= v.offset) << "rows the sum changed, read after it";
          }
        }
    }
    EXPECT_GT(in_place, 0) << sched;  // the backward's sums of gradient parts at least
    // In the tiled step, the residual stream's gradient takes each MLP
    // tile's part as the tile finishes, while later tiles read their rows.
    if (tiled) EXPECT_GT(over_rows, 0);
    std::printf("  %s: %d buffers written in place, %d of them while later tiles read other rows\n", sched, in_place,
                over_rows);
  }
}

TEST(Partition, RecomputeShrinksArena) {
  const int64_t d = plan(2, "default", 512).prog.arena_bytes, r = plan(2, "recompute", 512).prog.arena_bytes,
                c = plan(2, "checkpoint", 512).prog.arena_bytes;
  std::printf("  arena at seq 512: default %lld, recompute %lld, checkpoint %lld bytes\n", static_cast<long long>(d),
              static_cast<long long>(r), static_cast<long long>(c));
  EXPECT_LT(r, d);
  EXPECT_LT(c, r);
}

TEST(Partition, BadScheduleIsUserError) {
  auto msg = [](const std::string& json) {
    try {
      Schedule::parse(json, "s.json");
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(msg(R"({"recompute": ["contract"]})"),
              ::testing::AllOf(::testing::HasSubstr("recompute(contract)"), ::testing::HasSubstr("only cheap ops can be recomputed inside their consumers.\nlegal: add, mul, bias_add, silu")));
  EXPECT_THAT(msg(R"({"tile": 4})"), ::testing::HasSubstr("unknown or ill-typed key \"tile\""));
  EXPECT_THAT(msg(R"({"autoscheduler": "Li2018"})"), ::testing::HasSubstr("legal: \"\" (hand-written schedules) or \"Adams2019\""));
  EXPECT_THAT(msg(R"({"autoscheduler_beam_size": 4})"), ::testing::HasSubstr("without an autoscheduler"));
  EXPECT_THAT(msg(R"({"autoscheduler": "Adams2019", "autoscheduler_beam_size": 1})"),
              ::testing::HasSubstr("legal: 2 to 1024"));
  EXPECT_THAT(msg(R"({"autoscheduler": "Adams2019", "autoscheduler_beam_size": 4096})"),
              ::testing::HasSubstr("legal: 2 to 1024"));
  EXPECT_THROW(Schedule::named("/nonexistent.json"), UserError);
  const Schedule narrow = Schedule::parse(R"({"autoscheduler": "Adams2019", "autoscheduler_beam_size": 2})", "narrow");
  EXPECT_EQ(Schedule::parse(narrow.to_json(), "round trip"), narrow);
  EXPECT_EQ(Schedule::parse(Schedule::named("recompute").to_json(), "round trip"), Schedule::named("recompute"));
}

// No buffer of the tiled step, forward or backward, holds [seq, ffn] or
// [seq, vocab] whole: the widest has a tile's rows. At a sequence much
// longer than the model is wide, that shrinks the arena.
TEST(Tiling, WideValuesNeverExistWhole) {
  for (const char* sched : {"default", "recompute", "checkpoint"}) {
    const TiledPlan p = plan_tiled(sched, 1024, 128);
    int wide = 0;
    for (const PlannedBuffer& b : p.prog.buffers) {
      const Node& n = p.m.graph->node(b.node);
      if (!is_wide(n)) continue;
      ++wide;
      EXPECT_LE(n.type.size("seq"), 128) << sched << ": " << describe(*p.m.graph, b.node);
    }
    EXPECT_GT(wide, 0) << sched;
    const Planned whole = plan(2, sched, 1024);
    std::printf("  %s: arena %lld bytes tiled (128 of 1024 tokens) vs %lld untiled; %d wide buffers, all tiles\n", sched,
                static_cast<long long>(p.prog.arena_bytes), static_cast<long long>(whole.prog.arena_bytes), wide);
    EXPECT_LT(p.prog.arena_bytes, whole.prog.arena_bytes) << sched;
  }
}

// A ragged last tile (64 = 24 + 24 + 16) and tiles that share kernels.
TEST(Tiling, RaggedTilesShareKernels) {
  const TiledPlan even = plan_tiled("recompute", 64, 16), ragged = plan_tiled("recompute", 64, 24);
  std::set<std::string> sig_even, sig_ragged;
  for (const Stage& st : even.part.stages) sig_even.insert(st.signature);
  for (const Stage& st : ragged.part.stages) sig_ragged.insert(st.signature);
  const size_t untiled = distinct_kernels(plan(2, "recompute", 64).part);
  std::printf("  distinct stage signatures: %zu untiled, %zu with 4 tiles of 16, %zu with tiles 24+24+16\n", untiled,
              sig_even.size(), sig_ragged.size());
  EXPECT_LT(sig_even.size(), 2 * untiled);
  EXPECT_GT(sig_ragged.size(), sig_even.size());
}

TEST(Tiling, BadTileIsAUserError) {
  try {
    Schedule::parse(R"({"seq_tile": -4})", "t.json");
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("seq_tile -4"));
  }
}

// Sharding: types print their split, the all-to-alls surround attention,
// and degrees Ulysses cannot split are user errors naming the legal ones.
TEST(Sharding, TypesPrintTheSplitAndAttentionGetsAllToAlls) {
  auto cfg = llama::LlamaConfig::load(HALYARD_SOURCE_DIR "/tests/fixtures/llama_micro.json");
  auto src = llama::build_llama(cfg, 1, 12);  // one rank's slice of 48 tokens
  RebuiltGraph m = shard_sequence(*src.graph, src.loss.id, Schedule::named("ulysses"), 4);
  const std::string text = print(*m.graph);
  EXPECT_THAT(text, ::testing::HasSubstr("f32[batch=1, seq=48@sp, model=64]"));
  EXPECT_THAT(text, ::testing::HasSubstr("f32[batch=1, seq=48, heads=8@sp, head_dim=8]"));
  EXPECT_THAT(text, ::testing::HasSubstr("f32[batch=1, seq=48, kv_heads=2@sp, head_dim=8]"));  // replicated
  int to_heads = 0, to_seq = 0, gathers = 0, reduces = 0;
  for (const Node& n : m.graph->nodes()) {
    to_heads += n.op == Op::SeqToHeads;
    to_seq += n.op == Op::HeadsToSeq;
    gathers += n.op == Op::GatherSeq;
    reduces += n.op == Op::AllReduce;
  }
  EXPECT_EQ(to_heads, 3 * cfg.num_hidden_layers);  // q, k, v
  EXPECT_EQ(to_seq, cfg.num_hidden_layers);        // the output
  EXPECT_EQ(gathers, 1);                           // positions, shared by the layers
  EXPECT_EQ(reduces, 2);                           // the token count and the loss
  // The backward mirrors them: four more all-to-alls per layer.
  Gradients g = grad(m.loss, m.params);
  int all = 0;
  for (const Node& n : m.graph->nodes()) all += n.op == Op::SeqToHeads || n.op == Op::HeadsToSeq;
  EXPECT_EQ(all, 8 * cfg.num_hidden_layers);
}

TEST(Sharding, DegreeUlyssesCannotSplitIsAUserError) {
  auto cfg = llama::LlamaConfig::load(HALYARD_SOURCE_DIR "/tests/fixtures/llama_micro.json");
  auto src = llama::build_llama(cfg, 1, 8);
  try {
    shard_sequence(*src.graph, src.loss.id, Schedule::named("ulysses"), 3);
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("heads=8, kv_heads=2"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("legal sp degrees for this model: 1, 2, 4, 8; or \"ring\""));
  }
  try {
    shard_sequence(*src.graph, src.loss.id, Schedule::named("recompute"), 2);
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("keeps the whole sequence on each rank"));
  }
  try {
    Schedule::parse(R"({"split_sequence": "sp"})", "s.json");
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("a split sequence needs a head redistribution"));
  }
  try {
    Schedule::parse(R"({"split_sequence": "sp", "redistribute_heads": "hybrid"})", "s.json");
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("needs its Ulysses degree"));
  }
  // Ring takes the degree Ulysses cannot.
  shard_sequence(*src.graph, src.loss.id, Schedule::named("ring"), 3);
}

}  // namespace
}  // namespace halyard
