// Training checkpoints (see checkpoint.h): save, resolve `latest`, validate, load.
#include "runtime/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>
#include <vector>

#include "runtime/error.h"
#include "runtime/safetensors.h"

namespace halyard::runtime {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string quote(const std::string& s) { return "\"" + s + "\""; }

std::vector<int64_t> hf_shape(const ParamSpec& p) { return {p.hf_shape, p.hf_shape + p.hf_rank}; }

std::string shape_string(Dtype t, const std::vector<int64_t>& shape) {
  std::string s = std::string(dtype_name(t)) + "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Step directories under dir ("step-" and digits), sorted by step.
std::vector<std::pair<int64_t, fs::path>> list_steps(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.size() <= 5 || n.rfind("step-", 0) != 0 || !it->is_directory()) continue;
    if (!std::all_of(n.begin() + 5, n.end(), [](char c) { return c >= '0' && c <= '9'; }) || n.size() > 5 + 18) continue;
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

// Writes the file via a temporary in the same directory: fsync, rename, fsync dir.
void write_file_atomic(const fs::path& path, const std::string& text) {
  const std::string p = path.string(), tmp = p + ".tmp." + std::to_string(::getpid());
  auto fail = [&](const std::string& what, int err) {
    ::unlink(tmp.c_str());
    throw Error("error: checkpoint file " + quote(p) + "\ncannot write it: " + what + ": " + std::strerror(err) +
                ".\nany previous file at this path is unchanged; check that the directory is writable and the disk "
                "has space.");
  };
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("creating " + quote(tmp), errno);
  for (size_t done = 0; done < text.size();) {
    ssize_t k = ::write(fd, text.data() + done, text.size() - done);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      const int err = k < 0 ? errno : EIO;
      ::close(fd);
      fail("writing " + quote(tmp), err);
    }
    done += static_cast<size_t>(k);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    fail("fsync of " + quote(tmp), err);
  }
  if (::close(fd) != 0) fail("closing " + quote(tmp), errno);
  if (::rename(tmp.c_str(), p.c_str()) != 0) fail("renaming " + quote(tmp) + " over it", errno);
  std::string dir = path.parent_path().string();
  if (dir.empty()) dir = ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {  // makes the rename durable; some filesystems cannot, the data is in place regardless
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("error: checkpoint file " + quote(path.string()) + "\ncannot be opened for reading.");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void make_directory(const fs::path& d) {
  std::error_code ec;
  fs::create_directories(d, ec);
  if (ec || !fs::is_directory(d))
    throw Error("error: checkpoint directory " + quote(d.string()) + "\ncannot be created: " +
                (ec ? ec.message() : std::string("a file of that name exists")) +
                ".\npass a path whose parent is writable.");
}

// The tensors of a checkpoint as raw f32 bytes under their HF shape.
Tensor f32_tensor(const float* values, const ParamSpec& p) {
  Tensor t{Dtype::F32, hf_shape(p), std::vector<uint8_t>(static_cast<size_t>(p.numel) * sizeof(float))};
  std::memcpy(t.bytes.data(), values, t.bytes.size());  // the host is little-endian, as is the format
  return t;
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

Safetensors read_checkpoint_file(const fs::path& file, const fs::path& root, bool from_latest) {
  try {
    return Safetensors::read(file.string());
  } catch (const Error& e) {
    if (!from_latest) throw;
    throw Error(std::string(e.what()) + "\nthe latest checkpoint in " + quote(root.string()) + " is damaged.\n" +
                steps_hint(root, file.parent_path()));
  }
}

// Validates that `st` holds exactly prefix+name for every parameter, each a
// float tensor of its HF shape; returns the values in parameter order.
std::vector<std::vector<float>> read_tensors(const Safetensors& st, const fs::path& file, const ModelSpec& spec,
                                             const std::vector<std::string>& prefixes) {
  const std::string f = quote(file.string());
  std::set<std::string> expected;
  std::vector<std::string> missing;
  for (const std::string& prefix : prefixes)
    for (int i = 0; i < spec.num_params; ++i) {
      const std::string name = prefix + spec.params[i].name;
      expected.insert(name);
      if (!st.contains(name)) missing.push_back(name);
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
  for (const std::string& n : st.names())
    if (!expected.count(n)) extra.push_back(n);
  if (!extra.empty())
    throw Error("error: checkpoint file " + f + "\nholds " + std::to_string(extra.size()) + " tensor" +
                (extra.size() > 1 ? "s" : "") + " model " + quote(spec.name) + " does not have: " + list(extra) +
                ".\nthe file belongs to another model (more layers, other names); pass a checkpoint of this model.");
  std::vector<std::vector<float>> out;
  for (const std::string& prefix : prefixes)
    for (int i = 0; i < spec.num_params; ++i) {
      const ParamSpec& p = spec.params[i];
      const std::string name = prefix + p.name;
      const Tensor& t = st.at(name);
      const bool is_float = t.dtype == Dtype::F32 || t.dtype == Dtype::BF16 || t.dtype == Dtype::F16 ||
                            t.dtype == Dtype::F64;
      if (!is_float || t.shape != hf_shape(p))
        throw Error("error: checkpoint file " + f + "\ntensor " + quote(name) + " is " + type_string(t) +
                    " but model " + quote(spec.name) + " expects " + shape_string(Dtype::F32, hf_shape(p)) +
                    " (its Hugging Face shape; F32, BF16, F16 and F64 are accepted).\nthe file belongs to another "
                    "model config; pass a checkpoint of this model.");
      out.push_back(st.to_f32(name));
    }
  return out;
}

int64_t parse_step(const Safetensors& st, const fs::path& file) {
  auto it = st.metadata.find("step");
  if (it == st.metadata.end()) return -1;
  const std::string& s = it->second;
  if (s.empty() || s.size() > 18 || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }))
    throw Error("error: checkpoint file " + quote(file.string()) + "\nmetadata \"step\" is " + quote(s) +
                "; it must be a non-negative integer.\nthe file is damaged; pass an earlier checkpoint.");
  return std::stoll(s);
}

}  // namespace

std::string checkpoint_step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

void save_checkpoint(const std::string& dir, const Model& model, const AdamW& opt, int64_t step) {
  const std::string what = "checkpoint " + quote(dir);
  if (step < 0)
    throw Error("error: " + what + "\nstep " + std::to_string(step) + " is negative; steps count from 0.");
  check_opt_matches(model, opt, what);
  const ModelSpec& spec = model.spec();
  const fs::path root(dir);
  const std::string name = checkpoint_step_name(step);
  const fs::path sub = root / name;
  make_directory(sub);

  Safetensors weights, state;
  weights.metadata = {{"format", "pt"}, {"step", std::to_string(step)}, {"model", spec.name}};
  state.metadata = {{"step", std::to_string(step)}, {"model", spec.name}};
  for (int i = 0; i < spec.num_params; ++i) {
    const ParamSpec& p = spec.params[i];
    weights.put(p.name, f32_tensor(model.param(i), p));
    state.put(std::string("m/") + p.name, f32_tensor(opt.m(static_cast<size_t>(i)).data(), p));
    state.put(std::string("v/") + p.name, f32_tensor(opt.v(static_cast<size_t>(i)).data(), p));
  }
  weights.write((sub / "model.safetensors").string());
  state.write((sub / "optimizer.safetensors").string());
  write_file_atomic(sub / "config.json", std::string(spec.config_json) + "\n");

  // Only now does the new step become the one that loads.
  const fs::path latest = root / "latest";
  std::string previous;
  if (fs::exists(latest)) {
    previous = read_text(latest);
    while (!previous.empty() && (previous.back() == '\n' || previous.back() == ' ')) previous.pop_back();
  }
  write_file_atomic(latest, name + "\n");

  // Keep the new and the previous step; older ones go (a failure to delete is harmless).
  int64_t keep_from = step;
  for (const auto& [s, path] : list_steps(root))
    if (path.filename() == previous) keep_from = std::min(keep_from, s);
  for (const auto& [s, path] : list_steps(root)) {
    if (s >= keep_from || path.filename() == previous) continue;
    std::error_code ec;
    fs::remove_all(path, ec);
  }
}

int64_t load_checkpoint(const std::string& dir, Model& model, AdamW* opt) {
  const ModelSpec& spec = model.spec();
  const fs::path root(dir);
  fs::path sub = root;
  bool from_latest = false;
  if (!fs::exists(root / "model.safetensors")) {
    const fs::path latest = root / "latest";
    if (!fs::exists(latest))
      throw Error("error: checkpoint " + quote(dir) + "\n" +
                  (fs::is_directory(root) ? "holds neither \"latest\" (written by save_checkpoint) nor "
                                            "\"model.safetensors\" (a Hugging Face folder)."
                                          : std::string("does not exist.")) +
                  (list_steps(root).empty() ? "" : "\n" + steps_hint(root)) +
                  "\npass the directory given to --save, one of its step-NNNNNNNN directories, or a folder with "
                  "model.safetensors and config.json.");
    std::string name = read_text(latest);
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ' || name.back() == '\r')) name.pop_back();
    const bool valid = name.size() > 5 && name.rfind("step-", 0) == 0 &&
                       std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!valid || !fs::is_directory(root / name))
      throw Error("error: checkpoint file " + quote(latest.string()) + "\nnames " + quote(name) + ", which is " +
                  (valid ? "not a directory in " + quote(dir) : std::string("not of the form step-NNNNNNNN")) +
                  "; the checkpoint was edited or copied partially.\n" + steps_hint(root));
    sub = root / name;
    from_latest = true;
  }

  // Validate everything before touching the model or the optimizer.
  check_config(sub / "config.json", spec);
  const fs::path weights_file = sub / "model.safetensors";
  if (!fs::exists(weights_file))
    throw Error("error: checkpoint " + quote(sub.string()) + "\nhas no model.safetensors; the save was interrupted.\n" +
                steps_hint(root, sub));
  const Safetensors weights = read_checkpoint_file(weights_file, root, from_latest);
  const auto values = read_tensors(weights, weights_file, spec, {""});
  int64_t step = parse_step(weights, weights_file);

  const fs::path state_file = sub / "optimizer.safetensors";
  std::vector<std::vector<float>> moments;
  if (opt) {
    check_opt_matches(model, *opt, "checkpoint " + quote(sub.string()));
    if (fs::exists(state_file)) {
      const Safetensors state = read_checkpoint_file(state_file, root, from_latest);
      moments = read_tensors(state, state_file, spec, {"m/", "v/"});
      const int64_t s = parse_step(state, state_file);
      if (s >= 0 && step >= 0 && s != step)
        throw Error("error: checkpoint " + quote(sub.string()) + "\nmodel.safetensors is from step " +
                    std::to_string(step) + " but optimizer.safetensors from step " + std::to_string(s) +
                    "; the files were mixed.\npass a checkpoint written by one save_checkpoint call.");
      if (s >= 0) step = s;
    } else if (from_latest) {
      throw Error("error: checkpoint " + quote(sub.string()) + "\nhas no optimizer.safetensors, which resuming "
                  "training needs; the save was interrupted or the file was removed.\n" + steps_hint(root, sub) +
                  " (to load the weights alone, pass no optimizer.)");
    }
  }

  for (int i = 0; i < spec.num_params; ++i) std::copy(values[i].begin(), values[i].end(), model.param(i));
  if (!moments.empty()) {
    const size_t n = static_cast<size_t>(spec.num_params);
    for (size_t i = 0; i < n; ++i) {
      opt->m(i) = moments[i];
      opt->v(i) = moments[n + i];
    }
  }
  return std::max<int64_t>(step, 0);
}

}  // namespace halyard::runtime
