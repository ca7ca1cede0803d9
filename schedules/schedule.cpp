// Schedule presets, rules, JSON form and validation (see schedule.h).
#include "schedules/schedule.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dsl/error.h"
#include "dsl/op_table.h"
#include "dsl/types.h"
#include "schedules/tiling.h"

namespace halyard {
namespace {

// The cheap forward ops the `recompute` preset computes inside their
// consumers: AutoSP's "cheap, memory-heavy" class.
const char* const kInlinedByRecompute[] = {"rms_norm", "rope", "silu", "mul"};

// A pattern addresses a module and everything inside it, as a module path
// does: "model.layers.*.mlp" matches "model.layers.3.mlp.gate_proj".
bool label_matches(std::string_view pattern, std::string_view label) {
  if (glob_match(pattern, label)) return true;
  // (Every prefix starts as the label does; one that matches a pattern not
  // ending in '*' ends in the pattern's last character.)
  if (!pattern.empty() && pattern[0] != '*' && (label.empty() || label[0] != pattern[0])) return false;
  const char last = pattern.empty() ? '\0' : pattern.back();
  for (size_t d = label.find('.'); d != std::string_view::npos; d = label.find('.', d + 1))
    if ((last == '*' || (d > 0 && label[d - 1] == last)) && glob_match(pattern, label.substr(0, d))) return true;
  return false;
}

bool term_matches(std::string_view term, const Node& n) {
  if (term == "*") return true;
  if (term.starts_with("op:")) return op_info(n.op).name == term.substr(3);
  if (term.starts_with("class:")) return op_class_name(op_info(n.op).cls) == term.substr(6);
  if (term == "seq_tiles") return is_wide_tile(n) || n.op == Op::SliceSeq;
  return !n.name.empty() && label_matches(term, n.name);
}

// Calls f on each whitespace-separated term of a match until f says stop.
// (The search asks every rule of every plan about every value: no streams,
// no copies; they were a fifth of AutoSP's time.)
template <typename F>
void for_each_term(std::string_view match, F f) {
  auto space = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  for (size_t i = 0, n = match.size(); i < n;) {
    if (space(match[i])) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < n && !space(match[end])) ++end;
    if (!f(match.substr(i, end - i))) return;
    i = end;
  }
}

std::vector<std::string> terms(const std::string& match) {
  std::vector<std::string> out;
  for_each_term(match, [&](std::string_view t) { return out.emplace_back(t), true; });
  return out;
}

// Every term matches (and there is one).
bool matches(const std::string& match, const Node& n) {
  bool any = false, all = true;
  for_each_term(match, [&](std::string_view t) {
    any = true;
    all = term_matches(t, n);
    return all;
  });
  return any && all;
}

bool is_name_term(const std::string& t) {
  return t != "*" && t != "seq_tiles" && t.rfind("op:", 0) != 0 && t.rfind("class:", 0) != 0;
}

[[noreturn]] void bad(const std::string& what, const std::string& msg) {
  throw UserError("error: schedule \"" + what + "\": " + msg);
}

void check_term(const std::string& what, const std::string& t) {
  if (t.rfind("op:", 0) == 0) {
    try {
      op_by_name(t.substr(3));
    } catch (const UserError& e) {
      bad(what, "rule match \"" + t + "\" names no op.\n" + std::string(e.what()).substr(7));
    }
  }
  if (t.rfind("class:", 0) == 0) {
    const std::string c = t.substr(6);
    if (c != "cheap" && c != "heavy" && c != "runtime" && c != "view")
      bad(what, "rule match \"" + t + "\" names no op class.\nlegal: class:cheap, class:heavy, class:runtime, class:view.");
  }
}

std::string rules_str(const std::vector<ValueRule>& rules) {
  std::vector<std::string> parts;
  for (const ValueRule& r : rules) {
    std::string s = r.match + ":";
    if (!r.keep.empty()) s += " " + r.keep;
    if (!r.compute.empty()) s += " " + (r.compute == "inline" ? std::string("inline") : "root");
    if (!r.store.empty()) s += " store " + r.store;
    parts.push_back(s);
  }
  return join(parts);
}

}  // namespace

