// Fuzz target: schedule JSON parsing (schedules/schedule.h).
//
// Contract under test: Schedule::parse(text, what) returns a schedule or throws
// halyard::UserError naming `what`. Any other exception (nlohmann's
// type_error, std::out_of_range), a crash, a sanitizer report or a hang is a
// bug. An accepted schedule keeps its promises: to_json() -> parse() gives back
// an equal Schedule (it is plain data), str() prints it, its mesh has
// dp x sp >= 1 ranks and a ZeRO stage of 0, 1 or 3, and applying it to a
// model (the micro Llama of tests/fixtures/llama_micro.json: check(), then
// keep/compute/strategy for every value) answers or throws UserError. Its
// patterns are user text run against every label, so this also guards
// glob_match against inputs that would make it hang.
//
// Corpus: tests/fuzz/corpus/schedule (examples/llama/schedules/*.json,
// tests/fixtures/{tiled_micro,ulysses_checkpoint_tiled}.json, every preset's
// to_json(), and inputs that once broke the parser); dictionary:
// schedule.dict. Run: see fuzz_safetensors.cpp.
#include <cstdint>
#include <string>

#include "dsl/error.h"
#include "examples/llama/llama_config.h"
#include "examples/llama/llama_model.h"
#include "schedules/schedule.h"
#include "tests/fuzz/fuzz_check.h"

using halyard::Graph;
using halyard::Node;
using halyard::Op;
using halyard::Schedule;
using halyard::UserError;

namespace {

// The micro Llama's forward graph, built once (2 layers, 8 heads, 2 kv heads).
const Graph& model() {
  static const halyard::llama::LlamaGraph g = [] {
    const auto c = halyard::llama::LlamaConfig::parse(
        R"({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 8, "intermediate_size": 128, "vocab_size": 256})",
        "micro");
    return halyard::llama::build_llama(c, /*batch=*/2, /*seq=*/24);
  }();
  return *g.graph;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const Graph& g = model();
  Schedule s;
  try {
    s = Schedule::parse(text, "fuzz/schedule.json");
  } catch (const UserError&) {
    return 0;  // the documented answer to a bad schedule
  }
  const std::string json = s.to_json();
  try {
    HALYARD_FUZZ_REQUIRE(Schedule::parse(json, "fuzz/schedule.json (rewritten)") == s, json.c_str());
  } catch (const UserError& e) {
    HALYARD_FUZZ_REQUIRE(false, e.what());
  }
  (void)s.str();
  HALYARD_FUZZ_REQUIRE(s.mesh.dp >= 1 && s.mesh.sp >= 1 && s.mesh.ranks() >= 1, "an accepted mesh has no ranks");
  HALYARD_FUZZ_REQUIRE(s.mesh.zero == 0 || s.mesh.zero == 1 || s.mesh.zero == 3, "an accepted ZeRO stage is not 0, 1 or 3");

  try {
    s.check(g);
  } catch (const UserError&) {
  }
  for (const Node& n : g.nodes()) {
    (void)s.keep(n);
    (void)s.compute(n);
    if (n.op == Op::Attention) (void)s.strategy(n);
  }
  if (auto remat = s.rematerialize())
    for (const Node& n : g.nodes()) (void)remat(n);
  return 0;
}
