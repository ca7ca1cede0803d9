// Training checkpoints (see checkpoint.h): save (finite check, shards, staging
// directory, checksums, `latest`), then load (resolve, verify checksums, index
// the shards, validate every tensor, and only then convert into the model).
#include "runtime/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "runtime/error.h"
#include "runtime/file_io.h"
#include "runtime/safetensors.h"

namespace halyard::runtime {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kChecksums = "checksums.json";

std::vector<int64_t> hf_shape(const ParamSpec& p) { return {p.hf_shape, p.hf_shape + p.hf_rank}; }

std::string shape_string(Dtype t, const std::vector<int64_t>& shape) {
  std::string s = std::string(dtype_name(t)) + "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool all_digits(const std::string& s, size_t from) {
  return s.size() > from && std::all_of(s.begin() + static_cast<std::ptrdiff_t>(from), s.end(),
                                        [](char c) { return c >= '0' && c <= '9'; });
}

// Step directories under dir ("step-" and digits), sorted by step. The staging
// directory of a save in progress ("step-00000300.partial") is not one.
std::vector<std::pair<int64_t, fs::path>> list_steps(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.rfind("step-", 0) != 0 || !all_digits(n, 5) || n.size() > 5 + 18 || !it->is_directory()) continue;
    out.emplace_back(std::stoll(n.substr(5)), it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A sentence naming the step directories that could be loaded instead of `bad`.
std::string steps_hint(const fs::path& dir, const fs::path& bad = {}) {
  std::string names;
  for (const auto& [step, path] : list_steps(dir))
    if (path.filename() != bad.filename()) names += (names.empty() ? "" : ", ") + path.filename().string();
  if (names.empty()) return "no other step directory is present; train afresh or save again.";
  return "step directories that load directly: " + names + "; pass one of them.";
}

// What to do when the files of `sub` are damaged: resume from the step before
// it, which save_checkpoint keeps for exactly this.
std::string resume_hint(const fs::path& sub) {
  const std::string n = sub.filename().string();
  if (n.rfind("step-", 0) != 0 || !all_digits(n, 5) || n.size() > 5 + 18)
    return "re-copy or re-download the file.";
  const int64_t step = std::stoll(n.substr(5));
  fs::path previous;
  for (const auto& [s, path] : list_steps(sub.parent_path()))
    if (s < step) previous = path;
  if (previous.empty()) return steps_hint(sub.parent_path(), sub);
  return "resume from the previous step directory " + quote(previous.string()) +
         ", which save_checkpoint keeps: pass it instead.";
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("error: checkpoint file " + quote(path.string()) + "\ncannot be opened for reading.");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

FileDigest write_text_atomic(const fs::path& path, const std::string& text) {
  AtomicFile f(path.string(), "checkpoint file");
  f.write(text.data(), text.size());
  return f.commit();
}

void make_directory(const fs::path& d) {
  std::error_code ec;
  fs::create_directories(d, ec);
  if (ec || !fs::is_directory(d))
    throw Error("error: checkpoint directory " + quote(d.string()) + "\ncannot be created: " +
                (ec ? ec.message() : std::string("a file of that name exists")) +
                ".\npass a path whose parent is writable.");
}

void check_opt_matches(const Model& model, const AdamW& opt, const std::string& what) {
  if (opt.num_params() != static_cast<size_t>(model.num_params()))
    throw Error("error: " + what + ": the AdamW state has " + std::to_string(opt.num_params()) +
                " parameters but model " + quote(model.spec().name) + " has " + std::to_string(model.num_params()) +
                ".\nbuild the optimizer from the model's parameters (one size per param_spec(i).numel).");
  for (int i = 0; i < model.num_params(); ++i) {
    const ParamSpec& p = model.param_spec(i);
    if (opt.m(static_cast<size_t>(i)).size() != static_cast<size_t>(p.numel))
      throw Error("error: " + what + ": the AdamW state of parameter " + quote(p.name) + " has " +
                  std::to_string(opt.m(static_cast<size_t>(i)).size()) + " elements but the parameter has " +
                  std::to_string(p.numel) + ".\nbuild the optimizer from the model's parameters.");
  }
}

// Element i of a row-major tensor of `shape` as coordinates: "[3, 17]".
std::string coordinates(int64_t i, const std::vector<int64_t>& shape) {
  std::vector<int64_t> c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    c[d] = shape[d] ? i % shape[d] : 0;
    i = shape[d] ? i / shape[d] : 0;
  }
  std::string s = "[";
  for (size_t d = 0; d < c.size(); ++d) s += (d ? ", " : "") + std::to_string(c[d]);
  return s + "]";
}

std::string value_name(float v) { return std::isnan(v) ? "NaN" : v > 0 ? "+inf" : "-inf"; }

// ---- saving -----------------------------------------------------------------

// One tensor of a checkpoint file: its name there, its parameter, its values.
struct Entry {
  std::string name;
  const ParamSpec* param;
  const float* values;
  int64_t bytes() const { return param->numel * static_cast<int64_t>(sizeof(float)); }
};

void check_finite(const std::vector<Entry>& entries, const std::string& kind, int64_t step, const std::string& dir,
                  const std::string& previous) {
  for (const Entry& e : entries) {
    const float* v = e.values;
    for (int64_t i = 0; i < e.param->numel; ++i) {
      if (std::isfinite(v[i])) continue;
      throw Error("error: checkpoint step " + std::to_string(step) + " was not saved: " + kind + " " +
                  quote(e.name) + " " + shape_string(Dtype::F32, hf_shape(*e.param)) + " holds " +
                  value_name(v[i]) + " at element " + std::to_string(i) + " " +
                  coordinates(i, hf_shape(*e.param)) + ".\nnothing was written" +
                  (previous.empty() ? "" : "; the previous checkpoint " + quote(previous) + " is intact") +
                  ".\nthe training diverged: resume from an earlier checkpoint with a lower learning rate or "
                  "tighter gradient clipping (a checkpoint of " +
                  quote(dir) + " never holds NaN or infinity).");
    }
  }
}

// Groups entries, in order, into shards of at most max_bytes of tensor data,
// as transformers' save_pretrained does: a new shard starts when the next
// tensor would overflow the current one; a tensor above the limit is alone.
std::vector<std::vector<const Entry*>> plan_shards(const std::vector<Entry>& entries, int64_t max_bytes) {
  std::vector<std::vector<const Entry*>> shards(1);
  int64_t size = 0;
  for (const Entry& e : entries) {
    if (!shards.back().empty() && size + e.bytes() > max_bytes) {
      shards.emplace_back();
      size = 0;
    }
    shards.back().push_back(&e);
    size += e.bytes();
  }
  return shards;
}

std::string shard_name(const std::string& stem, size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", k + 1, n);
  return stem + buf;
}

// Writes `entries` into folder as stem.safetensors, or, above max_bytes, as
// stem-0000k-of-0000n.safetensors plus stem.safetensors.index.json. Adds each
// file's digest to `digests`.
void write_set(const fs::path& folder, const std::string& stem, const std::vector<Entry>& entries,
               const std::map<std::string, std::string>& metadata, int64_t max_bytes,
               std::map<std::string, FileDigest>& digests) {
  const auto shards = plan_shards(entries, max_bytes);
  json weight_map = json::object();
  int64_t total = 0;
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string file = shards.size() == 1 ? stem + ".safetensors" : shard_name(stem, k, shards.size());
    std::map<std::string, TensorView> views;
    for (const Entry* e : shards[k]) {
      views.emplace(e->name, TensorView{Dtype::F32, hf_shape(*e->param),
                                        {reinterpret_cast<const uint8_t*>(e->values), static_cast<size_t>(e->bytes())}});
      weight_map[e->name] = file;
      total += e->bytes();
    }
    digests[file] = write_safetensors((folder / file).string(), views, metadata);
  }
  if (shards.size() > 1) {
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    const std::string name = stem + ".safetensors.index.json";
    digests[name] = write_text_atomic(folder / name, index.dump(2) + "\n");
  }
}

// rename(2), as a WriteError naming `to` on failure.
void rename_dir(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw WriteError("error: checkpoint directory " + quote(to.string()) + "\ncannot rename " +
                         quote(from.string()) + " to it: " + std::strerror(errno) + ".",
                     errno, to.string());
}

void fsync_dir(const fs::path& d) {
  int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {  // makes renames durable; some filesystems cannot, the data is in place regardless
    ::fsync(fd);
    ::close(fd);
  }
}

// ---- loading ----------------------------------------------------------------

// Keys a Hugging Face config may leave out, and the value transformers then uses.
json hf_default(const std::string& key, const json& cfg) {
  if (key == "head_dim" && cfg.contains("hidden_size") && cfg.contains("num_attention_heads") &&
      cfg["hidden_size"].is_number_integer() && cfg["num_attention_heads"].is_number_integer() &&
      cfg["num_attention_heads"].get<int64_t>() > 0)
    return cfg["hidden_size"].get<int64_t>() / cfg["num_attention_heads"].get<int64_t>();
  if (key == "num_key_value_heads" && cfg.contains("num_attention_heads")) return cfg["num_attention_heads"];
  if (key == "tie_word_embeddings") return false;
  if (key == "rope_theta") return 10000.0;
  if (key == "rms_norm_eps") return 1e-6;
  if (key == "hidden_act") return "silu";
  return nullptr;
}

void check_config(const fs::path& file, const ModelSpec& spec) {
  const std::string f = quote(file.string());
  if (!fs::exists(file))
    throw Error("error: checkpoint " + quote(file.parent_path().string()) + "\nhas no config.json; every checkpoint "
                "carries the config its weights belong to.\nput the model's config.json next to model.safetensors.");
  json have = json::parse(read_text(file), nullptr, false);
  if (have.is_discarded() || !have.is_object())
    throw Error("error: checkpoint file " + f + "\nis not a JSON object; the file is damaged.\nreplace it with the "
                "model's config.json.");
  const json want = json::parse(spec.config_json);
  for (const auto& [key, value] : want.items()) {
    json got = have.contains(key) ? have[key] : hf_default(key, have);
    if (got.is_null() && key == "architectures") continue;  // informational only
    if (got.is_null())
      throw Error("error: checkpoint file " + f + "\nhas no key " + quote(key) + "; the library " + quote(spec.name) +
                  " was built for " + quote(key) + ": " + value.dump() + ".\nadd it to config.json if the weights "
                  "belong to this config.");
    if (got != value)
      throw Error("error: checkpoint file " + f + "\nkey " + quote(key) + " is " + got.dump() + " here but " +
                  value.dump() + " in the config the library " + quote(spec.name) + " was built for.\nthe checkpoint "
                  "belongs to another model config: load it with a library built from its config.json "
                  "(halyard_add_model CONFIG ...), or pass a checkpoint of this model.");
  }
}

// The files of one set ("model" or "optimizer") in a folder, before opening them.
struct SetFiles {
  fs::path listing;                // stem.safetensors, or stem.safetensors.index.json
  std::vector<std::string> files;  // the safetensors files, by name in the folder, sorted
  std::map<std::string, std::string> weight_map;  // tensor -> file; empty for a single file
  bool indexed() const { return listing.extension() == ".json"; }
};

// Parses JSON, reporting the first key that appears twice in one object
// (nlohmann would silently keep the last): a tensor listed twice in an index.
json parse_json_strict(const std::string& text, std::string& duplicate) {
  std::vector<std::set<std::string>> scopes;
  auto callback = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) scopes.emplace_back();
    if (event == json::parse_event_t::object_end) scopes.pop_back();
    if (event == json::parse_event_t::key && !scopes.back().insert(parsed.get<std::string>()).second &&
        duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  return json::parse(text, callback, false);
}

// stem.safetensors if present (transformers prefers it too), else the index
// and the files it names; nullopt when the folder has neither.
std::optional<SetFiles> find_set(const fs::path& folder, const std::string& stem) {
  SetFiles set;
  if (fs::exists(folder / (stem + ".safetensors"))) {
    set.listing = folder / (stem + ".safetensors");
    set.files = {stem + ".safetensors"};
    return set;
  }
  set.listing = folder / (stem + ".safetensors.index.json");
  if (!fs::exists(set.listing)) return std::nullopt;
  const std::string f = "error: checkpoint file " + quote(set.listing.string()) + "\n";
  std::string duplicate;
  const json index = parse_json_strict(read_text(set.listing), duplicate);
  if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw Error(f + "is not a JSON object with a \"weight_map\" object ({\"metadata\": {\"total_size\": N}, "
                "\"weight_map\": {tensor: file}}); the file is damaged.\nre-copy it with the shards it indexes.");
  if (!duplicate.empty())
    throw Error(f + "lists the key " + quote(duplicate) + " twice; each tensor must be in exactly one shard.\n"
                "the index is damaged; re-copy it with the shards it indexes.");
  std::set<std::string> files;
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    if (!file.is_string())
      throw Error(f + "maps tensor " + quote(tensor) + " to " + file.dump() +
                  "; weight_map values must be file names (\"model-00001-of-00002.safetensors\").");
    const std::string name = file.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      throw Error(f + "maps tensor " + quote(tensor) + " to " + quote(name) +
                  ", which is not a file name in the index's folder; shards must sit next to their index.");
    set.weight_map[tensor] = name;
    files.insert(name);
  }
  for (const std::string& name : files) {
    if (fs::exists(folder / name)) continue;
    std::string example;
    int64_t count = 0;
    for (const auto& [tensor, file] : set.weight_map)
      if (file == name && count++ == 0) example = tensor;
    throw Error(f + "maps " + std::to_string(count) + " tensor" + (count > 1 ? "s" : "") + " (" + quote(example) +
                (count > 1 ? ", ..." : "") + ") to " + quote(name) + ", which does not exist in " +
                quote(folder.string()) + ".\nthe download or copy is incomplete; fetch the missing shard.");
  }
  set.files.assign(files.begin(), files.end());
  return set;
}