bool glob_match(std::string_view p, std::string_view s) {
  // Iterative wildcard match with backtracking to the last '*'.
  size_t i = 0, j = 0, star = std::string::npos, mark = 0;
  while (j < s.size()) {
    if (i < p.size() && p[i] == s[j]) {
      ++i, ++j;
    } else if (i < p.size() && p[i] == '*') {
      star = i++, mark = j;
    } else if (star != std::string::npos) {
      i = star + 1, j = ++mark;
    } else {
      return false;
    }
  }
  while (i < p.size() && p[i] == '*') ++i;
  return i == p.size();
}

std::vector<ValueRule> inline_cheap_rules() {
  std::vector<ValueRule> r;
  for (const char* op : kInlinedByRecompute) r.push_back({std::string("op:") + op, "", "inline", ""});
  return r;
}

std::vector<ValueRule> checkpoint_rules() {
  std::vector<ValueRule> r = {{"*", "recompute", "", ""}};
  for (const std::string& cls : {std::string("cheap"), std::string("heavy")})
    for (const std::string& op : op_names(cls == "cheap" ? OpClass::Cheap : OpClass::Heavy))
      if (op_info(op_by_name(op)).checkpoint_keeps) r.push_back({"op:" + op, "save", "", ""});
  r.push_back({"class:runtime", "save", "", ""});
  return r;
}

ValueRule recompute_seq_tiles_rule() { return {"seq_tiles", "recompute", "", ""}; }

Keep Schedule::keep(const Node& n) const {
  Keep k = Keep::Save;
  if (n.op == Op::Input || n.op == Op::Param) return k;
  for (const ValueRule& r : values)
    if (!r.keep.empty() && matches(r.match, n))
      k = r.keep == "recompute" ? Keep::Recompute : r.keep == "offload" ? Keep::Offload : Keep::Save;
  return k;
}

Schedule Schedule::on_gpu(bool cuda) const {
  Schedule s = *this;
  s.weight_grad_kernel = "halide";
  // The library's attention kernels exist for CPUs and CUDA (runtime/attention_cuda.h).
  if (!cuda) s.attention_kernel = "halide";
  if (s.contract_kernel == "auto") s.contract_kernel = cuda ? "cublas" : "halide";
  return s;
}

bool Schedule::offloads() const {
  return std::any_of(values.begin(), values.end(), [](const ValueRule& r) { return r.keep == "offload"; });
}

bool Schedule::stores_bf16() const {
  return std::any_of(values.begin(), values.end(), [](const ValueRule& r) { return r.store == "bf16"; });
}

Compute Schedule::compute(const Node& n) const {
  Compute c = Compute::Root;
  if (op_info(n.op).cls != OpClass::Cheap) return c;
  for (const ValueRule& r : values)
    if (!r.compute.empty() && matches(r.match, n)) c = r.compute == "inline" ? Compute::Inline : Compute::Root;
  return c;
}

bool Schedule::stores_bf16(const Node& n) const {
  bool bf16 = false;
  for (const ValueRule& r : values)
    if (!r.store.empty() && matches(r.match, n)) bf16 = r.store == "bf16";
  return bf16;
}

const AttentionRule* Schedule::attention_rule(const Node& n) const {
  const AttentionRule* rule = nullptr;
  for (const AttentionRule& r : attention)
    if (matches(r.match, n)) rule = &r;
  return rule;
}

std::string Schedule::strategy(const Node& n) const {
  const AttentionRule* r = attention_rule(n);
  return r ? r->strategy : "";
}

std::function<bool(const Node&)> Schedule::rematerialize() const {
  bool any = false;
  for (const ValueRule& r : values) any = any || r.keep == "recompute";
  if (!any) return {};
  return [s = *this](const Node& n) { return s.keep(n) == Keep::Recompute; };
}

