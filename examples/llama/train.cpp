// Trains the tiny Llama with its AOT-generated library on the bundled corpus:
// the path a user takes (model in the DSL -> schedule -> Halide kernels built
// by halyard_add_model -> a plain C++ loop). Single rank for now; sequence
// parallel training over MPI ranks builds on this.
//
//   llama_train [--steps N] [--lr X] [--warmup N] [--seed S] [--threads T]
//               [--data TEXT | --tokens FILE --token-width 16|32]
//               [--save DIR] [--save-every N] [--resume DIR] [--step-check OUT]
//               [--clip MAX_NORM (1.0; 0 = off)] [--metrics FILE.jsonl]
//
// Data (runtime/data.h): --data reads a text file one byte per token (the
// default is the bundled corpus); --tokens reads a headerless little-endian
// uint16 or uint32 token file (nanoGPT's train.bin is --token-width 16).
// --save writes a checkpoint (runtime/checkpoint.h) every --save-every steps
// and after the last step; --resume continues from a checkpoint's step + 1 up
// to --steps. The batch of a step is a pure function of (seed, step), so a
// resumed run with the same flags reproduces the uninterrupted run exactly.
//
// --step-check OUT.safetensors (needs --resume DIR: a checkpoint or an HF
// folder with model.safetensors + config.json) runs ONE train_step on the
// batch of step 1 and writes OUT with `loss` (F64 []), `input_ids`, `labels`,
// `position_ids` (I32 [batch, seq]) and `grad/<HF name>` of every parameter
// (F32, HF shape), then exits without updating the parameters: the numbers to
// compare against another framework's step on the same weights and batch.
#include <sys/resource.h>

#include <chrono>
#include <fstream>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "runtime/adamw.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/error.h"
#include "runtime/model.h"
#include "runtime/lr_schedule.h"
#include "runtime/safetensors.h"
#include "tiny_llama.h"

using namespace halyard;

