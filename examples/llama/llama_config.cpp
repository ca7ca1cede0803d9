// Reading and validating a Llama config.json (see llama_config.h).
#include "examples/llama/llama_config.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dsl/error.h"

namespace halyard::llama {
namespace {

using nlohmann::json;

struct Reader {
  const json& j;
  const std::string& what;

  [[noreturn]] void fail(const std::string& msg) const {
    throw UserError("error: config \"" + what + "\"\n" + msg);
  }
  int64_t positive_int(const char* key, bool required = true, int64_t fallback = 0) const {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) fail(std::string("missing key \"") + key + "\".\nlegal: a positive integer, as in HF's LlamaConfig.");
      return fallback;
    }
    const json& v = j[key];
    if (!v.is_number_integer() || v.get<int64_t>() <= 0)
      fail(std::string("key \"") + key + "\" is " + v.dump() + ".\nlegal: a positive integer.");
    return v.get<int64_t>();
  }
  double positive_number(const char* key, double fallback) const {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    const json& v = j[key];
    if (!v.is_number() || !(v.get<double>() > 0))
      fail(std::string("key \"") + key + "\" is " + v.dump() + ".\nlegal: a positive number.");
    return v.get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_boolean()) fail(std::string("key \"") + key + "\" is " + j[key].dump() + ".\nlegal: true or false.");
    return j[key].get<bool>();
  }
};

}  // namespace

LlamaConfig LlamaConfig::parse(const std::string& text, const std::string& what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw UserError("error: config \"" + what + "\" is not valid JSON: " + e.what() +
                    "\nlegal: a Hugging Face config.json object.");
  }
  if (!j.is_object())
    throw UserError("error: config \"" + what + "\" is JSON " + std::string(j.type_name()) +
                    ", not an object.\nlegal: a Hugging Face config.json object.");
  Reader r{j, what};
  LlamaConfig c;
  c.hidden_size = r.positive_int("hidden_size");
  c.num_hidden_layers = r.positive_int("num_hidden_layers");
  c.num_attention_heads = r.positive_int("num_attention_heads");
  c.num_key_value_heads = r.positive_int("num_key_value_heads", false, c.num_attention_heads);
  c.intermediate_size = r.positive_int("intermediate_size");
  c.vocab_size = r.positive_int("vocab_size");
  c.rope_theta = r.positive_number("rope_theta", 10000.0);
  c.rms_norm_eps = r.positive_number("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  if (c.hidden_size % c.num_attention_heads != 0 && !j.contains("head_dim"))
    r.fail("hidden_size (" + std::to_string(c.hidden_size) + ") is not a multiple of num_attention_heads (" +
           std::to_string(c.num_attention_heads) + ") and no head_dim is given.\nlegal: give head_dim, or heads dividing hidden_size.");
  c.head_dim = r.positive_int("head_dim", false, c.hidden_size / c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail("num_attention_heads (" + std::to_string(c.num_attention_heads) +
           ") is not a multiple of num_key_value_heads (" + std::to_string(c.num_key_value_heads) +
           ").\nlegal: num_key_value_heads dividing num_attention_heads.");
  if (c.head_dim % 2 != 0)
    r.fail("head_dim (" + std::to_string(c.head_dim) + ") is odd; RoPE rotates pairs.\nlegal: an even head_dim.");
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    r.fail("hidden_act is " + j["hidden_act"].dump() + ".\nlegal: \"silu\" (Llama's SwiGLU MLP).");
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (r.boolean(key, false))
      r.fail(std::string(key) + " is true; Halyard's Llama has no biases.\nlegal: false or absent.");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const json& s = j["rope_scaling"];
    std::string type = s.is_object() ? s.value("rope_type", s.value("type", std::string())) : "";
    if (type != "llama3")
      r.fail("rope_scaling " + s.dump() + " is not supported.\nlegal: null, or {\"rope_type\": \"llama3\", ...} (Llama 3.1).");
    Reader sr{s, what};
    c.rope_scaling.factor = sr.positive_number("factor", 8.0);
    c.rope_scaling.low_freq_factor = sr.positive_number("low_freq_factor", 1.0);
    c.rope_scaling.high_freq_factor = sr.positive_number("high_freq_factor", 4.0);
    c.rope_scaling.original_max_position_embeddings = sr.positive_number("original_max_position_embeddings", 8192);
    if (c.rope_scaling.high_freq_factor <= c.rope_scaling.low_freq_factor)
      r.fail("rope_scaling needs high_freq_factor > low_freq_factor.");
  }
  return c;
}

LlamaConfig LlamaConfig::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UserError("error: cannot open config \"" + path + "\".\nlegal: a path to a config.json file.");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

std::string LlamaConfig::to_json() const {
  json j = {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"hidden_act", "silu"},
            {"hidden_size", hidden_size},
            {"num_hidden_layers", num_hidden_layers},
            {"num_attention_heads", num_attention_heads},
            {"num_key_value_heads", num_key_value_heads},
            {"head_dim", head_dim},
            {"intermediate_size", intermediate_size},
            {"vocab_size", vocab_size},
            {"rope_theta", rope_theta},
            {"rms_norm_eps", rms_norm_eps},
            {"tie_word_embeddings", tie_word_embeddings}};
  if (rope_scaling.factor > 0)
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", rope_scaling.factor},
                         {"low_freq_factor", rope_scaling.low_freq_factor},
                         {"high_freq_factor", rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings}};
  return j.dump(2);
}

}  // namespace halyard::llama
