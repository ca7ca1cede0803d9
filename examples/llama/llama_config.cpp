// Reading and validating a Llama config.json (see llama_config.h).
#include "examples/llama/llama_config.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <vector>

#include "dsl/error.h"

namespace halyard::llama {
namespace {

using nlohmann::json;

struct Reader {
  const json& j;
  const std::string& what;
  std::string config_class = "LlamaConfig";

  [[noreturn]] void fail(const std::string& msg) const {
    throw UserError("error: config \"" + what + "\"\n" + msg);
  }
  int64_t positive_int(const char* key, bool required = true, int64_t fallback = 0) const {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) fail(std::string("missing key \"") + key + "\".\nlegal: a positive integer, as in HF's " + config_class + ".");
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


// Keys of HF's PretrainedConfig and LlamaConfig (transformers 4.4x to 5.x) that
// do not change the training math: generation settings, bookkeeping, token
// ids, the dtype the weights were saved in (Halyard converts to f32), the
// initializer range and the position limit (RoPE has no table to size).
// pretraining_tp > 1 slices the projections in 4.x but sums the same products.
const std::set<std::string>& neutral_keys() {
  static const std::set<std::string> keys = {
      "_name_or_path", "add_cross_attention", "architectures", "auto_map", "bad_words_ids", "begin_suppress_tokens",
      "bos_token_id", "chunk_size_feed_forward", "cross_attention_hidden_size", "decoder_start_token_id",
      "diversity_penalty", "do_sample", "dtype", "early_stopping", "encoder_no_repeat_ngram_size", "eos_token_id",
      "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id", "forced_eos_token_id",
      "id2label", "initializer_range", "is_decoder", "is_encoder_decoder", "label2id", "length_penalty",
      "max_length", "max_position_embeddings", "min_length", "no_repeat_ngram_size", "num_beam_groups",
      "num_beams", "num_return_sequences", "output_attentions", "output_hidden_states", "output_scores",
      "pad_token_id", "prefix", "pretraining_tp", "problem_type", "remove_invalid_values", "repetition_penalty",
      "return_dict", "return_dict_in_generate", "sep_token_id", "suppress_tokens", "task_specific_params",
      "temperature", "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class", "top_k", "top_p",
      "torch_dtype", "torchscript", "transformers_version", "typical_p", "use_bfloat16", "use_cache"};
  return keys;
}

// Keys Halyard reads (parse() and read_rope()).
const std::set<std::string>& read_keys() {
  static const std::set<std::string> keys = {
      "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
      "intermediate_size", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "rope_theta", "rope_scaling",
      "rope_parameters"};
  return keys;
}

bool same_value(const json& given, const json& implemented) {
  if (implemented.is_null()) return given.is_null();
  if (implemented.is_number() && given.is_number()) return given.get<double>() == implemented.get<double>();
  if (implemented.is_object() && given.is_object()) return given.empty() && implemented.empty();
  return given == implemented;
}

// A config giving a math key another value than the one Halyard implements is
// refused by name: training a different model than the one the checkpoint was
// made for would be a silent error.
void check_keys(const Reader& r, const HfArchitecture& arch) {
  std::vector<HfArchitecture::MathKey> math = arch.math_keys;
  math.insert(math.begin(), {"model_type", json(arch.model_type).dump(), "another architecture"});
  for (const HfArchitecture::MathKey& m : math) {
    if (!r.j.contains(m.key)) continue;
    const json& v = r.j[m.key];
    const json implemented = json::parse(m.implemented);
    if (m.key == "pruned_heads" && v.is_null()) continue;
    if (!same_value(v, implemented))
      r.fail(m.key + " is " + v.dump() + ": " + m.meaning + ", which Halyard's " + arch.name + " does not implement.\n" +
             "legal: " + (implemented.is_null() ? std::string("null or absent") : implemented.dump() + " or absent") +
             ". Training it as " + arch.name + " would be a different model; remove the key only if the checkpoint really is a " +
             arch.name + ".");
  }
  if (r.j.contains("layer_types") && !r.j["layer_types"].is_null()) {
    const json& lt = r.j["layer_types"];
    bool all_full = lt.is_array() && std::all_of(lt.begin(), lt.end(), [](const json& t) { return t == "full_attention"; });
    if (!all_full)
      r.fail("layer_types is " + lt.dump() + ": layers other than full causal attention.\n"
             "legal: every entry \"full_attention\", or absent.");
  }
  for (const auto& [key, value] : r.j.items()) {
    if (neutral_keys().count(key) || read_keys().count(key) || key == "layer_types") continue;
    if (std::count(arch.irrelevant_keys.begin(), arch.irrelevant_keys.end(), key)) continue;
    if (std::any_of(math.begin(), math.end(), [&](const HfArchitecture::MathKey& m) { return key == m.key; })) continue;
    r.fail("unknown key \"" + key + "\" (" + value.dump().substr(0, 80) +
           "): Halyard cannot tell whether it changes the model's math, so it does not guess.\n"
           "legal: the keys of HF's " + arch.config_class + " (transformers 4.4x to 5.x); if \"" + key +
           "\" is bookkeeping that leaves the math unchanged, remove it from the config.");
  }
}

// RoPE: transformers 4.x writes top-level rope_theta and rope_scaling (null, or
// {"rope_type"|"type": ..., factors}); 5.x writes rope_parameters holding
// rope_theta, rope_type and the same factors. Either form, or both when they
// agree, gives the same LlamaConfig.
RopeScaling read_scaling(const Reader& r, const json& s) {
  for (const char* k : {"rope_type", "type"})  // value() below throws nlohmann's type_error on a non-string
    if (s.contains(k) && !s[k].is_string())
      r.fail(std::string("rope ") + k + " is " + s[k].dump() + " in " + s.dump() +
             ", not a string.\nlegal: \"default\" (plain RoPE) or \"llama3\" (Llama 3.1 frequency scaling).");
  std::string type = s.value("rope_type", s.value("type", std::string("default")));
  if (type == "default") return {};
  if (type != "llama3")
    r.fail("rope type \"" + type + "\" in " + s.dump() + " is not implemented.\n" +
           "legal: \"default\" (plain RoPE) or \"llama3\" (Llama 3.1 frequency scaling).");
  Reader sr{s, r.what};
  RopeScaling rs;
  rs.factor = sr.positive_number("factor", 8.0);
  rs.low_freq_factor = sr.positive_number("low_freq_factor", 1.0);
  rs.high_freq_factor = sr.positive_number("high_freq_factor", 4.0);
  rs.original_max_position_embeddings = sr.positive_number("original_max_position_embeddings", 8192);
  if (rs.high_freq_factor <= rs.low_freq_factor) r.fail("rope scaling needs high_freq_factor > low_freq_factor.");
  return rs;
}

void read_rope(const Reader& r, LlamaConfig& c) {
  double theta = r.positive_number("rope_theta", 0);
  std::string theta_from = "rope_theta";
  std::string scaling_from;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!r.j.contains(key) || r.j[key].is_null()) continue;
    const json& p = r.j[key];
    if (!p.is_object())
      r.fail(std::string(key) + " is " + p.dump() + ".\nlegal: null or an object such as {\"rope_type\": \"default\"}.");
    RopeScaling rs = read_scaling(r, p);
    if (!scaling_from.empty() &&
        (rs.factor != c.rope_scaling.factor || rs.low_freq_factor != c.rope_scaling.low_freq_factor ||
         rs.high_freq_factor != c.rope_scaling.high_freq_factor ||
         rs.original_max_position_embeddings != c.rope_scaling.original_max_position_embeddings))
      r.fail(scaling_from + " and " + key + " " + p.dump() + " disagree.\nlegal: give one of them, or both with the same values.");
    c.rope_scaling = rs;
    scaling_from = key;
    double t = Reader{p, r.what}.positive_number("rope_theta", 0);
    if (t > 0 && theta > 0 && t != theta)
      r.fail(theta_from + " (" + json(theta).dump() + ") and " + key + ".rope_theta (" + json(t).dump() +
             ") disagree.\nlegal: the same value, or only one of them.");
    if (t > 0) theta = t, theta_from = std::string(key) + ".rope_theta";
  }
  c.rope_theta = theta > 0 ? theta : 10000.0;
}

}  // namespace