void Schedule::check(const Graph& g) const {
  auto legal_values = [&] {
    std::vector<std::string> names;
    for (const Node& n : g.nodes())
      if (!n.name.empty() && n.op != Op::Param && n.op != Op::Input &&
          std::find(names.begin(), names.end(), n.name) == names.end())
        names.push_back(n.name);
    if (names.size() > 6) names.resize(6), names.push_back("...");
    return join(names);
  };
  for (const ValueRule& r : values) {
    bool any = false;
    for (const Node& n : g.nodes()) {
      if (n.backward || !matches(r.match, n)) continue;
      any = true;
      if (r.compute != "inline") break;  // (every plan checks every rule; only an inline rule has more to check)
      if (op_info(n.op).cls != OpClass::Cheap && !is_name_term(r.match))
        throw UserError("error: schedule \"" + name + "\": value " + describe(g, n.id) + " (op " + op_name(n.op) +
                        ", class " + op_class_name(op_info(n.op).cls) + ")\n  rule: {match: \"" + r.match +
                        "\", compute: inline}\nonly cheap values can be computed inside their consumers.\nlegal: "
                        "compute \"root\", or keep \"recompute\"; cheap ops: " + join(op_names(OpClass::Cheap)) + ".");
    }
    if (r.store == "bf16")
      for (const std::string& t : terms(r.match))
        if (t.rfind("op:", 0) == 0 && op_info(op_by_name(t.substr(3))).store_f32)
          throw UserError("error: schedule \"" + name + "\": rule {match: \"" + r.match + "\", store: bf16}\n" +
                          t.substr(3) + " is kept in f32 whatever the schedule stores: softmax statistics and counts "
                          "lose the gradient's accuracy in bf16.\nlegal: store bf16 for activations (op:attention, "
                          "op:add, op:contract, *, ...); " + t.substr(3) + " stays f32.");
    bool named = false;
    for (const std::string& t : terms(r.match)) named = named || is_name_term(t);
    if (!any && named)
      throw UserError("error: schedule \"" + name + "\": rule {match: \"" + r.match +
                      "\"} matches no value of the model.\nlegal: a pattern over value labels, e.g. " + legal_values() +
                      " ('*' matches any run of characters), op:NAME, class:cheap|heavy|runtime, seq_tiles, or *.");
  }
  for (const AttentionRule& r : attention) {
    bool any = false;
    for (const Node& n : g.nodes()) any = any || (n.op == Op::Attention && matches(r.match, n));
    if (!any)
      throw UserError("error: schedule \"" + name + "\": attention rule {match: \"" + r.match +
                      "\"} matches no attention of the model.\nlegal: a pattern over attention labels, e.g. "
                      "model.layers.*.self_attn, or *.");
  }
}