// checksums.json of a step directory: file name -> digest. Empty when absent
// (a Hugging Face folder, or a checkpoint saved before checksums existed).
std::map<std::string, FileDigest> read_checksums(const fs::path& sub, const std::string& damaged) {
  std::map<std::string, FileDigest> out;
  const fs::path path = sub / kChecksums;
  if (!fs::exists(path)) return out;
  const json j = json::parse(read_text(path), nullptr, false);
  auto bad = [&](const std::string& why) {
    throw Error("error: checkpoint file " + quote(path.string()) + "\n" + why +
                "; it should be {\"algorithm\": \"xxh64\", \"files\": {name: {\"bytes\": N, \"xxh64\": "
                "\"<16 hex digits>\"}}}.\nthe file is corrupt" + damaged);
  };
  if (j.is_discarded() || !j.is_object()) bad("is not a JSON object");
  if (!j.contains("algorithm") || j["algorithm"] != "xxh64")
    bad("names the algorithm " + (j.contains("algorithm") ? j["algorithm"].dump() : std::string("(none)")));
  if (!j.contains("files") || !j["files"].is_object()) bad("has no \"files\" object");
  for (const auto& [name, e] : j["files"].items()) {
    if (!e.is_object() || !e.contains("bytes") || !e["bytes"].is_number_unsigned() || !e.contains("xxh64") ||
        !e["xxh64"].is_string() || e["xxh64"].get<std::string>().size() != 16)
      bad("entry " + quote(name) + " is " + e.dump());
    const std::string hex = e["xxh64"].get<std::string>();
    char* end = nullptr;
    const uint64_t h = std::strtoull(hex.c_str(), &end, 16);
    if (*end != '\0') bad("entry " + quote(name) + " has the hash " + quote(hex));
    out[name] = {e["bytes"].get<uint64_t>(), h};
  }
  return out;
}

