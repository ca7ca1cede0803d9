// A model library that carries a plan (ModelSpec::plan_json), for the test of
// llama_train's plan line and metrics (ctest train_plan): llama_train's
// single-rank tiny Llama with fixed, made-up predictions, until the generator
// writes real ones. Same shape as a generated header (halyard_add_model).
#pragma once
#include "runtime/model.h"

namespace halyard_models {
const halyard::runtime::ModelSpec& tiny_llama_planned();
}  // namespace halyard_models
