// Trains the tiny Llama with its AOT-generated library on the bundled corpus:
// the path a user takes (model in the DSL -> schedule -> Halide kernels built
// by halyard_add_model -> a plain C++ loop). Single rank for now; sequence
// parallel training over MPI ranks builds on this.
//
//   llama_train [--steps N] [--lr X] [--warmup N] [--seed S] [--threads T] [--data F]
//               [--save DIR] [--save-every N] [--resume DIR]
//
// --save writes a checkpoint (runtime/checkpoint.h) every --save-every steps
// and after the last step; --resume continues from a checkpoint's step + 1 up
// to --steps. The batch of a step is a pure function of (seed, step), so a
// resumed run with the same flags reproduces the uninterrupted run exactly.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "runtime/adamw.h"
#include "runtime/checkpoint.h"
#include "runtime/error.h"
#include "runtime/model.h"
#include "tiny_llama.h"

using namespace halyard;

int main(int argc, char** argv) {
  int steps = 30, warmup = 5, threads = 0, save_every = 0;
  std::string save_dir, resume_dir;
  double lr = 3e-3;
  unsigned seed = 0;
  std::string data = HALYARD_SOURCE_DIR "/examples/llama/data/corpus.txt";
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (i + 1 >= argc) {
      std::cerr << "error: " << k << " needs a value.\n";
      return 2;
    }
    std::string v = argv[++i];
    if (k == "--steps") steps = std::stoi(v);
    else if (k == "--lr") lr = std::stod(v);
    else if (k == "--warmup") warmup = std::stoi(v);
    else if (k == "--seed") seed = static_cast<unsigned>(std::stoul(v));
    else if (k == "--threads") threads = std::stoi(v);
    else if (k == "--data") data = v;
    else if (k == "--save") save_dir = v;
    else if (k == "--save-every") save_every = std::stoi(v);
    else if (k == "--resume") resume_dir = v;
    else {
      std::cerr << "error: unknown option \"" << k << "\".\nlegal: --steps --lr --warmup --seed --threads --data --save --save-every --resume\n";
      return 2;
    }
  }
  if (save_every < 0 || (save_every > 0 && save_dir.empty())) {
    std::cerr << "error: --save-every " << save_every << " needs --save DIR and a count >= 1 (0 saves only at the end).\n";
    return 2;
  }
  try {
    if (threads > 0) runtime::Model::set_num_threads(threads);
    runtime::Model m(halyard_models::tiny_llama());
    m.init_params(seed);
    std::ifstream in(data, std::ios::binary);
    if (!in) throw runtime::Error("error: cannot open data file \"" + data + "\".");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const int64_t seq = m.spec().seq, batch = m.spec().batch;
    if (static_cast<int64_t>(text.size()) < seq + 1)
      throw runtime::Error("error: data file \"" + data + "\" has " + std::to_string(text.size()) +
                           " bytes; the model was built for seq " + std::to_string(seq) + " and needs at least " +
                           std::to_string(seq + 1) + ".");
    std::vector<int64_t> sizes;
    std::vector<bool> decay;
    std::vector<float*> params;
    std::vector<const float*> grads;
    for (int i = 0; i < m.num_params(); ++i) {
      sizes.push_back(m.param_spec(i).numel);
      decay.push_back(m.param_spec(i).rank > 1);
      params.push_back(m.param(i));
      grads.push_back(m.grad(i));
    }
    runtime::AdamW opt(sizes, decay);
    std::printf("tiny_llama: %s, %s; batch %lld x seq %lld, %d kernels, activation arena %.1f MiB\n", m.spec().target,
                m.spec().schedule, static_cast<long long>(batch), static_cast<long long>(seq), m.spec().num_kernels,
                static_cast<double>(m.arena_bytes()) / (1 << 20));
    int first = 1;
    if (!resume_dir.empty()) {
      const int64_t loaded = runtime::load_checkpoint(resume_dir, m, &opt);
      first = static_cast<int>(loaded) + 1;
      std::printf("resumed from \"%s\" at step %lld; continuing with step %d of %d\n", resume_dir.c_str(),
                  static_cast<long long>(loaded), first, steps);
    }
    std::uniform_int_distribution<size_t> start(0, text.size() - static_cast<size_t>(seq) - 1);
    std::vector<int32_t> ids(static_cast<size_t>(batch * seq)), labels(ids.size()), pos(ids.size());
    const auto t0 = std::chrono::steady_clock::now();
    for (int step = first; step <= steps; ++step) {
      // The batch depends on (seed, step) alone, so resuming sees the same data.
      std::mt19937_64 rng(static_cast<uint64_t>(seed) * 1000003u + static_cast<uint64_t>(step));
      for (int64_t b = 0; b < batch; ++b) {  // a random window; labels are the next bytes
        const size_t s0 = start(rng);
        for (int64_t t = 0; t < seq; ++t) {
          const size_t k = static_cast<size_t>(b * seq + t);
          ids[k] = static_cast<unsigned char>(text[s0 + static_cast<size_t>(t)]);
          labels[k] = static_cast<unsigned char>(text[s0 + static_cast<size_t>(t) + 1]);
          pos[k] = static_cast<int32_t>(t);
        }
      }
      const double loss = m.train_step(ids.data(), labels.data(), pos.data());
      // warmup then cosine decay to 10%
      const double frac = step <= warmup ? static_cast<double>(step) / warmup
                                         : 0.1 + 0.45 * (1 + std::cos(M_PI * (step - warmup) / std::max(1, steps - warmup)));
      opt.step(step, lr * frac, params.data(), grads.data());
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const int done = step - first + 1;
      std::printf("step %4d/%d  loss %.4f  lr %.2e  %7.0f tokens/s  ETA %.0fs\n", step, steps, loss, lr * frac,
                  static_cast<double>(done * batch * seq) / secs, secs / done * (steps - step));
      if (!save_dir.empty() && ((save_every > 0 && step % save_every == 0) || step == steps)) {
        runtime::save_checkpoint(save_dir, m, opt, step);
        std::printf("saved step %d to \"%s/%s\"\n", step, save_dir.c_str(), runtime::checkpoint_step_name(step).c_str());
      }
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  return 0;
}
