// Training-step throughput and memory of generated tiny-Llama libraries.
//
//   step_bench --model NAME [--threads N] [--steps K]
// runs K forward+backward steps of one generated model (one model per process,
// so peak RSS is that model's) on bytes of the bundled corpus, and prints one
// JSON line: median step time, tokens/s, activation arena and peak RSS.
// scripts/bench.sh runs it for every variant next to the PyTorch peer.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "runtime/model.h"
#include "tiny_s1024_checkpoint.h"
#include "tiny_s1024_default.h"
#include "tiny_s1024_recompute.h"
#include "tiny_s1024_tiled.h"
#include "tiny_s1024_tiled_bf16.h"
#include "tiny_s4096_checkpoint.h"
#include "tiny_s4096_default.h"
#include "tiny_s4096_recompute.h"
#include "tiny_s4096_tiled.h"
#include "tiny_s4096_tiled_bf16.h"
#include "tiny_s8192_checkpoint.h"
#include "tiny_s8192_default.h"
#include "tiny_s8192_recompute.h"
#include "tiny_s8192_tiled.h"
#include "tiny_s8192_tiled_bf16.h"

using namespace halyard;

int main(int argc, char** argv) {
#define HALYARD_MODEL(seq, sched) {"tiny_s" #seq "_" #sched, &halyard_models::tiny_s##seq##_##sched}
  std::map<std::string, const runtime::ModelSpec& (*)()> models = {
      HALYARD_MODEL(1024, default), HALYARD_MODEL(1024, recompute), HALYARD_MODEL(1024, checkpoint), HALYARD_MODEL(1024, tiled), HALYARD_MODEL(1024, tiled_bf16),
      HALYARD_MODEL(4096, default), HALYARD_MODEL(4096, recompute), HALYARD_MODEL(4096, checkpoint), HALYARD_MODEL(4096, tiled), HALYARD_MODEL(4096, tiled_bf16),
      HALYARD_MODEL(8192, default), HALYARD_MODEL(8192, recompute), HALYARD_MODEL(8192, checkpoint), HALYARD_MODEL(8192, tiled), HALYARD_MODEL(8192, tiled_bf16),
  };
#undef HALYARD_MODEL
  std::string name;
  int threads = 2, steps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--model") name = argv[i + 1];
    else if (k == "--threads") threads = std::atoi(argv[i + 1]);
    else if (k == "--steps") steps = std::atoi(argv[i + 1]);
  }
  if (!models.count(name)) {
    std::fprintf(stderr, "error: --model must be one of:");
    for (auto& [n, f] : models) std::fprintf(stderr, " %s", n.c_str());
    std::fprintf(stderr, "\n");
    return 2;
  }
  runtime::Model::set_num_threads(threads);
  runtime::Model m(models[name]());
  m.init_params(0);
  std::ifstream in(HALYARD_SOURCE_DIR "/examples/llama/data/corpus.txt", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const int64_t n = m.tokens(), seq = m.spec().seq;
  std::vector<int32_t> ids(static_cast<size_t>(n)), labels(static_cast<size_t>(n)), pos(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    ids[static_cast<size_t>(t)] = static_cast<unsigned char>(text[static_cast<size_t>(t) % text.size()]);
    labels[static_cast<size_t>(t)] = static_cast<unsigned char>(text[static_cast<size_t>(t + 1) % text.size()]);
    pos[static_cast<size_t>(t)] = static_cast<int32_t>(t % seq);
  }
  double loss = 0;
  const double secs = bench::median_seconds([&] { loss = m.train_step(ids.data(), labels.data(), pos.data()); }, steps);
  std::printf("{\"peer\":\"halyard\",\"model\":\"%s\",\"schedule\":\"%s\",\"threads\":%d,\"seq\":%lld,\"batch\":%lld,"
              "\"kernels\":%d,\"loss\":%.6f,\"step_s_median\":%.4f,\"tokens_per_s\":%.1f,\"arena_mib\":%.2f,\"peak_rss_mib\":%.1f}\n",
              name.c_str(), m.spec().schedule, threads, static_cast<long long>(seq), static_cast<long long>(m.spec().batch),
              m.spec().num_kernels, loss, secs, static_cast<double>(n) / secs,
              static_cast<double>(m.arena_bytes()) / (1 << 20), bench::peak_rss_mib());
  if (std::getenv("HALYARD_PROFILE")) std::printf("%s", m.profile().c_str());
  return 0;
}