// Llama's rows. max_window_layers (Qwen2 and Mistral-style configs) only says
// which layers a sliding window skips, and sliding_window must be null here.
const HfArchitecture& llama_architecture() {
  static const HfArchitecture arch = {
      "llama", "LlamaForCausalLM", "Llama", "LlamaConfig",
      {
          {"hidden_act", "\"silu\"", "another MLP activation (Llama's SwiGLU uses silu)"},
          {"attention_bias", "false", "biases on q/k/v/o projections"},
          {"mlp_bias", "false", "biases on the MLP projections"},
          {"attention_dropout", "0.0", "dropout on attention probabilities"},
          {"sliding_window", "null", "sliding-window attention"},
          {"use_sliding_window", "false", "sliding-window attention"},
          {"partial_rotary_factor", "1.0", "RoPE on part of each head"},
          {"attn_logit_softcapping", "null", "soft-capped attention logits"},
          {"final_logit_softcapping", "null", "soft-capped output logits"},
          {"quantization_config", "null", "quantized weights"},
          {"pruned_heads", "{}", "pruned attention heads"},
      },
      {"max_window_layers"}};
  return arch;
}

LlamaConfig LlamaConfig::parse(const std::string& text, const std::string& what) {
  return parse_hf_config(text, what, llama_architecture());
}

