// The Llama demo on the reference interpreter: builds the tiny Llama from its
// config.json, differentiates it into one joint forward+backward graph, and
// runs forward+backward on bytes of the bundled corpus, printing the graph,
// the loss and gradient norms (and, with --steps N, N steps of plain SGD).
//
//   llama_reference [--config C] [--data F] [--seq N] [--batch B] [--steps N]
//                   [--lr X] [--seed S] [--print-graph 0|1] [--dtype f32|f64]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <random>
#include <string>

#include "dsl/autodiff.h"
#include "dsl/error.h"
#include "dsl/interpreter.h"
#include "examples/llama/llama_model.h"

using namespace halyard;

namespace {

struct Args {
  std::string config = HALYARD_SOURCE_DIR "/examples/llama/configs/tiny.json";
  std::string data = HALYARD_SOURCE_DIR "/examples/llama/data/corpus.txt";
  int64_t seq = 512, batch = 1;
  int steps = 1;
  double lr = 0.05;
  unsigned seed = 0;
  bool print_graph = true;
  std::string dtype = "f32";
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw UserError("error: " + k + " needs a value.");
      return argv[++i];
    };
    if (k == "--config") a.config = next();
    else if (k == "--data") a.data = next();
    else if (k == "--seq") a.seq = std::stoll(next());
    else if (k == "--batch") a.batch = std::stoll(next());
    else if (k == "--steps") a.steps = std::stoi(next());
    else if (k == "--lr") a.lr = std::stod(next());
    else if (k == "--seed") a.seed = static_cast<unsigned>(std::stoul(next()));
    else if (k == "--print-graph") a.print_graph = next() != "0";
    else if (k == "--dtype") a.dtype = next();
    else
      throw UserError("error: unknown option \"" + k +
                      "\".\nlegal: --config --data --seq --batch --steps --lr --seed --print-graph --dtype");
  }
  if (a.seq <= 0 || a.batch <= 0 || a.steps < 0)
    throw UserError("error: --seq and --batch must be positive and --steps >= 0.");
  if (a.dtype != "f32" && a.dtype != "f64") throw UserError("error: --dtype " + a.dtype + "\nlegal: f32 or f64.");
  return a;
}

template <class T>
int run(const Args& a) {
  auto cfg = llama::LlamaConfig::load(a.config);
  auto m = llama::build_llama(cfg, a.batch, a.seq, a.dtype == "f32" ? DType::f32 : DType::f64);
  Gradients grads = grad(m.loss, m.params);
  verify(*m.graph);
  if (a.print_graph) std::cout << print(*m.graph) << "\n";
  std::cout << "graph: " << m.graph->size() << " nodes, " << m.params.size() << " parameters, "
            << residuals(*m.graph).size() << " forward values read by the backward\n";

  // Bytes of the corpus as tokens; labels are the next byte (shifted before use).
  std::ifstream in(a.data, std::ios::binary);
  if (!in) throw UserError("error: cannot open data file \"" + a.data + "\".");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const int64_t need = a.batch * (a.seq + 1);
  if (static_cast<int64_t>(text.size()) < need)
    throw UserError("error: data file \"" + a.data + "\" has " + std::to_string(text.size()) +
                    " bytes; batch " + std::to_string(a.batch) + " x (seq " + std::to_string(a.seq) +
                    " + 1) needs " + std::to_string(need) + ".\nlegal: a shorter --seq or a larger file.");
  std::vector<int32_t> ids, labels, pos;
  for (int64_t b = 0; b < a.batch; ++b)
    for (int64_t s = 0; s < a.seq; ++s) {
      ids.push_back(static_cast<unsigned char>(text[b * (a.seq + 1) + s]));
      labels.push_back(static_cast<unsigned char>(text[b * (a.seq + 1) + s + 1]));
      pos.push_back(static_cast<int32_t>(s));
    }

  // HF's init: normal(0, 0.02) for matrices, ones for norms.
  std::mt19937 rng(a.seed);
  std::normal_distribution<double> normal(0.0, 0.02);
  std::map<std::string, std::vector<T>> weights;
  for (const Value& p : m.params) {
    auto& w = weights[p.node().name];
    w.resize(static_cast<size_t>(p.type().numel()));
    bool is_norm = p.type().rank() == 1;
    for (auto& x : w) x = is_norm ? T(1) : static_cast<T>(normal(rng));
  }

  for (int step = 0; step < std::max(a.steps, 1); ++step) {
    Interpreter<T> interp(*m.graph);
    interp.set_int("input_ids", ids);
    interp.set_int("labels", labels);
    interp.set_int("position_ids", pos);
    for (auto& [name, w] : weights) interp.set(name, w);
    auto t0 = std::chrono::steady_clock::now();
    interp.run();
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("step %d  loss %.6f  (forward+backward %.2f s, %.0f tokens/s, reference interpreter, %s)\n", step,
                static_cast<double>(interp.scalar(m.loss)), secs, static_cast<double>(a.batch * a.seq) / secs,
                a.dtype.c_str());
    if (step == 0)
      for (const Value& p : m.params) {
        double ss = 0;
        for (T g : interp.value(grads[p])) ss += static_cast<double>(g) * static_cast<double>(g);
        std::printf("  |grad %-48s| = %.6e\n", p.node().name.c_str(), std::sqrt(ss));
      }
    if (a.steps == 0) break;
    for (const Value& p : m.params) {
      const auto& gv = interp.value(grads[p]);
      auto& w = weights[p.node().name];
      for (size_t i = 0; i < w.size(); ++i) w[i] -= static_cast<T>(a.lr) * gv[i];
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args a = parse_args(argc, argv);
    return a.dtype == "f64" ? run<double>(a) : run<float>(a);
  } catch (const UserError& e) {
    std::cerr << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
}
