// Tests for runtime/checkpoint: a bitwise round trip of parameters and AdamW
// state, a resumed run reproducing an uninterrupted one bit for bit, a crash in
// the middle of a save leaving the previous step loadable, one test per kind of
// damaged or mismatched checkpoint (each checking the message), and loading a
// plain Hugging Face folder. Runs on the generated llama_micro_default model
// with the tokens of tests/fixtures/llama_micro.safetensors.
#include "runtime/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/temp_dir.h"

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

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
  std::vector<bool> decay;
  for (int i = 0; i < m.num_params(); ++i) {
    sizes.push_back(m.param_spec(i).numel);
    decay.push_back(m.param_spec(i).rank > 1);
  }
  return AdamW(sizes, decay);
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

// Rewrites the latest model.safetensors of dir with `edit` applied.
void edit_weights(const std::string& dir, const std::function<void(Safetensors&)>& edit) {
  const std::string path = dir + "/step-00000002/model.safetensors";
  Safetensors st = Safetensors::read(path);
  edit(st);
  st.write(path);
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
               {path, "truncated", "the latest checkpoint", "is damaged",
                "step directories that load directly: step-00000001; pass one of them."});
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

}  // namespace
}  // namespace halyard::runtime