int main(int argc, char** argv) {
  int steps = 30, warmup = 5, threads = 0, save_every = 0;
  double clip = 1.0;
  std::string save_dir, resume_dir, tokens, step_check, metrics_path;
  int token_width = 0;
  double lr = 3e-3;
  unsigned seed = 0;
  std::string data = HALYARD_SOURCE_DIR "/examples/llama/data/corpus.txt";
  bool data_given = false;
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
    else if (k == "--data") data = v, data_given = true;
    else if (k == "--save") save_dir = v;
    else if (k == "--save-every") save_every = std::stoi(v);
    else if (k == "--resume") resume_dir = v;
    else if (k == "--tokens") tokens = v;
    else if (k == "--token-width") token_width = std::stoi(v);
    else if (k == "--step-check") step_check = v;
    else if (k == "--clip") clip = std::stod(v);
    else if (k == "--metrics") metrics_path = v;
    else {
      std::cerr << "error: unknown option \"" << k << "\".\nlegal: --steps --lr --warmup --seed --threads --data --tokens "
                   "--token-width --save --save-every --resume --step-check --clip --metrics\n";
      return 2;
    }
  }
  if (save_every < 0 || (save_every > 0 && save_dir.empty())) {
    std::cerr << "error: --save-every " << save_every << " needs --save DIR and a count >= 1 (0 saves only at the end).\n";
    return 2;
  }
  if (!tokens.empty() && data_given) {
    std::cerr << "error: --data \"" << data << "\" and --tokens \"" << tokens
              << "\" both name the training data.\nfix: pass --data for a text file or --tokens for a token file, not both.\n";
    return 2;
  }
  if (tokens.empty() != (token_width == 0) || (token_width != 0 && token_width != 16 && token_width != 32)) {
    std::cerr << "error: --tokens needs --token-width and --token-width needs --tokens (got --tokens \"" << tokens
              << "\", --token-width " << token_width << ").\nlegal widths: 16 (uint16 ids), 32 (uint32 ids)\n";
    return 2;
  }
  if (!step_check.empty() && resume_dir.empty()) {
    std::cerr << "error: --step-check \"" << step_check
              << "\" needs --resume DIR: the weights must be ones another framework can load.\n"
                 "fix: pass a checkpoint directory or an HF folder (model.safetensors + config.json).\n";
    return 2;
  }
  try {
    runtime::Model::set_num_threads(threads > 0 ? threads : runtime::default_threads_per_rank());
    runtime::Model m(halyard_models::tiny_llama());
    m.init_params(seed);
    const int64_t seq = m.spec().seq, batch = m.spec().batch;
    const runtime::TokenFile file =
        tokens.empty() ? runtime::TokenFile::from_text(data)
                       : runtime::TokenFile::open(tokens, token_width == 16 ? runtime::TokenWidth::U16 : runtime::TokenWidth::U32);
    // The batch of a step depends on (seed, step) alone, so resuming sees the same data.
    const runtime::Batcher batcher(file, batch, seq, m.spec().vocab, seed);
    std::vector<int32_t> ids(static_cast<size_t>(batch * seq)), labels(ids.size()), pos(ids.size());
    if (!step_check.empty()) {
      const int64_t loaded = runtime::load_checkpoint(resume_dir, m, nullptr);
      batcher.fill(1, ids.data(), labels.data(), pos.data());
      const double loss = m.train_step(ids.data(), labels.data(), pos.data());
      runtime::Safetensors out;
      out.put_f64("loss", {}, {loss});
      out.put_i32("input_ids", {batch, seq}, ids);
      out.put_i32("labels", {batch, seq}, labels);
      out.put_i32("position_ids", {batch, seq}, pos);
      for (int i = 0; i < m.num_params(); ++i) {
        const runtime::ParamSpec& p = m.param_spec(i);
        out.put_f32(std::string("grad/") + p.name, {p.hf_shape, p.hf_shape + p.hf_rank},
                    std::vector<float>(m.grad(i), m.grad(i) + p.numel));
      }
      out.metadata["weights"] = resume_dir;
      out.metadata["weights_step"] = std::to_string(loaded);
      out.metadata["data"] = file.path();
      out.metadata["seed"] = std::to_string(seed);
      out.metadata["step"] = "1";
      out.write(step_check);
      std::printf("step-check: weights \"%s\" (step %lld), batch of step 1 (seed %u, %lld x %lld tokens of \"%s\")\n",
                  resume_dir.c_str(), static_cast<long long>(loaded), seed, static_cast<long long>(batch),
                  static_cast<long long>(seq), file.path().c_str());
      std::printf("step-check: loss %.9g; wrote %zu tensors to \"%s\"; parameters not updated\n", loss, out.size(),
                  step_check.c_str());
      return 0;
    }
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
    std::ofstream metrics;
    if (!metrics_path.empty()) {
      metrics.open(metrics_path, std::ios::app);
      if (!metrics) throw runtime::Error("error: cannot open metrics file \"" + metrics_path + "\" for appending.");
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int step = first; step <= steps; ++step) {
      batcher.fill(step, ids.data(), labels.data(), pos.data());
      const double loss = m.train_step(ids.data(), labels.data(), pos.data());
      const double frac = runtime::warmup_cosine_lr(step, steps, warmup, 1.0);  // times --lr
      const double norm = runtime::global_grad_norm(grads.data(), sizes);
      opt.step(step, lr * frac, params.data(), grads.data(), runtime::clip_scale(norm, clip));
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const int done = step - first + 1;
      const double tps = static_cast<double>(done * batch * seq) / secs;
      rusage usage{};
      getrusage(RUSAGE_SELF, &usage);
      const double rss_mib = static_cast<double>(usage.ru_maxrss) / 1024.0;
      std::printf("step %4d/%d  loss %.4f  |g| %.3f  lr %.2e  %7.0f tokens/s  peak %.0f MiB  ETA %.0fs\n", step, steps, loss,
                  norm, lr * frac, tps, rss_mib, secs / done * (steps - step));
      if (metrics.is_open())
        metrics << "{\"step\":" << step << ",\"loss\":" << loss << ",\"grad_norm\":" << norm << ",\"lr\":" << lr * frac
                << ",\"tokens_per_s\":" << tps << ",\"peak_rss_mib\":" << rss_mib << "}\n" << std::flush;
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
