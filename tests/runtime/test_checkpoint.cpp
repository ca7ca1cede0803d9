// Tests for runtime/checkpoint: a bitwise round trip of parameters and AdamW
// state, a resumed run reproducing an uninterrupted one bit for bit, a crash in
// the middle of a save leaving the previous step loadable, one test per kind of
// damaged or mismatched checkpoint (each checking the message), loading a
// plain Hugging Face folder, one file or BF16 shards with an index; saving in
// shards; checksums; a disk that fills up during a save (injected with
// HALYARD_TEST_FAIL_WRITE_AFTER_BYTES); NaN and infinity refused both ways.
// Runs on the generated llama_micro_default model with the tokens of
// tests/fixtures/llama_micro.safetensors. The memory a load adds is measured
// in test_checkpoint_memory.cpp.
#include "runtime/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/temp_dir.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "llama_micro_default.h"
#include "runtime/adamw.h"
#include "runtime/error.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"

namespace halyard::runtime {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const std::string kFixture = std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/llama_micro.safetensors";

const ModelSpec& spec() { return halyard_models::llama_micro_default(); }

using halyard::testing::TempDir;

struct Tokens {
  Safetensors st;
  std::vector<int32_t> ids, labels, pos;
};

const Tokens& fixture() {
  static const Tokens t = [] {
    Tokens f{Safetensors::read(kFixture), {}, {}, {}};
    f.ids = f.st.to_i32("input_ids");
    f.labels = f.st.to_i32("labels");
    f.pos = f.st.to_i32("position_ids");
    return f;
  }();
  return t;
}

AdamW make_opt(const Model& m) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < m.num_params(); ++i) sizes.push_back(m.param_spec(i).numel);
  return AdamW(sizes, m.decay_flags());
}

// Steps first..last (inclusive) on the fixture's tokens; returns the losses.
std::vector<double> train(Model& m, AdamW& opt, int first, int last) {
  std::vector<float*> params;
  std::vector<const float*> grads;
  for (int i = 0; i < m.num_params(); ++i) {
    params.push_back(m.param(i));
    grads.push_back(m.grad(i));
  }
  std::vector<double> losses;
  const Tokens& f = fixture();
  for (int step = first; step <= last; ++step) {
    losses.push_back(m.train_step(f.ids.data(), f.labels.data(), f.pos.data()));
    opt.step(step, 1e-2, params.data(), grads.data());
  }
  return losses;
}

std::vector<float> param_copy(Model& m, int i) { return {m.param(i), m.param(i) + m.param_spec(i).numel}; }

void expect_bitwise_equal(const std::vector<float>& a, const float* b, const std::string& what) {
  EXPECT_EQ(std::memcmp(a.data(), b, a.size() * sizeof(float)), 0) << what;
}

void expect_error(const std::function<void()>& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected runtime::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    std::printf("%s\n", msg.c_str());
    EXPECT_EQ(msg.rfind("error: ", 0), 0u) << msg;
    for (const std::string& p : parts) EXPECT_THAT(msg, HasSubstr(p));
  }
}

// A trained model and optimizer saved at `step` in dir.
struct Saved {
  Model model{spec()};
  AdamW opt = make_opt(model);
};

void train_and_save(Saved& s, const std::string& dir, int steps) {
  s.model.init_params(1);
  train(s.model, s.opt, 1, steps);
  save_checkpoint(dir, s.model, s.opt, steps);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Rewrites the latest model.safetensors of dir with `edit` applied. The edit
// drops checksums.json, as anyone editing a checkpoint on purpose must (with
// it, the load stops at the checksum; see ChecksumMismatchNamesFileAndPreviousStep).
void edit_weights(const std::string& dir, const std::function<void(Safetensors&)>& edit) {
  const std::string path = dir + "/step-00000002/model.safetensors";
  Safetensors st = Safetensors::read(path);
  edit(st);
  st.write(path);
  fs::remove(dir + "/step-00000002/checksums.json");
}

TEST(Checkpoint, RoundTripIsBitwise) {
  TempDir dir;
  Saved s;
  train_and_save(s, dir.path, 3);
  EXPECT_EQ(read_file(dir / "latest"), "step-00000003\n");
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "config.json"})
    EXPECT_TRUE(fs::exists(dir / ("step-00000003/" + std::string(f)))) << f;

  Model m(spec());
  m.init_params(2);
  AdamW opt = make_opt(m);
  EXPECT_EQ(load_checkpoint(dir.path, m, &opt), 3);
  for (int i = 0; i < m.num_params(); ++i) {
    const std::string name = m.param_spec(i).name;
    expect_bitwise_equal(param_copy(s.model, i), m.param(i), name);
    EXPECT_EQ(std::memcmp(opt.m(i).data(), s.opt.m(i).data(), opt.m(i).size() * sizeof(float)), 0) << "m/" << name;
    EXPECT_EQ(std::memcmp(opt.v(i).data(), s.opt.v(i).data(), opt.v(i).size() * sizeof(float)), 0) << "v/" << name;
  }
}