// Checks each of `files` (names in sub) against checksums.json, when sub has one.
void verify_checksums(const fs::path& sub, const std::vector<std::string>& files, const std::string& damaged) {
  const std::map<std::string, FileDigest> sums = read_checksums(sub, damaged);
  if (sums.empty()) return;
  for (const std::string& name : files) {
    const fs::path path = sub / name;
    const std::string f = "error: checkpoint file " + quote(path.string()) + "\n";
    auto it = sums.find(name);
    if (it == sums.end())
      throw Error(f + "is not listed in " + kChecksums + ", which lists every file its save wrote: the file was "
                  "added or renamed afterwards.\nremove it, or pass a checkpoint as save_checkpoint wrote it" +
                  damaged);
    const FileDigest want = it->second, got = digest_file(path.string(), "checkpoint file");
    if (got.bytes != want.bytes)
      throw Error(f + "is " + std::to_string(got.bytes) + " bytes, but " + kChecksums + " lists " +
                  std::to_string(want.bytes) + (got.bytes < want.bytes ? ": it is truncated (or was changed after the save)"
                                          : ": it was changed after the save") +
                  ".\nthe file is corrupt" + damaged);
    if (got.xxh64 != want.xxh64)
      throw Error(f + "does not match its checksum: " + kChecksums + " lists xxh64 " + hex64(want.xxh64) +
                  ", the file has " + hex64(got.xxh64) + " (both over " + std::to_string(got.bytes) +
                  " bytes).\nthe file is corrupt (if you changed it on purpose, delete " + kChecksums + ")" +
                  damaged);
  }
}