std::string Schedule::to_json() const {
  nlohmann::json j = {{"name", name}, {"mesh", {{"dp", mesh.dp}, {"sp", mesh.sp}, {"zero", mesh.zero}}}};
  if (!split_sequence.empty()) j["split_sequence"] = split_sequence;
  if (sequence_layout != "contiguous") j["sequence_layout"] = sequence_layout;
  if (!attention.empty()) {
    j["attention"] = nlohmann::json::array();
    for (const AttentionRule& r : attention) {
      nlohmann::json a = {{"match", r.match}, {"strategy", r.strategy}};
      if (r.strategy == "hybrid") a["ulysses_degree"] = r.ulysses_degree;
      j["attention"].push_back(a);
    }
  }
  j["values"] = nlohmann::json::array();
  for (const ValueRule& r : values) {
    nlohmann::json v = {{"match", r.match}};
    if (!r.keep.empty()) v["keep"] = r.keep;
    if (!r.compute.empty()) v["compute"] = r.compute;
    if (!r.store.empty()) v["store"] = r.store;
    j["values"].push_back(v);
  }
  if (seq_tile > 0) j["seq_tile"] = seq_tile;
  if (loss_seq_tile > 0) j["loss_seq_tile"] = loss_seq_tile;
  if (!autoscheduler.empty()) j["autoscheduler"] = autoscheduler;
  if (autoscheduler_beam_size != Schedule{}.autoscheduler_beam_size) j["autoscheduler_beam_size"] = autoscheduler_beam_size;
  if (attention_kernel != "library") j["attention_kernel"] = attention_kernel;
  if (weight_grad_kernel != "library") j["weight_grad_kernel"] = weight_grad_kernel;
  if (contract_kernel != "auto") j["contract_kernel"] = contract_kernel;
  if (contract_precision != "f32") j["contract_precision"] = contract_precision;
  if (grad_reduce_precision != "f32") j["grad_reduce_precision"] = grad_reduce_precision;
  if (kernel_tiles != KernelTiles{})
    j["kernel_tiles"] = {{"attention_queries", kernel_tiles.attention_queries},
                         {"attention_keys", kernel_tiles.attention_keys}};
  return j.dump(2);
}

std::string Schedule::str() const {
  std::string s = "schedule " + name + ": mesh dp=" + std::to_string(mesh.dp) + " x sp=" + std::to_string(mesh.sp);
  if (mesh.zero) s += " zero-" + std::to_string(mesh.zero);
  if (!split_sequence.empty()) {
    std::vector<std::string> a;
    for (const AttentionRule& r : attention)
      a.push_back(r.match + ": " + r.strategy +
                  (r.strategy == "hybrid" ? " (ulysses " + std::to_string(r.ulysses_degree) + ")" : ""));
    s += ", split_sequence(" + split_sequence + "), attention {" + join(a) + "}";
    if (sequence_layout != "contiguous") s += ", " + sequence_layout + " layout";
  }
  s += ", values {" + rules_str(values) + "}";
  if (seq_tile > 0) s += ", tile_sequence(" + std::to_string(seq_tile) + ")";
  if (loss_seq_tile > 0) s += ", loss tile " + std::to_string(loss_seq_tile);
  s += autoscheduler.empty() ? ", hand-written loop schedules" : ", autoscheduler " + autoscheduler;
  if (!autoscheduler.empty() && autoscheduler_beam_size != Schedule{}.autoscheduler_beam_size)
    s += " (beam " + std::to_string(autoscheduler_beam_size) + ")";
  if (attention_kernel != "library") s += ", " + attention_kernel + " attention kernels";
  if (weight_grad_kernel != "library") s += ", " + weight_grad_kernel + " weight-gradient kernels";
  if (contract_kernel != "auto") s += ", " + contract_kernel + " contractions";
  if (contract_precision != "f32") s += ", contractions in " + contract_precision;
  if (grad_reduce_precision != "f32") s += ", gradients summed from " + grad_reduce_precision;
  if (kernel_tiles.attention_queries) s += ", attention query tile " + std::to_string(kernel_tiles.attention_queries);
  if (kernel_tiles.attention_keys) s += ", attention key tile " + std::to_string(kernel_tiles.attention_keys);
  return s;
}

