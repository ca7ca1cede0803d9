// The Llama model's generator: halyard_add_model(... GENERATOR llama_aot ...)
// runs it at build time to AOT-compile a config + schedule into a library.
#include "examples/llama/llama_model.h"
#include "generators/aot.h"

int main(int argc, char** argv) {
  return halyard::aot_main(argc, argv, [](const std::string& config_path, int64_t batch, int64_t seq) {
    auto cfg = halyard::llama::LlamaConfig::load(config_path);
    auto m = halyard::llama::build_llama(cfg, batch, seq);
    halyard::BuiltModel b;
    b.graph = std::move(m.graph);
    b.loss = m.loss;
    b.params = m.params;
    b.hf_shapes = m.hf_shapes;
    b.vocab = cfg.vocab_size;
    b.config_json = cfg.to_json();
    return b;
  });
}
