// Fuzz target: config.json parsing (examples/llama/llama_config.h).
//
// Contract under test: LlamaConfig::parse(text, what) returns a config that
// satisfies its own rules or throws halyard::UserError naming `what`. Any
// other exception (nlohmann's type_error from a key of the wrong JSON type,
// std::out_of_range), a crash, a sanitizer report or a hang is a bug. An
// accepted config keeps its rules (positive sizes, heads a multiple of the
// kv heads, an even head_dim, finite positive rope_theta and rms_norm_eps),
// and to_json() -> parse() gives it back field for field: nothing a config
// says is lost or silently replaced by a default.
//
// Corpus: tests/fuzz/corpus/llama_config (examples/llama/configs/*.json,
// tests/fixtures/llama_micro.json, and inputs that once broke the parser);
// dictionary: llama_config.dict. Run: see fuzz_safetensors.cpp.
#include <cmath>
#include <cstdint>
#include <string>

#include "dsl/error.h"
#include "examples/llama/llama_config.h"
#include "tests/fuzz/fuzz_check.h"

using halyard::UserError;
using halyard::llama::LlamaConfig;

namespace {

bool same(const LlamaConfig& a, const LlamaConfig& b) {
  return a.hidden_size == b.hidden_size && a.num_hidden_layers == b.num_hidden_layers &&
         a.num_attention_heads == b.num_attention_heads && a.num_key_value_heads == b.num_key_value_heads &&
         a.head_dim == b.head_dim && a.intermediate_size == b.intermediate_size && a.vocab_size == b.vocab_size &&
         a.rope_theta == b.rope_theta && a.rms_norm_eps == b.rms_norm_eps &&
         a.tie_word_embeddings == b.tie_word_embeddings && a.rope_scaling == b.rope_scaling;
}

bool finite_positive(double v) { return std::isfinite(v) && v > 0; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  LlamaConfig c;
  try {
    c = LlamaConfig::parse(text, "fuzz/config.json");
  } catch (const UserError&) {
    return 0;  // the documented answer to a bad config
  }
  HALYARD_FUZZ_REQUIRE(c.hidden_size > 0 && c.num_hidden_layers > 0 && c.num_attention_heads > 0 &&
                           c.num_key_value_heads > 0 && c.head_dim > 0 && c.intermediate_size > 0 &&
                           c.vocab_size > 0,
                       "an accepted config has a size <= 0");
  HALYARD_FUZZ_REQUIRE(c.num_attention_heads % c.num_key_value_heads == 0 && c.head_dim % 2 == 0,
                       "an accepted config breaks the heads or head_dim rule");
  HALYARD_FUZZ_REQUIRE(finite_positive(c.rope_theta) && finite_positive(c.rms_norm_eps),
                       "an accepted config has a rope_theta or rms_norm_eps that is not finite and positive");
  if (c.rope_scaling.factor > 0)
    HALYARD_FUZZ_REQUIRE(finite_positive(c.rope_scaling.factor) && finite_positive(c.rope_scaling.low_freq_factor) &&
                             finite_positive(c.rope_scaling.high_freq_factor) &&
                             finite_positive(c.rope_scaling.original_max_position_embeddings) &&
                             c.rope_scaling.high_freq_factor > c.rope_scaling.low_freq_factor,
                         "an accepted rope_scaling is not finite and positive with high > low");

  const std::string json = c.to_json();
  LlamaConfig again;
  try {
    again = LlamaConfig::parse(json, "fuzz/config.json (rewritten)");
  } catch (const UserError& e) {
    HALYARD_FUZZ_REQUIRE(false, e.what());
  }
  HALYARD_FUZZ_REQUIRE(same(c, again), json.c_str());
  return 0;
}