Schedule Schedule::parse(const std::string& text, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for a number past double (1e400)
    throw UserError("error: schedule \"" + what + "\" is not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw UserError("error: schedule \"" + what + "\" must be a JSON object.");
  Schedule s;
  auto integer = [&](const nlohmann::json& v, const std::string& key, int64_t lo) {
    if (!v.is_number_integer() || v.get<int64_t>() < lo)
      bad(what, key + " is " + v.dump() + ".\nlegal: an integer >= " + std::to_string(lo) + ".");
    return v.get<int64_t>();
  };
  auto strategy = [&](const std::string& st) {
    if (std::find(strategies().begin(), strategies().end(), st) == strategies().end())
      bad(what, "redistribute_heads(\"" + st + "\") is not a strategy.\nlegal: " + join(strategies()) + ".");
    return st;
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const nlohmann::json& v = *it;
    if (key == "name" && v.is_string()) {
      s.name = v.get<std::string>();
    } else if (key == "mesh" && v.is_object()) {
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (m.key() == "dp") s.mesh.dp = integer(*m, "mesh.dp", 1);
        else if (m.key() == "sp") s.mesh.sp = integer(*m, "mesh.sp", 1);
        else if (m.key() == "zero") {
          const int64_t zero = integer(*m, "mesh.zero", 0);  // checked before the cast: 2^32 + 1 is not 1
          if (zero == 2 || zero > 3)
            bad(what, "mesh.zero " + std::to_string(zero) + ".\nlegal: 0, 1 (ZeRO-1: optimizer state sharded), or "
                      "3 (parameters and gradients sharded too: planned only; llama_train runs 0 or 1).");
          s.mesh.zero = static_cast<int>(zero);
        } else bad(what, "unknown mesh axis \"" + m.key() + "\".\nlegal: dp, sp, zero.");
      }
      int64_t ranks = 0;
      if (__builtin_mul_overflow(s.mesh.dp, s.mesh.sp, &ranks))
        bad(what, "mesh dp=" + std::to_string(s.mesh.dp) + " x sp=" + std::to_string(s.mesh.sp) +
                      ": the rank count dp * sp overflows 64 bits.\nlegal: the ranks the step runs on, dp * sp of them.");
    } else if (key == "values" && v.is_array()) {
      for (const auto& r : v) {
        if (!r.is_object() || !r.contains("match") || !r["match"].is_string())
          bad(what, "value rule " + r.dump() + " has no \"match\" string.\nlegal: {\"match\": \"op:rms_norm\", "
                    "\"compute\": \"inline\"} or {\"match\": \"model.layers.*.mlp\", \"keep\": \"recompute\"}.");
        ValueRule vr{r["match"].get<std::string>(), "", "", ""};
        for (const std::string& t : terms(vr.match)) check_term(what, t);
        for (auto f = r.begin(); f != r.end(); ++f) {
          const std::string val = f->is_string() ? f->get<std::string>() : f->dump();
          if (f.key() == "match") continue;
          if (f.key() == "keep" && (val == "save" || val == "recompute" || val == "offload")) vr.keep = val;
          else if (f.key() == "compute" && (val == "root" || val == "inline")) vr.compute = val;
          else if (f.key() == "store" && (val == "f32" || val == "bf16")) vr.store = val;
          else
            bad(what, "value rule " + r.dump() + ": " + f.key() + " \"" + val +
                      "\".\nlegal: keep \"save\" | \"recompute\" | \"offload\", compute \"root\" | \"inline\", "
                      "store \"f32\" | \"bf16\".");
        }
        if (vr.keep.empty() && vr.compute.empty() && vr.store.empty())
          bad(what, "value rule " + r.dump() + " decides nothing.\nlegal: add keep (save | recompute | offload), compute "
                    "(root | inline) or store (f32 | bf16).");
        s.values.push_back(vr);
      }
    } else if (key == "attention" && v.is_array()) {
      for (const auto& r : v) {
        if (!r.is_object() || !r.contains("match") || !r.contains("strategy") || !r["strategy"].is_string() ||
            !r["match"].is_string())
          bad(what, "attention rule " + r.dump() + ".\nlegal: {\"match\": \"model.layers.*.self_attn\", "
                    "\"strategy\": \"ulysses\"}.");
        AttentionRule rule{r["match"].get<std::string>(), strategy(r["strategy"].get<std::string>()), 0};
        for (auto f = r.begin(); f != r.end(); ++f)
          if (f.key() == "ulysses_degree") rule.ulysses_degree = integer(*f, "ulysses_degree", 2);
          else if (f.key() != "match" && f.key() != "strategy")
            bad(what, "attention rule " + r.dump() + ": unknown key \"" + f.key() +
                          "\".\nlegal: match, strategy, and ulysses_degree (hybrid).");
        if ((rule.strategy == "hybrid") != (rule.ulysses_degree > 0))
          bad(what, "attention rule " + r.dump() + (rule.strategy == "hybrid" ? " has no ulysses_degree" :
                    " gives a ulysses_degree to a strategy that is not hybrid") +
                    ".\nlegal: {\"strategy\": \"hybrid\", \"ulysses_degree\": U}: Ulysses within groups of U ranks, "
                    "ring across sp / U groups.");
        s.attention.push_back(rule);
      }
    } else if (key == "redistribute_heads" && v.is_string()) {  // one strategy for every attention
      if (v.get<std::string>() == "hybrid")
        bad(what, "redistribute_heads(\"hybrid\") needs its Ulysses degree.\nlegal: \"attention\": [{\"match\": \"*\", "
                  "\"strategy\": \"hybrid\", \"ulysses_degree\": U}].");
      if (!v.get<std::string>().empty()) s.attention.push_back({"*", strategy(v.get<std::string>()), 0});
    } else if (key == "recompute" && v.is_array()) {  // the first vocabulary: cheap ops inlined
      for (const auto& op : v) {
        const std::string o = op.is_string() ? op.get<std::string>() : op.dump();
        const std::vector<std::string> cheap = op_names(OpClass::Cheap);
        if (std::find(cheap.begin(), cheap.end(), o) == cheap.end())
          bad(what, "recompute(" + o + ")\nonly cheap ops can be recomputed inside their consumers.\nlegal: " +
                        join(cheap) + ".");
        s.values.push_back({"op:" + o, "", "inline", ""});
      }
    } else if (key == "checkpoint" && v.is_boolean()) {  // the first vocabulary: full checkpointing
      if (v.get<bool>())
        for (const ValueRule& r : checkpoint_rules()) s.values.push_back(r);
    } else if (key == "split_sequence" && v.is_string()) {
      s.split_sequence = v.get<std::string>();
      if (!s.split_sequence.empty() && s.split_sequence != "sp")
        bad(what, "split_sequence(\"" + s.split_sequence + "\")\nthe sequence is split over the mesh axis sp.\n"
                  "legal: \"sp\", or \"\" for no split.");
    } else if (key == "sequence_layout" && v.is_string()) {
      s.sequence_layout = v.get<std::string>();
      if (std::find(sequence_layouts().begin(), sequence_layouts().end(), s.sequence_layout) == sequence_layouts().end())
        bad(what, "sequence_layout \"" + s.sequence_layout + "\".\nlegal: " + join(sequence_layouts()) + ".");
    } else if (key == "seq_tile" && v.is_number_integer()) {
      s.seq_tile = v.get<int64_t>();
      if (s.seq_tile < 0)
        bad(what, "seq_tile " + std::to_string(s.seq_tile) + "\nlegal: tokens per tile of the MLP and loss (e.g. 1024), or 0 for none.");
    } else if (key == "kernel_tiles" && v.is_object()) {
      for (auto t = v.begin(); t != v.end(); ++t) {
        const int64_t n = integer(*t, "kernel_tiles." + t.key(), 0);
        if (n % 8 != 0 || n > 256)
          bad(what, "kernel_tiles." + t.key() + " is " + std::to_string(n) +
                        ".\nlegal: 0 (derived from the shapes) or a multiple of 8 up to 256 (register tiles are 8 rows).");
        if (t.key() == "attention_queries") s.kernel_tiles.attention_queries = static_cast<int>(n);
        else if (t.key() == "attention_keys") s.kernel_tiles.attention_keys = static_cast<int>(n);
        else bad(what, "unknown kernel tile \"" + t.key() + "\".\nlegal: attention_queries, attention_keys.");
      }
    } else if (key == "attention_kernel" && v.is_string()) {
      s.attention_kernel = v.get<std::string>();
      if (std::find(attention_kernels().begin(), attention_kernels().end(), s.attention_kernel) == attention_kernels().end())
        bad(what, "attention_kernel \"" + s.attention_kernel + "\".\nlegal: " + join(attention_kernels()) + ".");
    } else if (key == "weight_grad_kernel" && v.is_string()) {
      s.weight_grad_kernel = v.get<std::string>();
      if (std::find(attention_kernels().begin(), attention_kernels().end(), s.weight_grad_kernel) == attention_kernels().end())
        bad(what, "weight_grad_kernel \"" + s.weight_grad_kernel + "\".\nlegal: " + join(attention_kernels()) + ".");
    } else if (key == "contract_kernel" && v.is_string()) {
      s.contract_kernel = v.get<std::string>();
      if (std::find(contract_kernels().begin(), contract_kernels().end(), s.contract_kernel) == contract_kernels().end())
        bad(what, "contract_kernel \"" + s.contract_kernel + "\".\nlegal: " + join(contract_kernels()) + ".");
    } else if ((key == "contract_precision" || key == "grad_reduce_precision") && v.is_string()) {
      const bool contract = key == "contract_precision";
      std::string& precision = contract ? s.contract_precision : s.grad_reduce_precision;
      precision = v.get<std::string>();
      if (std::find(precisions().begin(), precisions().end(), precision) == precisions().end())
        bad(what, key + " \"" + precision + "\".\nlegal: " + join(precisions()) +
                      (contract ? " (bf16: operands rounded to bf16, sums in f32)."
                                : " (bf16: gradients rounded to bf16 on the wire, summed in f32)."));
    } else if (key == "loss_seq_tile") {
      s.loss_seq_tile = integer(v, "loss_seq_tile", 0);
    } else if (key == "autoscheduler" && v.is_string()) {
      s.autoscheduler = v.get<std::string>();
      if (!s.autoscheduler.empty() && s.autoscheduler != "Adams2019")
        bad(what, "autoscheduler \"" + s.autoscheduler + "\" is not supported.\nlegal: \"\" (hand-written schedules) or \"Adams2019\".");
    } else if (key == "autoscheduler_beam_size") {
      const int64_t beam = integer(v, "autoscheduler_beam_size", 1);
      if (beam == 1)  // seen with Halide 21, the micro Llama: tests/fixtures/autoscheduled_fast.json
        bad(what, "autoscheduler_beam_size 1: Adams2019's greedy search gave an attention kernel that reads keys "
                  "before the row (a bounds error at run time; clamped, wrong results).\nlegal: 2 to 1024; Halide's "
                  "default is 32.");
      if (beam > 1024) bad(what, "autoscheduler_beam_size " + v.dump() + ".\nlegal: 2 to 1024; Halide's default is 32.");
      s.autoscheduler_beam_size = static_cast<int>(beam);
    } else {
      bad(what, "unknown or ill-typed key \"" + key + "\" (" + v.dump() +
                    ").\nlegal keys: name (string), mesh ({dp, sp, zero}), split_sequence (\"sp\"), attention (array "
                    "of {match, strategy}), values (array of {match, keep, compute, store}), seq_tile (integer), loss_seq_tile (integer), "
                    "autoscheduler (string), autoscheduler_beam_size (integer), sequence_layout (\"contiguous\" | \"zigzag\"), attention_kernel (\"library\" | \"halide\"), weight_grad_kernel (\"library\" | \"halide\"), contract_kernel (\"auto\" | \"cublas\" | \"halide\"), contract_precision (\"f32\" | \"bf16\"), grad_reduce_precision (\"f32\" | \"bf16\"), kernel_tiles ({attention_queries, attention_keys}); and the first vocabulary's recompute (array of op names), checkpoint "
                    "(bool), redistribute_heads (string).");
    }
  }
  // A tiled schedule of the first vocabulary recomputed its tiles per tile.
  if (s.loss_tile() > 0 && !j.contains("values")) s.values.push_back(recompute_seq_tiles_rule());
  if (s.split_sequence.empty() != s.attention.empty())
    bad(what, "split_sequence(\"" + s.split_sequence + "\") with " + std::to_string(s.attention.size()) +
                  " attention rule(s)\nattention needs every key: a split sequence needs a head redistribution, and "
                  "redistributing heads needs a split sequence.\nlegal: both (\"sp\", \"ulysses\") or neither.");
  if (s.sequence_layout == "zigzag")
    for (const AttentionRule& r : s.attention)
      if (r.strategy != "ring")
        bad(what, "sequence_layout \"zigzag\" with attention rule {match: \"" + r.match + "\", strategy: \"" +
                      r.strategy + "\"}\nzigzag placement balances ring attention; Ulysses gathers the whole "
                      "sequence and needs it in order.\nlegal: strategy \"ring\" for every attention, or "
                      "sequence_layout \"contiguous\".");
  if (j.contains("autoscheduler_beam_size") && s.autoscheduler.empty())
    bad(what, "autoscheduler_beam_size " + j["autoscheduler_beam_size"].dump() +
                  " without an autoscheduler.\nlegal: with \"autoscheduler\": \"Adams2019\".");
  if (s.mesh.sp > 1 && s.split_sequence.empty())
    bad(what, "mesh sp=" + std::to_string(s.mesh.sp) + " without split_sequence.\nlegal: split_sequence \"sp\" "
              "with an attention strategy, or mesh sp=1.");
  return s;
}

