// The same source plans the same program on every compiler. The scheduled
// joint graph (every node: op, operands, type, attributes, label) and the
// train program's calls of the tiny Llama and Qwen2 under every preset and
// the schedule files the tests use, on CPU ranks and on a GPU cluster, are
// hashed and compared with tests/fixtures/graph_digests.txt. That file was
// written by the GCC build; the sanitizer run (scripts/sanitize.sh) builds
// this test with clang and compares it with the same file. Node numbers
// follow the order nodes are made in, so building two of them inside one
// argument list (whose order C++ leaves unspecified) made clang's graphs
// differ from GCC's until each was made in a statement of its own
// (schedules/sharding.cpp, dsl/vjp.cpp).
//
// When a graph changes on purpose (a model, an op, a pass), rewrite the file
// with the new digests and say why in the commit:
//   HALYARD_WRITE_GRAPH_DIGESTS=1 build/tests/test_graph_digests
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "dsl/error.h"
#include "dsl/graph.h"
#include "examples/llama/llama_builder.h"
#include "examples/qwen2/qwen2_builder.h"
#include "schedules/plan.h"

namespace halyard {
namespace {

const std::string kSource = HALYARD_SOURCE_DIR;
const std::string kDigests = kSource + "/tests/fixtures/graph_digests.txt";

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// The graph as printed, then each call of the train program: its stage's
// root node, whether it is a Wait or a copy, and its buffers.
std::string digest(const Plan& p) {
  std::ostringstream os;
  os << print(*p.model.graph);
  for (const PlannedCall& c : p.train_program.calls) {
    os << (c.stage >= 0 ? p.train.stages[static_cast<size_t>(c.stage)].root : -1) << (c.wait ? " wait" : "") << " "
       << static_cast<int>(c.move);
    for (int a : c.args) os << " " << a;
    os << "\n";
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fnv1a(os.str())));
  return hex;
}

std::map<std::string, std::string> current() {
  const std::vector<std::string> schedules = [] {
    std::vector<std::string> s = Schedule::presets();
    for (const char* f : {"hybrid_2x2", "hybrid_checkpoint_tiled_2x2", "zigzag_checkpoint_tiled", "ring_checkpoint_tiled",
                          "ulysses_checkpoint_tiled", "tiled_micro", "bf16_checkpoint_tiled_micro", "bf16_contract_micro",
                          "gpu_inline_tiled", "offload_all"})
      s.push_back(kSource + "/tests/fixtures/" + f + ".json");
    return s;
  }();
  const struct {
    const char* name;
    ModelBuilder build;
    std::string config;
  } models[] = {{"llama", llama::llama_builder(), kSource + "/examples/llama/configs/tiny.json"},
                {"qwen2", qwen2::qwen2_builder(), kSource + "/examples/qwen2/configs/tiny.json"}};
  std::map<std::string, std::string> out;
  for (const auto& m : models)
    for (const std::string& path : schedules)
      for (int64_t sp : {1, 4})
        for (const char* cluster : {"local-cpu", "8xH200"}) {
          Schedule s = Schedule::named(path);
          const std::string name = path.substr(path.rfind('/') + 1);
          s.mesh.sp = sp;
          std::string d;
          try {
            d = digest(plan(m.build, {m.config, 1, 256}, s, Cluster::named(cluster)));
          } catch (const UserError&) {
            d = "refused";  // (refused alike on every compiler: the tests of errors check the texts)
          }
          out[std::string(m.name) + " " + name + " sp=" + std::to_string(sp) + " " + cluster] = d;
        }
  return out;
}

TEST(GraphDigests, EveryCompilerPlansTheSameGraphsAndPrograms) {
  const std::map<std::string, std::string> now = current();
  if (std::getenv("HALYARD_WRITE_GRAPH_DIGESTS")) {
    std::ofstream f(kDigests);
    f << "# tests/plan/test_graph_digests.cpp: model, schedule, sp, cluster, digest (FNV-1a 64) of the graph and the train program\n";
    for (const auto& [k, v] : now) f << k << " " << v << "\n";
    GTEST_SKIP() << "wrote " << now.size() << " digests to " << kDigests;
  }
  std::ifstream f(kDigests);
  ASSERT_TRUE(f) << "cannot read " << kDigests;
  std::map<std::string, std::string> want;
  for (std::string line; std::getline(f, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t at = line.rfind(' ');
    want[line.substr(0, at)] = line.substr(at + 1);
  }
  int planned = 0;
  for (const auto& [k, v] : now) {
    planned += v != "refused";
    auto it = want.find(k);
    if (it == want.end()) {
      ADD_FAILURE() << k << ": not in " << kDigests;
      continue;
    }
    EXPECT_EQ(v, it->second) << k << ": another graph or program than the recorded one.\n"
                             << "If the graph changed on purpose, rewrite the file: HALYARD_WRITE_GRAPH_DIGESTS=1 "
                                "build/tests/test_graph_digests. If only this compiler differs, two nodes are made "
                                "inside one argument list: make them in statements of their own.";
  }
  EXPECT_EQ(want.size(), now.size()) << "the file lists other configurations";
  EXPECT_GT(planned, 60);
}

}  // namespace
}  // namespace halyard
