// The schedule presets, rewritten in the per-value vocabulary, must give
// bitwise the libraries' results of before: the loss and every gradient of
// one train step of each preset's library equal, bit for bit, the values
// committed in tests/fixtures/presets_golden.txt (written by this program
// with --write from the libraries as they were before the rewrite, and
// rewritten when a kernel's arithmetic changes on purpose: last, when the
// sequence tiles took in the norm before the MLP and the LM head
// (schedules/tiling.cpp), so that a norm's weight gradient became a sum of
// per-tile parts (6 hashes changed, only those norms' weights: each tile's
// part of the input's gradient is added to rows it alone writes, to the
// bit); before that, when a
// gradient summed from parts that kernels write became a running sum in
// a kernel of its own (schedules/partition.cpp), where its reader's kernel
// had computed it and rounded otherwise (66 hashes changed; the reference
// tests agree as before, and the losses kept their bits); before that,
// when a backward that recomputes attention's log-sum-exp alone began
// computing it with the library's forward instead of a Halide kernel, so that
// checkpoint's gradients became recompute's bits, all 23 values; before
// that, when the per-token reductions (a norm's sums, the loss's) began
// summing a vector of tokens side by side, where LLVM fuses the
// multiply-adds of the backward's dot products otherwise than in the scalar
// loop; the losses were the same bits both times): the losses as exact hex
// floats, each gradient as a 64-bit FNV-1a hash of its bits. The bits are
// the same on an AVX2 and an AVX-512 machine (recorded on an AMD Zen 3,
// AVX2; equal on a Zen 4 with AVX-512 once Halide's attention kernels summed
// a row's lanes as one vector of the key block's width, not the target's).
//
//   test_presets_golden                 compare (ctest, label "plan")
//   test_presets_golden --write FILE    record the current libraries' results
#include <gtest/gtest.h>

#include <thread>

#include "llama_micro_checkpoint.h"
#include "llama_micro_default.h"
#include "llama_micro_recompute.h"
#include "llama_micro_tiled.h"
#include <fstream>
#include <map>
#include <sstream>
#include "tests/generators/sp_check.h"
#include "tiny_sp2_s128.h"
#include "tiny_sp4_s126_tiled.h"

namespace halyard {
namespace {

const std::string kGolden = std::string(HALYARD_SOURCE_DIR) + "/tests/fixtures/presets_golden.txt";

std::string bits(const std::vector<float>& v) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
  char s[32];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(h));
  return s;
}

std::string hex(double x) {
  char s[64];
  std::snprintf(s, sizeof s, "%a", x);
  return s;
}

// "name value" per line.
std::map<std::string, std::string> results_of(const runtime::ModelSpec& spec);

std::map<std::string, std::string> read_golden() {
  std::ifstream in(kGolden);
  std::map<std::string, std::string> m;
  for (std::string k, v; in >> k >> v;) m[k] = v;
  return m;
}

// Rank 0's result of one step of `spec` over `ranks` in-process ranks.
sp_check::StepResult step_of(const runtime::ModelSpec& spec) {
  if (spec.sp == 1) return sp_check::run_step(spec, nullptr);
  auto group = runtime::make_in_process_group(spec.sp);
  std::vector<sp_check::StepResult> results(static_cast<size_t>(spec.sp));
  std::vector<std::thread> threads;
  for (int r = 0; r < spec.sp; ++r)
    threads.emplace_back([&, r] { results[static_cast<size_t>(r)] = sp_check::run_step(spec, group[static_cast<size_t>(r)].get()); });
  for (auto& t : threads) t.join();
  return results[0];
}

const std::vector<const runtime::ModelSpec*>& libraries() {
  static const std::vector<const runtime::ModelSpec*> all = {
      &halyard_models::llama_micro_default(), &halyard_models::llama_micro_recompute(),
      &halyard_models::llama_micro_checkpoint(), &halyard_models::llama_micro_tiled(),
      &halyard_models::tiny_sp2_s128(), &halyard_models::tiny_sp4_s126_tiled()};
  return all;
}

std::map<std::string, std::string> results_of(const runtime::ModelSpec& spec) {
  const sp_check::StepResult r = step_of(spec);
  const std::string at = std::string(spec.name) + "/";
  std::map<std::string, std::string> m = {{at + "loss", hex(r.loss)}, {at + "forward_loss", hex(r.forward_loss)}};
  for (int i = 0; i < spec.num_params; ++i) m[at + spec.params[i].name] = bits(r.grads[static_cast<size_t>(i)]);
  return m;
}

TEST(Plan, PresetsReproduceTheirLibrariesBitwise) {
  const auto golden = read_golden();
  ASSERT_FALSE(golden.empty()) << "cannot read " << kGolden;
  for (const runtime::ModelSpec* spec : libraries()) {
    int differing = 0, total = 0;
    for (const auto& [name, value] : results_of(*spec)) {
      ++total;
      auto it = golden.find(name);
      ASSERT_NE(it, golden.end()) << name << " is not in " << kGolden;
      if (it->second != value) ++differing, ADD_FAILURE() << name << ": " << value << " but golden " << it->second;
    }
    std::printf("  %s (%s): %d of %d values differ from the golden bits\n", spec->name, spec->schedule, differing, total);
  }
}

// Recomputing a value in the backward runs the kernel that computed it in
// the forward, so checkpointing changes memory, not numbers: checkpoint's
// loss and gradients are recompute's bits (the schedules differ only in
// what the backward recomputes). A recomputed log-sum-exp alone was a
// Halide kernel while the forward's came from the library, and every
// gradient differed in its last bits.
TEST(Plan, CheckpointingChangesNoBitOfTheLossOrGradients) {
  const std::map<std::string, std::string> saved = results_of(halyard_models::llama_micro_recompute()),
                                           recomputed = results_of(halyard_models::llama_micro_checkpoint());
  ASSERT_EQ(saved.size(), recomputed.size());
  for (auto s = saved.begin(), r = recomputed.begin(); s != saved.end(); ++s, ++r) {
    ASSERT_EQ(s->first.substr(s->first.find('/')), r->first.substr(r->first.find('/')));
    EXPECT_EQ(s->second, r->second) << r->first << " differs from " << s->first;
  }
}

}  // namespace
}  // namespace halyard

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--write") {
    std::ofstream out(argv[2]);
    size_t n = 0;
    for (const halyard::runtime::ModelSpec* spec : halyard::libraries())
      for (const auto& [name, value] : halyard::results_of(*spec)) out << name << " " << value << "\n", ++n;
    std::printf("wrote %zu values to %s\n", n, argv[2]);
    return out.good() ? 0 : 1;
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
