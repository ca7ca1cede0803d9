// The model libraries a training binary made by halyard_add_llama_train()
// (examples/llama/CMakeLists.txt) links, one per sp degree it can run: the
// build generates the definitions from its MODELS list, in that order, so
// train.cpp names no library itself.
#pragma once

#include "runtime/step_program.h"

extern const halyard::runtime::ModelSpec* const halyard_linked_models[];
extern const int halyard_linked_model_count;
// The executable's name, for messages that say how to link another library.
extern const char* const halyard_train_target;