// The opened files of a set and where each tensor lives.
struct TensorSet {
  SetFiles files;
  std::vector<MappedSafetensors> mapped;  // parallel to files.files
  std::map<std::string, const MappedSafetensors*> where;

  const MappedSafetensors& file_of(const std::string& tensor) const { return *where.at(tensor); }
};

// Opens every file of the set; for an index, checks it against the files:
// every tensor in the file the map names, none in two files, none unlisted.
TensorSet open_set(const fs::path& folder, SetFiles files) {
  TensorSet set;
  set.files = std::move(files);
  for (const std::string& name : set.files.files) set.mapped.emplace_back((folder / name).string());
  const std::string index = quote(set.files.listing.string());
  for (const MappedSafetensors& m : set.mapped) {
    const std::string file = fs::path(m.path()).filename().string();
    for (const std::string& tensor : m.names()) {
      auto [it, fresh] = set.where.emplace(tensor, &m);
      if (!fresh)
        throw Error("error: checkpoint file " + quote(m.path()) + "\nholds tensor " + quote(tensor) +
                    ", which " + quote(fs::path(it->second->path()).filename().string()) +
                    " holds too; each tensor must be in exactly one shard.\nthe shards are from different saves; "
                    "re-copy the folder from one source.");
      if (!set.files.indexed()) continue;
      auto listed = set.files.weight_map.find(tensor);
      if (listed == set.files.weight_map.end())
        throw Error("error: checkpoint file " + quote(m.path()) + "\nholds tensor " + quote(tensor) +
                    ", which the index " + index + " does not list.\nthe index and the shards are from different "
                    "saves; re-copy the folder from one source.");
      if (listed->second != file)
        throw Error("error: checkpoint file " + index + "\nsays tensor " + quote(tensor) + " is in " +
                    quote(listed->second) + ", but it is in " + quote(file) +
                    ".\nthe index and the shards are from different saves; re-copy the folder from one source.");
    }
  }
  for (const auto& [tensor, file] : set.files.weight_map)
    if (!set.where.count(tensor))
      throw Error("error: checkpoint file " + index + "\nsays tensor " + quote(tensor) + " is in " + quote(file) +
                  ", but that file does not hold it.\nthe index and the shards are from different saves; re-copy the "
                  "folder from one source.");
  return set;
}