TEST(Checkpoint, ResumeEqualsUninterrupted) {
  Model straight(spec());
  straight.init_params(1);
  AdamW straight_opt = make_opt(straight);
  const std::vector<double> want = train(straight, straight_opt, 1, 6);

  TempDir dir;
  Saved s;
  train_and_save(s, dir.path, 3);
  Model m(spec());
  m.init_params(7);
  AdamW opt = make_opt(m);
  const int64_t step = load_checkpoint(dir.path, m, &opt);
  ASSERT_EQ(step, 3);
  const std::vector<double> got = train(m, opt, static_cast<int>(step) + 1, 6);
  for (int k = 0; k < 3; ++k) {
    std::printf("  step %d: loss %.9f uninterrupted, %.9f resumed\n", k + 4, want[static_cast<size_t>(k) + 3], got[k]);
    EXPECT_EQ(std::memcmp(&want[static_cast<size_t>(k) + 3], &got[static_cast<size_t>(k)], sizeof(double)), 0)
        << "step " << k + 4;
  }
}

TEST(Checkpoint, InterruptedSaveKeepsPreviousStep) {
  TempDir dir;
  Saved s;
  train_and_save(s, dir.path, 2);
  std::vector<std::vector<float>> saved;
  for (int i = 0; i < s.model.num_params(); ++i) saved.push_back(param_copy(s.model, i));
  // The crash: step 3's weights cut short, its other files and `latest` never written.
  train(s.model, s.opt, 3, 3);
  fs::create_directory(dir / "step-00000003");
  const std::string full = read_file(dir / "step-00000002/model.safetensors");
  write_file(dir / "step-00000003/model.safetensors", full.substr(0, full.size() / 2));
  write_file(dir / "step-00000003/optimizer.safetensors.tmp.12345", "partial");

  Model m(spec());
  m.init_params(2);
  AdamW opt = make_opt(m);
  EXPECT_EQ(load_checkpoint(dir.path, m, &opt), 2);
  for (int i = 0; i < m.num_params(); ++i) expect_bitwise_equal(saved[static_cast<size_t>(i)], m.param(i), m.param_spec(i).name);

  // Saving step 3 again over the debris completes it.
  save_checkpoint(dir.path, s.model, s.opt, 3);
  EXPECT_EQ(load_checkpoint(dir.path, m, &opt), 3);
  expect_bitwise_equal(param_copy(s.model, 0), m.param(0), m.param_spec(0).name);
}

TEST(Checkpoint, KeepsTwoStepDirectories) {
  TempDir dir;
  Saved s;
  s.model.init_params(1);
  for (int step = 1; step <= 4; ++step) save_checkpoint(dir.path, s.model, s.opt, step);
  EXPECT_FALSE(fs::exists(dir / "step-00000002"));
  EXPECT_TRUE(fs::exists(dir / "step-00000003"));
  EXPECT_TRUE(fs::exists(dir / "step-00000004"));
}

