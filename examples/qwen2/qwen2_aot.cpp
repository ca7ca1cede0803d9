// The Qwen2 model's generator: halyard_add_model(... GENERATOR qwen2_aot ...)
// runs it at build time to AOT-compile a config + schedule into a library.
// The builder (qwen2_builder.h) is all a model supplies.
#include "examples/qwen2/qwen2_builder.h"
#include "generators/aot.h"

int main(int argc, char** argv) { return halyard::aot_main(argc, argv, halyard::qwen2::qwen2_builder()); }