// Validates that `set` holds exactly prefix+name for every parameter, each a
// float tensor of its HF shape holding no NaN or infinity; returns the names in
// the order of the prefixes, then of the parameters.
std::vector<std::string> check_tensors(const TensorSet& set, const ModelSpec& spec,
                                       const std::vector<std::string>& prefixes, const std::string& damaged) {
  const std::string f = quote(set.files.listing.string());
  std::set<std::string> expected;
  std::vector<std::string> missing, order;
  for (const std::string& prefix : prefixes)
    for (int i = 0; i < spec.num_params; ++i) {
      const std::string name = prefix + spec.params[i].name;
      expected.insert(name);
      order.push_back(name);
      if (!set.where.count(name)) missing.push_back(name);
    }
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 10; ++i) s += (i ? ", " : "") + quote(v[i]);
    return s + (v.size() > 10 ? ", ... (" + std::to_string(v.size()) + " in all)" : "");
  };
  if (!missing.empty())
    throw Error("error: checkpoint file " + f + "\nlacks " + std::to_string(missing.size()) + " of the " +
                std::to_string(expected.size()) + " tensors model " + quote(spec.name) + " needs: " + list(missing) +
                ".\nthe file belongs to another model or was written incompletely; pass a checkpoint of this model.");
  std::vector<std::string> extra;
  for (const auto& [n, file] : set.where)
    if (!expected.count(n)) extra.push_back(n);
  if (!extra.empty())
    throw Error("error: checkpoint file " + f + "\nholds " + std::to_string(extra.size()) + " tensor" +
                (extra.size() > 1 ? "s" : "") + " model " + quote(spec.name) + " does not have: " + list(extra) +
                ".\nthe file belongs to another model (more layers, other names); pass a checkpoint of this model.");
  for (size_t k = 0; k < order.size(); ++k) {
    const ParamSpec& p = spec.params[k % static_cast<size_t>(spec.num_params)];
    const std::string& name = order[k];
    const MappedSafetensors& file = set.file_of(name);
    const TensorView& t = file.at(name);
    const bool is_float = t.dtype == Dtype::F32 || t.dtype == Dtype::BF16 || t.dtype == Dtype::F16 ||
                          t.dtype == Dtype::F64;
    if (!is_float || t.shape != hf_shape(p))
      throw Error("error: checkpoint file " + quote(file.path()) + "\ntensor " + quote(name) + " is " +
                  shape_string(t.dtype, t.shape) + " but model " + quote(spec.name) + " expects " +
                  shape_string(Dtype::F32, hf_shape(p)) +
                  " (its Hugging Face shape; F32, BF16, F16 and F64 are accepted).\nthe file belongs to another "
                  "model config; pass a checkpoint of this model.");
  }
  // Only now read the data: a wrong file fails above in microseconds.
  for (const std::string& name : order) {
    const MappedSafetensors& file = set.file_of(name);
    const int64_t i = file.first_non_finite(name);
    if (i < 0) continue;
    const TensorView& t = file.at(name);
    float one[1];
    const size_t size = dtype_size(t.dtype);
    convert_to_f32(t.dtype, t.bytes.data() + static_cast<size_t>(i) * size, 1, one);
    throw Error("error: checkpoint file " + quote(file.path()) + "\ntensor " + quote(name) + " " +
                shape_string(t.dtype, t.shape) + " holds " + value_name(one[0]) + " at element " + std::to_string(i) +
                " " + coordinates(i, t.shape) + "; model " + quote(spec.name) +
                " does not load non-finite values.\nthe run that wrote it had diverged, or the file is damaged" +
                damaged);
  }
  return order;
}