LlamaConfig LlamaConfig::load(const std::string& path) { return load_hf_config(path, llama_architecture()); }

std::string LlamaConfig::to_json() const { return hf_config_json(*this, llama_architecture()); }

LlamaConfig parse_hf_config(const std::string& text, const std::string& what, const HfArchitecture& arch) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number past double (1e400)
    throw UserError("error: config \"" + what + "\" is not valid JSON: " + e.what() +
                    "\nlegal: a Hugging Face config.json object.");
  }
  if (!j.is_object())
    throw UserError("error: config \"" + what + "\" is JSON " + std::string(j.type_name()) +
                    ", not an object.\nlegal: a Hugging Face config.json object.");
  Reader r{j, what, arch.config_class};
  LlamaConfig c;
  c.hidden_size = r.positive_int("hidden_size");
  c.num_hidden_layers = r.positive_int("num_hidden_layers");
  c.num_attention_heads = r.positive_int("num_attention_heads");
  c.num_key_value_heads = r.positive_int("num_key_value_heads", false, c.num_attention_heads);
  c.intermediate_size = r.positive_int("intermediate_size");
  c.vocab_size = r.positive_int("vocab_size");
  c.rms_norm_eps = r.positive_number("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  // (head_dim null is absent, as HF reads it: head_dim is then hidden_size / heads)
  if (c.hidden_size % c.num_attention_heads != 0 && (!j.contains("head_dim") || j["head_dim"].is_null()))
    r.fail("hidden_size (" + std::to_string(c.hidden_size) + ") is not a multiple of num_attention_heads (" +
           std::to_string(c.num_attention_heads) + ") and no head_dim is given.\nlegal: give head_dim, or heads dividing hidden_size.");
  c.head_dim = r.positive_int("head_dim", false, c.hidden_size / c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail("num_attention_heads (" + std::to_string(c.num_attention_heads) +
           ") is not a multiple of num_key_value_heads (" + std::to_string(c.num_key_value_heads) +
           ").\nlegal: num_key_value_heads dividing num_attention_heads.");
  if (c.head_dim % 2 != 0)
    r.fail("head_dim (" + std::to_string(c.head_dim) + ") is odd; RoPE rotates pairs.\nlegal: an even head_dim.");
  check_keys(r, arch);
  read_rope(r, c);
  return c;
}

LlamaConfig load_hf_config(const std::string& path, const HfArchitecture& arch) {
  std::ifstream in(path);
  if (!in) throw UserError("error: cannot open config \"" + path + "\".\nlegal: a path to a config.json file.");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_hf_config(ss.str(), path, arch);
}

std::string hf_config_json(const LlamaConfig& c, const HfArchitecture& arch) {
  json j = {{"architectures", {arch.architecture}},
            {"model_type", arch.model_type},
            {"hidden_act", "silu"},
            {"hidden_size", c.hidden_size},
            {"num_hidden_layers", c.num_hidden_layers},
            {"num_attention_heads", c.num_attention_heads},
            {"num_key_value_heads", c.num_key_value_heads},
            {"head_dim", c.head_dim},
            {"intermediate_size", c.intermediate_size},
            {"vocab_size", c.vocab_size},
            {"rope_theta", c.rope_theta},
            {"rms_norm_eps", c.rms_norm_eps},
            {"tie_word_embeddings", c.tie_word_embeddings}};
  if (c.rope_scaling.factor > 0)
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  return j.dump(2);
}

}  // namespace halyard::llama
