// The Llama model's generator: halyard_add_model(... GENERATOR llama_aot ...)
// runs it at build time to AOT-compile a config + schedule into a library.
#include "examples/llama/llama_builder.h"
#include "generators/aot.h"

int main(int argc, char** argv) { return halyard::aot_main(argc, argv, halyard::llama::llama_builder()); }