int64_t parse_step(const std::map<std::string, std::string>& metadata, const std::string& file) {
  auto it = metadata.find("step");
  if (it == metadata.end()) return -1;
  const std::string& s = it->second;
  if (s.empty() || s.size() > 18 || !all_digits(s, 0))
    throw Error("error: checkpoint file " + quote(file) + "\nmetadata \"step\" is " + quote(s) +
                "; it must be a non-negative integer.\nthe file is damaged; pass an earlier checkpoint.");
  return std::stoll(s);
}

// The step every file of the set records (-1 if none does); files that disagree are an error.
int64_t set_step(const TensorSet& set, const fs::path& sub) {
  int64_t step = -1;
  std::string first;
  for (const MappedSafetensors& m : set.mapped) {
    const int64_t s = parse_step(m.metadata(), m.path());
    if (s < 0) continue;
    if (step >= 0 && s != step)
      throw Error("error: checkpoint " + quote(sub.string()) + "\n" + quote(first) + " is from step " +
                  std::to_string(step) + " but " + quote(m.path()) + " from step " + std::to_string(s) +
                  "; the files were mixed.\npass a checkpoint written by one save_checkpoint call.");
    step = s;
    first = m.path();
  }
  return step;
}

}  // namespace

std::string checkpoint_step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