TEST(CheckpointErrors, TruncatedWeights) {
  TempDir dir;
  Saved s;
  s.model.init_params(1);
  save_checkpoint(dir.path, s.model, s.opt, 1);
  train(s.model, s.opt, 1, 2);
  save_checkpoint(dir.path, s.model, s.opt, 2);
  const std::string path = dir / "step-00000002/model.safetensors";
  const std::string full = read_file(path);
  write_file(path, full.substr(0, full.size() - 100));
  Model m(spec());
  m.init_params(5);
  const std::vector<float> before = param_copy(m, 0);
  AdamW opt = make_opt(m);
  expect_error([&] { load_checkpoint(dir.path, m, &opt); },
               {path, "is " + std::to_string(full.size() - 100) + " bytes, but checksums.json lists " +
                          std::to_string(full.size()) + ": it is truncated",
                "the latest checkpoint", "is damaged",
                "resume from the previous step directory \"" + (dir / "step-00000001") + "\""});
  expect_bitwise_equal(before, m.param(0), "a failed load leaves the model unchanged");
  EXPECT_EQ(load_checkpoint(dir / "step-00000001", m, &opt), 1);
}

TEST(CheckpointErrors, WrongShape) {
  TempDir dir;
  Saved s;
  train_and_save(s, dir.path, 2);
  edit_weights(dir.path, [](Safetensors& st) {
    st.put_f32("model.layers.0.self_attn.q_proj.weight", {32, 64}, std::vector<float>(32 * 64, 0.f));
  });
  Model m(spec());
  expect_error([&] { load_checkpoint(dir.path, m, nullptr); },
               {"\"model.layers.0.self_attn.q_proj.weight\"", "F32[32, 64]", "F32[64, 64]", "llama_micro_default"});
}

TEST(CheckpointErrors, WrongDtype) {
  TempDir dir;
  Saved s;
  train_and_save(s, dir.path, 2);
  edit_weights(dir.path, [](Safetensors& st) { st.put_i32("model.norm.weight", {64}, std::vector<int32_t>(64, 1)); });
  Model m(spec());
  expect_error([&] { load_checkpoint(dir.path, m, nullptr); }, {"\"model.norm.weight\"", "I32[64]", "F32[64]"});
}

TEST(CheckpointErrors, MissingTensor) {
  TempDir dir;
  Saved s;
  train_and_save(s, dir.path, 2);
  edit_weights(dir.path, [](Safetensors& st) {
    Safetensors copy;
    copy.metadata = st.metadata;
    for (const std::string& n : st.names())
      if (n != "model.norm.weight") copy.put(n, st.at(n));
    st = copy;
  });
  Model m(spec());
  expect_error([&] { load_checkpoint(dir.path, m, nullptr); }, {"lacks 1 of the 21 tensors", "\"model.norm.weight\""});
}

TEST(CheckpointErrors, UnexpectedTensor) {
  TempDir dir;
  Saved s;
  train_and_save(s, dir.path, 2);
  edit_weights(dir.path, [](Safetensors& st) {
    st.put_f32("model.layers.2.mlp.up_proj.weight", {128, 64}, std::vector<float>(128 * 64, 0.f));
  });
  Model m(spec());
  expect_error([&] { load_checkpoint(dir.path, m, nullptr); },
               {"1 tensor model \"llama_micro_default\" does not have", "\"model.layers.2.mlp.up_proj.weight\""});
}

TEST(CheckpointErrors, ConfigOfAnotherModel) {
  TempDir dir;
  Saved s;
  train_and_save(s, dir.path, 2);
  const std::string path = dir / "step-00000002/config.json";
  std::string cfg = read_file(path);
  const size_t at = cfg.find("\"hidden_size\": 64");
  ASSERT_NE(at, std::string::npos);
  cfg.replace(at, 17, "\"hidden_size\": 32");
  write_file(path, cfg);
  Model m(spec());
  expect_error([&] { load_checkpoint(dir.path, m, nullptr); },
               {"key \"hidden_size\" is 32 here but 64", "\"llama_micro_default\" was built for", "config.json"});
}

TEST(CheckpointErrors, NoCheckpoint) {
  TempDir dir;
  Model m(spec());
  expect_error([&] { load_checkpoint(dir.path, m, nullptr); }, {"neither \"latest\"", "model.safetensors"});
  write_file(dir / "latest", "step-00000009\n");
  expect_error([&] { load_checkpoint(dir.path, m, nullptr); }, {"\"step-00000009\"", "not a directory"});
}