const std::vector<std::string>& Schedule::strategies() {
  static const std::vector<std::string> names = {"ulysses", "ring", "hybrid"};
  return names;
}

const std::vector<std::string>& Schedule::sequence_layouts() {
  static const std::vector<std::string> names = {"contiguous", "zigzag"};
  return names;
}

const std::vector<std::string>& Schedule::attention_kernels() {
  static const std::vector<std::string> names = {"library", "halide"};
  return names;
}

const std::vector<std::string>& Schedule::contract_kernels() {
  static const std::vector<std::string> names = {"auto", "cublas", "halide"};
  return names;
}

const std::vector<std::string>& Schedule::precisions() {
  static const std::vector<std::string> names = {"f32", "bf16"};
  return names;
}

const std::vector<std::string>& Schedule::presets() {
  static const std::vector<std::string> names = {"default", "recompute",          "checkpoint", "autoscheduled",
                                                 "tiled",   "ulysses",            "ulysses_checkpoint",
                                                 "ring",    "ring_zigzag"};
  return names;
}

Schedule Schedule::named(const std::string& n) {
  Schedule s;
  s.name = n;
  if (n == "default") return s;
  if (n == "recompute" || n == "checkpoint" || n == "tiled" || n == "ulysses_checkpoint") s.values = inline_cheap_rules();
  if (n == "checkpoint" || n == "ulysses_checkpoint")
    for (const ValueRule& r : checkpoint_rules()) s.values.push_back(r);
  if (n == "tiled") {
    s.seq_tile = 1024;
    s.values.push_back(recompute_seq_tiles_rule());
  }
  if (n == "autoscheduled") s.autoscheduler = "Adams2019";
  if (n == "ulysses" || n == "ulysses_checkpoint") {
    s.split_sequence = "sp";
    s.attention = {{"*", "ulysses", 0}};
  }
  if (n == "ring" || n == "ring_zigzag") {
    s.split_sequence = "sp";
    s.attention = {{"*", "ring", 0}};
    if (n == "ring_zigzag") s.sequence_layout = "zigzag";
  }
  if (std::find(presets().begin(), presets().end(), n) != presets().end()) return s;
  std::ifstream in(n);
  if (!in)
    throw UserError("error: schedule \"" + n + "\" is neither a preset nor a readable file.\nlegal: " +
                    join(presets()) + ",\nor a path to a schedule .json.");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), n);
}

}  // namespace halyard