void save_checkpoint(const std::string& dir, const Model& model, const AdamW& opt, int64_t step,
                     int64_t max_shard_bytes) {
  const std::string what = "checkpoint " + quote(dir);
  if (step < 0)
    throw Error("error: " + what + "\nstep " + std::to_string(step) + " is negative; steps count from 0.");
  if (max_shard_bytes <= 0)
    throw Error("error: " + what + "\nmax_shard_bytes is " + std::to_string(max_shard_bytes) +
                "; it must be positive (Hugging Face's default is 5000000000, 5 GB).");
  check_opt_matches(model, opt, what);
  const ModelSpec& spec = model.spec();
  const fs::path root(dir);
  const std::string name = checkpoint_step_name(step);
  const fs::path final_dir = root / name;

  std::string previous;  // the step directory `latest` names now, if any
  if (fs::exists(root / "latest")) {
    const std::string n = trimmed(read_text(root / "latest"));
    if (fs::is_directory(root / n) && n.rfind("step-", 0) == 0) previous = (root / n).string();
  }

  std::vector<Entry> weights, state;
  for (int i = 0; i < spec.num_params; ++i) {
    const ParamSpec& p = spec.params[i];
    weights.push_back({p.name, &p, model.param(i)});
    state.push_back({std::string("m/") + p.name, &p, opt.m(static_cast<size_t>(i)).data()});
    state.push_back({std::string("v/") + p.name, &p, opt.v(static_cast<size_t>(i)).data()});
  }
  // Before anything touches the disk: a diverged run must not replace a good checkpoint.
  check_finite(weights, "parameter", step, dir, previous);
  check_finite(state, "AdamW state", step, dir, previous);

  WriteFailureScope injected_failures;  // HALYARD_TEST_FAIL_WRITE_AFTER_BYTES, see file_io.h
  make_directory(root);
  // The new step is written whole into a staging directory that neither
  // `latest` nor list_steps can name, then renamed into place.
  const fs::path staging = root / (name + ".partial");
  const fs::path replaced = root / (name + ".replaced");
  bool moved_aside = false, installed = false;
  std::error_code ec;
  fs::remove_all(staging, ec);  // debris of a save that crashed
  auto undo = [&] {  // back to the state before this save
    fs::remove_all(staging, ec);
    if (installed) fs::remove_all(final_dir, ec);
    if (moved_aside) ::rename(replaced.c_str(), final_dir.c_str());
  };
  try {
    if (::mkdir(staging.c_str(), 0755) != 0)
      throw WriteError("error: checkpoint directory " + quote(staging.string()) + "\ncannot be created: " +
                           std::strerror(errno) + ".",
                       errno, final_dir.string());
    std::map<std::string, FileDigest> digests;
    const std::string s = std::to_string(step);
    write_set(staging, "model", weights, {{"format", "pt"}, {"step", s}, {"model", spec.name}}, max_shard_bytes,
              digests);
    write_set(staging, "optimizer", state, {{"step", s}, {"model", spec.name}}, max_shard_bytes, digests);
    digests["config.json"] = write_text_atomic(staging / "config.json", std::string(spec.config_json) + "\n");
    json sums = {{"algorithm", "xxh64"}, {"files", json::object()}};
    for (const auto& [file, d] : digests) sums["files"][file] = {{"bytes", d.bytes}, {"xxh64", hex64(d.xxh64)}};
    write_text_atomic(staging / kChecksums, sums.dump(2) + "\n");

    if (fs::exists(final_dir)) {
      if (final_dir.string() == previous) {  // saving the step `latest` names again: keep it until the end
        fs::remove_all(replaced, ec);
        rename_dir(final_dir, replaced);
        moved_aside = true;
      } else {
        fs::remove_all(final_dir, ec);  // a step no `latest` names: debris of an older save
      }
    }
    rename_dir(staging, final_dir);
    installed = true;
    fsync_dir(root);
    // Only now does the new step become the one that loads.
    write_text_atomic(root / "latest", name + "\n");
  } catch (const WriteError& e) {
    undo();
    // The file as the user knows it: in the step directory, not the staging one.
    fs::path file(e.path);
    if (file.parent_path() == staging) file = final_dir / file.filename();
    int64_t bytes = 0;
    for (const Entry& x : weights) bytes += x.bytes();
    for (const Entry& x : state) bytes += x.bytes();
    throw Error("error: checkpoint step " + std::to_string(step) + " was not saved: " + std::strerror(e.err) +
                " writing " + quote(file.string()) + "; " +
                (previous.empty() ? "there is no previous checkpoint in " + quote(dir)
                                  : "the previous checkpoint " + quote(previous) + " is intact") +
                ".\n`latest` is unchanged and nothing of step " + std::to_string(step) +
                " is left behind. the step needs about " + std::to_string(bytes) + " bytes on the disk of " +
                quote(dir) + ": free space there (or save to another directory) and save again.");
  } catch (...) {
    undo();
    throw;
  }
  if (moved_aside) fs::remove_all(replaced, ec);

  // Keep the new and the previous step; older ones go (a failure to delete is harmless).
  const std::string previous_name = previous.empty() ? "" : fs::path(previous).filename().string();
  int64_t keep_from = step;
  for (const auto& [s, path] : list_steps(root))
    if (path.filename() == previous_name) keep_from = std::min(keep_from, s);
  for (const auto& [s, path] : list_steps(root)) {
    if (s >= keep_from || path.filename() == previous_name) continue;
    fs::remove_all(path, ec);
  }
  // Staging directories of saves that crashed (one save runs at a time).
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.rfind("step-", 0) == 0 && n.size() > 8 && n.compare(n.size() - 8, 8, ".partial") == 0) {
      std::error_code rm;
      fs::remove_all(it->path(), rm);
    }
  }
}