TEST(Checkpoint, LoadsHuggingFaceFolder) {
  TempDir dir;
  const Tokens& f = fixture();
  Safetensors hf;
  hf.metadata = {{"format", "pt"}};
  for (int i = 0; i < spec().num_params; ++i) {
    const std::string name = spec().params[i].name;
    hf.put(name, f.st.at(name));
  }
  hf.write(dir / "model.safetensors");
  write_file(dir / "config.json", f.st.metadata.at("config"));  // as Python's json wrote it

  Model m(spec());
  m.init_params(3);
  AdamW opt = make_opt(m);
  EXPECT_EQ(load_checkpoint(dir.path, m, &opt), 0);
  for (int i = 0; i < m.num_params(); ++i) {
    expect_bitwise_equal(f.st.to_f32(m.param_spec(i).name), m.param(i), m.param_spec(i).name);
    EXPECT_EQ(opt.m(i), std::vector<float>(opt.m(i).size(), 0.f));
  }
}

// ---- shards ---------------------------------------------------------------------------------

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

int64_t model_bytes() {
  int64_t n = 0;
  for (int i = 0; i < spec().num_params; ++i) n += spec().params[i].numel * 4;
  return n;
}

TEST(Checkpoint, SavesShardsAndIndexAboveMaxShardBytes) {
  TempDir dir;
  Saved s;
  s.model.init_params(1);
  train(s.model, s.opt, 1, 2);
  const int64_t max_shard = model_bytes() / 3 + 1;  // ~137 KB of the micro model's 410 KB
  save_checkpoint(dir.path, s.model, s.opt, 2, max_shard);
  const std::string step = dir / "step-00000002";
  const std::vector<std::string> files = files_in(step);
  for (const std::string& f : files) std::printf("  %s\n", f.c_str());
  EXPECT_FALSE(fs::exists(step + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(step + "/optimizer.safetensors"));

  const nlohmann::json index = nlohmann::json::parse(read_file(step + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), model_bytes());
  std::set<std::string> shards;
  for (const auto& [tensor, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  EXPECT_EQ(index["weight_map"].size(), static_cast<size_t>(spec().num_params));
  ASSERT_GE(shards.size(), 3u) << "a limit of a third of the model makes at least 3 shards";
  const std::string n = std::to_string(shards.size());
  EXPECT_EQ(*shards.begin(), "model-00001-of-0000" + n + ".safetensors");
  EXPECT_EQ(*shards.rbegin(), "model-0000" + n + "-of-0000" + n + ".safetensors");
  int64_t biggest_param = 0;
  for (int i = 0; i < spec().num_params; ++i) biggest_param = std::max(biggest_param, spec().params[i].numel * 4);
  for (const std::string& f : shards) {
    ASSERT_TRUE(fs::exists(step + "/" + f)) << f;
    // Each shard holds at most max_shard bytes of tensors, unless one tensor alone is larger.
    EXPECT_LE(static_cast<int64_t>(fs::file_size(step + "/" + f)), std::max(max_shard, biggest_param) + 4096) << f;
  }
  const nlohmann::json opt_index = nlohmann::json::parse(read_file(step + "/optimizer.safetensors.index.json"));
  EXPECT_EQ(opt_index["metadata"]["total_size"].get<int64_t>(), 2 * model_bytes());
  std::set<std::string> opt_shards;
  for (const auto& [tensor, file] : opt_index["weight_map"].items()) opt_shards.insert(file.get<std::string>());
  EXPECT_GE(opt_shards.size(), 5u) << "twice the model's bytes in shards of a third of it";

  // checksums.json lists every other file of the step.
  const nlohmann::json sums = nlohmann::json::parse(read_file(step + "/checksums.json"));
  EXPECT_EQ(sums["algorithm"], "xxh64");
  for (const std::string& f : files) {
    if (f == "checksums.json") continue;
    ASSERT_TRUE(sums["files"].contains(f)) << f;
    EXPECT_EQ(sums["files"][f]["bytes"].get<uint64_t>(), fs::file_size(step + "/" + f)) << f;
    EXPECT_EQ(sums["files"][f]["xxh64"].get<std::string>().size(), 16u) << f;
  }
  EXPECT_EQ(sums["files"].size(), files.size() - 1);

  Model m(spec());
  m.init_params(2);
  AdamW opt = make_opt(m);
  EXPECT_EQ(load_checkpoint(dir.path, m, &opt), 2);
  for (int i = 0; i < m.num_params(); ++i) {
    expect_bitwise_equal(param_copy(s.model, i), m.param(i), m.param_spec(i).name);
    EXPECT_EQ(opt.m(i), s.opt.m(i));
    EXPECT_EQ(opt.v(i), s.opt.v(i));
  }
  // The step directory alone is a Hugging Face folder with shards and index.
  EXPECT_EQ(load_checkpoint(step, m, nullptr), 2);

  // Under the default limit the same model is one file, as before.
  save_checkpoint(dir.path, s.model, s.opt, 3);
  EXPECT_EQ(files_in(dir / "step-00000003"), (std::vector<std::string>{"checksums.json", "config.json",
                                                                        "model.safetensors", "optimizer.safetensors"}));
}

uint16_t to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

Tensor bf16_tensor(const Tensor& f32) {
  Tensor t{Dtype::BF16, f32.shape, std::vector<uint8_t>(f32.bytes.size() / 2)};
  for (size_t i = 0; i < f32.bytes.size() / 4; ++i) {
    float f;
    std::memcpy(&f, f32.bytes.data() + 4 * i, 4);
    const uint16_t h = to_bf16(f);
    std::memcpy(t.bytes.data() + 2 * i, &h, 2);
  }
  return t;
}

// A Hugging Face folder as transformers publishes a sharded model: the
// fixture's weights in BF16, parameter i in shard i % 3, the index, config.json.
// Returns tensor -> shard file.
std::map<std::string, std::string> write_hf_shards(const std::string& dir) {
  const Tokens& f = fixture();
  std::vector<Safetensors> shards(3);
  std::map<std::string, std::string> where;
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0;
  for (int i = 0; i < spec().num_params; ++i) {
    const std::string name = spec().params[i].name;
    const std::string file = "model-0000" + std::to_string(i % 3 + 1) + "-of-00003.safetensors";
    Tensor t = bf16_tensor(f.st.at(name));
    total += static_cast<int64_t>(t.bytes.size());
    shards[static_cast<size_t>(i % 3)].put(name, std::move(t));
    weight_map[name] = file;
    where[name] = file;
  }
  for (size_t k = 0; k < 3; ++k) {
    shards[k].metadata = {{"format", "pt"}};
    shards[k].write(dir + "/model-0000" + std::to_string(k + 1) + "-of-00003.safetensors");
  }
  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_file(dir + "/model.safetensors.index.json", index.dump(2));
  write_file(dir + "/config.json", f.st.metadata.at("config"));
  return where;
}

TEST(Checkpoint, LoadsShardedBf16HuggingFaceFolder) {
  TempDir dir;
  write_hf_shards(dir.path);
  Model m(spec());
  m.init_params(3);
  AdamW opt = make_opt(m);
  EXPECT_EQ(load_checkpoint(dir.path, m, &opt), 0);
  for (int i = 0; i < m.num_params(); ++i) {
    const std::string name = m.param_spec(i).name;
    std::vector<float> want = fixture().st.to_f32(name);
    for (float& w : want) w = bf16_to_f32(to_bf16(w));
    expect_bitwise_equal(want, m.param(i), name);
  }
}

TEST(CheckpointErrors, ShardedIndexDisagreesWithShards) {
  const std::string norm = "model.norm.weight";
  auto edit_index = [](const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json index = nlohmann::json::parse(read_file(dir + "/model.safetensors.index.json"));
    edit(index);
    write_file(dir + "/model.safetensors.index.json", index.dump(2));
  };
  Model m(spec());
  m.init_params(5);
  const std::vector<float> before = param_copy(m, 0);
  {  // a shard named by the index is missing
    TempDir dir;
    write_hf_shards(dir.path);
    fs::remove(dir / "model-00002-of-00003.safetensors");
    expect_error([&] { load_checkpoint(dir.path, m, nullptr); },
                 {"model.safetensors.index.json", "to \"model-00002-of-00003.safetensors\", which does not exist in",
                  "fetch the missing shard"});
  }
  {  // the index puts a tensor in the wrong shard
    TempDir dir;
    std::map<std::string, std::string> where = write_hf_shards(dir.path);
    const std::string wrong = where[norm] == "model-00001-of-00003.safetensors" ? "model-00002-of-00003.safetensors"
                                                                                 : "model-00001-of-00003.safetensors";
    edit_index(dir.path, [&](nlohmann::json& j) { j["weight_map"][norm] = wrong; });
    expect_error([&] { load_checkpoint(dir.path, m, nullptr); },
                 {"says tensor \"model.norm.weight\" is in \"" + wrong + "\", but it is in \"" + where[norm] + "\"",
                  "from different saves"});
  }
  {  // a tensor in two shards
    TempDir dir;
    std::map<std::string, std::string> where = write_hf_shards(dir.path);
    const std::string other = where[norm] == "model-00003-of-00003.safetensors" ? "model-00001-of-00003.safetensors"
                                                                                 : "model-00003-of-00003.safetensors";
    Safetensors st = Safetensors::read(dir / other);
    st.put(norm, Safetensors::read(dir / where[norm]).at(norm));
    st.write(dir / other);
    expect_error([&] { load_checkpoint(dir.path, m, nullptr); },
                 {"holds tensor \"model.norm.weight\", which", "holds too; each tensor must be in exactly one shard"});
  }
  {  // a tensor the index does not list
    TempDir dir;
    write_hf_shards(dir.path);
    edit_index(dir.path, [&](nlohmann::json& j) { j["weight_map"].erase(norm); });
    expect_error([&] { load_checkpoint(dir.path, m, nullptr); },
                 {"holds tensor \"model.norm.weight\", which the index", "does not list"});
  }
  {  // a tensor listed twice in the index
    TempDir dir;
    write_hf_shards(dir.path);
    std::string text = read_file(dir / "model.safetensors.index.json");
    const size_t at = text.find("\"weight_map\": {") + 15;
    text.insert(at, "\n    \"" + norm + "\": \"model-00001-of-00003.safetensors\",");
    write_file(dir / "model.safetensors.index.json", text);
    expect_error([&] { load_checkpoint(dir.path, m, nullptr); },
                 {"lists the key \"model.norm.weight\" twice", "exactly one shard"});
  }
  {  // a file name that leaves the folder
    TempDir dir;
    write_hf_shards(dir.path);
    edit_index(dir.path, [&](nlohmann::json& j) { j["weight_map"][norm] = "../model-00001-of-00003.safetensors"; });
    expect_error([&] { load_checkpoint(dir.path, m, nullptr); },
                 {"maps tensor \"model.norm.weight\" to \"../model-00001-of-00003.safetensors\"",
                  "shards must sit next to their index"});
  }
  expect_bitwise_equal(before, m.param(0), "a failed load leaves the model unchanged");
}

// The name of shard k (from 1) of the model files of a step directory.
std::string model_shard(const std::string& step_dir, int k) {
  const nlohmann::json index = nlohmann::json::parse(read_file(step_dir + "/model.safetensors.index.json"));
  std::set<std::string> shards;
  for (const auto& [tensor, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  return *std::next(shards.begin(), k - 1);
}

// ---- checksums --------------------------------------------------------------------------------

TEST(CheckpointErrors, ChecksumMismatchNamesFileAndPreviousStep) {
  TempDir dir;
  Saved s;
  s.model.init_params(1);
  save_checkpoint(dir.path, s.model, s.opt, 1, model_bytes() / 3 + 1);
  train(s.model, s.opt, 1, 2);
  save_checkpoint(dir.path, s.model, s.opt, 2, model_bytes() / 3 + 1);
  const std::string step = dir / "step-00000002";
  const std::string shard = step + "/" + model_shard(step, 2);
  ASSERT_TRUE(fs::exists(shard));
  const nlohmann::json sums = nlohmann::json::parse(read_file(step + "/checksums.json"));
  const std::string listed = sums["files"][model_shard(step, 2)]["xxh64"];
  // One flipped bit in the data, the size unchanged: a bad disk, not a bad writer.
  std::string bytes = read_file(shard);
  bytes[bytes.size() - 7] ^= 0x10;
  write_file(shard, bytes);

  Model m(spec());
  m.init_params(5);
  const std::vector<float> before = param_copy(m, 0);
  AdamW opt = make_opt(m);
  expect_error([&] { load_checkpoint(dir.path, m, &opt); },
               {"error: checkpoint file \"" + shard + "\"", "does not match its checksum: checksums.json lists xxh64 " +
                                                                listed + ", the file has ",
                "the file is corrupt", "the latest checkpoint in \"" + dir.path + "\" is damaged",
                "resume from the previous step directory \"" + (dir / "step-00000001") +
                    "\", which save_checkpoint keeps"});
  expect_bitwise_equal(before, m.param(0), "a failed load leaves the model unchanged");
  EXPECT_EQ(load_checkpoint(dir / "step-00000001", m, &opt), 1);

  // A file the save did not write is not silently loaded either.
  fs::remove(dir / "step-00000001/config.json");
  write_file(dir / "step-00000001/config.json", read_file(step + "/config.json") + " ");
  expect_error([&] { load_checkpoint(dir / "step-00000001", m, &opt); },
               {"step-00000001/config.json", "is " + std::to_string(read_file(step + "/config.json").size() + 1) +
                                                 " bytes, but checksums.json lists"});
}

// ---- a full disk --------------------------------------------------------------------------------

struct FailWritesAfter {
  explicit FailWritesAfter(int64_t bytes) {
    ::setenv("HALYARD_TEST_FAIL_WRITE_AFTER_BYTES", std::to_string(bytes).c_str(), 1);
  }
  ~FailWritesAfter() { ::unsetenv("HALYARD_TEST_FAIL_WRITE_AFTER_BYTES"); }
};

TEST(CheckpointErrors, DiskFullDuringSaveKeepsPreviousCheckpoint) {
  TempDir dir;
  Saved s;
  s.model.init_params(1);
  train(s.model, s.opt, 1, 1);
  const int64_t max_shard = model_bytes() / 3 + 1;
  save_checkpoint(dir.path, s.model, s.opt, 1, max_shard);
  std::vector<std::vector<float>> saved;
  for (int i = 0; i < s.model.num_params(); ++i) saved.push_back(param_copy(s.model, i));
  int64_t step_bytes = 0;  // what one save writes, `latest` aside
  for (const auto& e : fs::directory_iterator(dir / "step-00000001")) step_bytes += fs::file_size(e.path());
  train(s.model, s.opt, 2, 2);

  auto expect_step1_intact = [&](const std::string& failed_file) {
    EXPECT_EQ(read_file(dir / "latest"), "step-00000001\n");
    EXPECT_EQ(files_in(dir.path), (std::vector<std::string>{"latest", "step-00000001"}))
        << "no step-00000002, no step-00000002.partial, no temporary file";
    Model m(spec());
    m.init_params(4);
    AdamW opt = make_opt(m);
    EXPECT_EQ(load_checkpoint(dir.path, m, &opt), 1) << failed_file;
    for (int i = 0; i < m.num_params(); ++i) expect_bitwise_equal(saved[static_cast<size_t>(i)], m.param(i), failed_file);
  };
  {  // the disk fills up in the middle of the second shard (a save writes the model's shards first)
    const std::string first = model_shard(dir / "step-00000001", 1), second = model_shard(dir / "step-00000001", 2);
    FailWritesAfter fail(static_cast<int64_t>(fs::file_size(dir / ("step-00000001/" + first))) + 1000);
    expect_error([&] { save_checkpoint(dir.path, s.model, s.opt, 2, max_shard); },
                 {"error: checkpoint step 2 was not saved: No space left on device writing \"" +
                      (dir / ("step-00000002/" + second)) + "\"; the previous checkpoint \"" +
                      (dir / "step-00000001") + "\" is intact.",
                  "`latest` is unchanged", "free space there"});
  }
  expect_step1_intact("the second shard");
  {  // everything of step 2 is written; replacing `latest` fails
    FailWritesAfter fail(step_bytes);
    expect_error([&] { save_checkpoint(dir.path, s.model, s.opt, 2, max_shard); },
                 {"error: checkpoint step 2 was not saved: No space left on device writing \"" + (dir / "latest") +
                      "\"; the previous checkpoint \"" + (dir / "step-00000001") + "\" is intact."});
  }
  expect_step1_intact("latest");
  {  // a save into an empty directory has no previous checkpoint to keep
    TempDir empty;
    FailWritesAfter fail(1000);
    expect_error([&] { save_checkpoint(empty.path, s.model, s.opt, 2, max_shard); },
                 {"checkpoint step 2 was not saved: No space left on device writing",
                  "there is no previous checkpoint in \"" + empty.path + "\""});
    EXPECT_TRUE(files_in(empty.path).empty());
  }
  // With space again, the same save succeeds.
  save_checkpoint(dir.path, s.model, s.opt, 2, max_shard);
  EXPECT_EQ(read_file(dir / "latest"), "step-00000002\n");
}

TEST(CheckpointErrors, DiskFullWhileResavingTheLatestStepKeepsIt) {
  TempDir dir;
  Saved s;
  s.model.init_params(1);
  save_checkpoint(dir.path, s.model, s.opt, 1);
  const std::vector<float> saved = param_copy(s.model, 0);
  train(s.model, s.opt, 1, 1);
  {
    FailWritesAfter fail(5000);
    expect_error([&] { save_checkpoint(dir.path, s.model, s.opt, 1); },
                 {"checkpoint step 1 was not saved", "the previous checkpoint \"" + (dir / "step-00000001") +
                                                         "\" is intact"});
  }
  Model m(spec());
  EXPECT_EQ(load_checkpoint(dir.path, m, nullptr), 1);
  expect_bitwise_equal(saved, m.param(0), "the old step 1");
}

// ---- NaN and infinity -----------------------------------------------------------------------------

TEST(CheckpointErrors, NonFiniteStateIsNotSaved) {
  TempDir dir;
  Saved s;
  s.model.init_params(1);
  save_checkpoint(dir.path, s.model, s.opt, 1);
  const int q = s.model.param_index("model.layers.0.self_attn.q_proj.weight");  // F32[64, 64]
  s.model.param(q)[3 * 64 + 17] = std::nanf("");
  s.model.param(q)[5 * 64] = INFINITY;
  expect_error([&] { save_checkpoint(dir.path, s.model, s.opt, 2); },
               {"error: checkpoint step 2 was not saved: parameter \"model.layers.0.self_attn.q_proj.weight\" "
                "F32[64, 64] holds NaN at element 209 [3, 17].",
                "nothing was written; the previous checkpoint \"" + (dir / "step-00000001") + "\" is intact",
                "the training diverged"});
  s.model.init_params(1);
  s.opt.v(static_cast<size_t>(s.model.param_index("model.norm.weight")))[7] = -INFINITY;
  expect_error([&] { save_checkpoint(dir.path, s.model, s.opt, 2); },
               {"AdamW state \"v/model.norm.weight\" F32[64] holds -inf at element 7 [7]."});
  EXPECT_EQ(files_in(dir.path), (std::vector<std::string>{"latest", "step-00000001"}));
  EXPECT_EQ(read_file(dir / "latest"), "step-00000001\n");
}

TEST(CheckpointErrors, NonFiniteWeightsAreNotLoaded) {
  TempDir dir;
  std::map<std::string, std::string> where = write_hf_shards(dir.path);
  const std::string name = "model.layers.1.mlp.down_proj.weight";  // BF16[64, 128]
  const std::string shard = dir / where[name];
  Safetensors st = Safetensors::read(shard);
  Tensor t = st.at(name);
  const uint16_t inf = 0x7f80;
  std::memcpy(t.bytes.data() + 2 * (128 + 5), &inf, 2);
  st.put(name, t);
  st.write(shard);
  Model m(spec());
  m.init_params(5);
  const std::vector<float> before = param_copy(m, 0);
  expect_error([&] { load_checkpoint(dir.path, m, nullptr); },
               {"error: checkpoint file \"" + shard + "\"", "tensor \"" + name + "\" BF16[64, 128] holds +inf at "
                                                            "element 133 [1, 5]",
                "does not load non-finite values"});
  expect_bitwise_equal(before, m.param(0), "a failed load leaves the model unchanged");
}

}  // namespace
}  // namespace halyard::runtime
