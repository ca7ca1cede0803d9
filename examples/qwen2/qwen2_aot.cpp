// The Qwen2 model's generator: halyard_add_model(... GENERATOR qwen2_aot ...)
// runs it at build time to AOT-compile a config + schedule into a library.
// The builder is all a model supplies: its graph, loss, parameters with their
// HF shapes, and the config the library records (a checkpoint must match it).
#include "examples/qwen2/qwen2_config.h"
#include "examples/qwen2/qwen2_model.h"
#include "generators/aot.h"

namespace {

halyard::BuiltModel build(const std::string& config_path, int64_t batch, int64_t seq, int64_t layers) {
  auto cfg = halyard::qwen2::Qwen2Config::load(config_path);
  const std::string config_json = cfg.to_json();  // the config as published, whatever `layers` builds
  const int64_t configured = cfg.num_hidden_layers;
  if (layers > 0) cfg.num_hidden_layers = layers;  // the AutoSP search builds a few layers and extrapolates
  auto m = halyard::qwen2::build_qwen2(cfg, batch, seq);
  halyard::BuiltModel b;
  b.graph = std::move(m.graph);
  b.loss = m.loss;
  b.params = m.params;
  b.hf_shapes = m.hf_shapes;
  b.vocab = cfg.vocab_size;
  b.config_json = config_json;
  b.layers = layers > 0 ? layers : configured;
  return b;
}

}  // namespace

int main(int argc, char** argv) { return halyard::aot_main(argc, argv, build); }