int64_t load_checkpoint(const std::string& dir, Model& model, AdamW* opt) {
  const ModelSpec& spec = model.spec();
  const fs::path root(dir);
  fs::path sub = root;
  bool from_latest = false;
  if (!fs::exists(root / "model.safetensors") && !fs::exists(root / "model.safetensors.index.json")) {
    const fs::path latest = root / "latest";
    if (!fs::exists(latest))
      throw Error("error: checkpoint " + quote(dir) + "\n" +
                  (fs::is_directory(root) ? "holds neither \"latest\" (written by save_checkpoint) nor "
                                            "\"model.safetensors\" or \"model.safetensors.index.json\" (a Hugging "
                                            "Face folder)."
                                          : std::string("does not exist.")) +
                  (list_steps(root).empty() ? "" : "\n" + steps_hint(root)) +
                  "\npass the directory given to --save, one of its step-NNNNNNNN directories, or a folder with "
                  "model.safetensors (or its shards and index) and config.json.");
    const std::string name = trimmed(read_text(latest));
    const bool valid = name.rfind("step-", 0) == 0 && all_digits(name, 5);
    if (valid && !fs::is_directory(root / name) && fs::is_directory(root / (name + ".replaced")))
      throw Error("error: checkpoint file " + quote(latest.string()) + "\nnames " + quote(name) + ", which is not a "
                  "directory in " + quote(dir) + ": a save of that same step crashed while replacing it.\nrename " +
                  quote((root / (name + ".replaced")).string()) + " back to " + quote((root / name).string()) + ".");
    if (!valid || !fs::is_directory(root / name))
      throw Error("error: checkpoint file " + quote(latest.string()) + "\nnames " + quote(name) + ", which is " +
                  (valid ? "not a directory in " + quote(dir) : std::string("not of the form step-NNNNNNNN")) +
                  "; the checkpoint was edited or copied partially.\n" + steps_hint(root));
    sub = root / name;
    from_latest = true;
  }
  // What every "this file is damaged" error ends with.
  const std::string damaged = (from_latest ? "; the latest checkpoint in " + quote(root.string()) + " is damaged"
                                           : std::string()) + ".\n" + resume_hint(sub);

  // Validate everything before touching the model or the optimizer.
  check_config(sub / "config.json", spec);
  const std::optional<SetFiles> weight_files = find_set(sub, "model");
  if (!weight_files)
    throw Error("error: checkpoint " + quote(sub.string()) + "\nhas neither model.safetensors nor "
                "model.safetensors.index.json; the save was interrupted or the copy is incomplete.\n" +
                steps_hint(root, sub));
  std::optional<SetFiles> state_files;
  if (opt) {
    check_opt_matches(model, *opt, "checkpoint " + quote(sub.string()));
    state_files = find_set(sub, "optimizer");
    if (!state_files && from_latest)
      throw Error("error: checkpoint " + quote(sub.string()) + "\nhas no optimizer.safetensors (nor its index), "
                  "which resuming training needs; the save was interrupted or the file was removed.\n" +
                  steps_hint(root, sub) + " (to load the weights alone, pass no optimizer.)");
  }
  std::vector<std::string> read = {"config.json"};
  for (const std::optional<SetFiles>& set : {weight_files, state_files}) {
    if (!set) continue;
    if (set->indexed()) read.push_back(set->listing.filename().string());
    read.insert(read.end(), set->files.begin(), set->files.end());
  }
  verify_checksums(sub, read, damaged);

  auto open = [&](const SetFiles& files) {
    try {
      return open_set(sub, files);
    } catch (const Error& e) {  // a checkpoint without checksums.json: damage shows here
      throw Error(std::string(e.what()) + "\nthe file is damaged" + damaged);
    }
  };
  const TensorSet weights = open(*weight_files);
  const std::vector<std::string> weight_names = check_tensors(weights, spec, {""}, damaged);
  int64_t step = set_step(weights, sub);

  std::optional<TensorSet> state;
  std::vector<std::string> state_names;
  if (state_files) {
    state = open(*state_files);
    state_names = check_tensors(*state, spec, {"m/", "v/"}, damaged);
    const int64_t s = set_step(*state, sub);
    if (s >= 0 && step >= 0 && s != step)
      throw Error("error: checkpoint " + quote(sub.string()) + "\nmodel.safetensors is from step " +
                  std::to_string(step) + " but optimizer.safetensors from step " + std::to_string(s) +
                  "; the files were mixed.\npass a checkpoint written by one save_checkpoint call.");
    if (s >= 0) step = s;
  }

  // Everything validated: convert straight from the mapped files into place.
  for (int i = 0; i < spec.num_params; ++i) {
    const std::string& name = weight_names[static_cast<size_t>(i)];
    weights.file_of(name).read_f32(name, model.param(i));
  }
  if (state) {
    const size_t n = static_cast<size_t>(spec.num_params);
    for (size_t i = 0; i < n; ++i) {
      state->file_of(state_names[i]).read_f32(state_names[i], opt->m(i).data());
      state->file_of(state_names[n + i]).read_f32(state_names[n + i], opt->v(i).data());
    }
  }
  return std::max<int64_t>(step, 0);
}

}  // namespace halyard::runtime
