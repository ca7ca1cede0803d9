// halyard_aot: a model's generator program.
//
// A model example supplies a main() that calls aot_main() with a function
// building its graph; the result is the generator executable that the CMake
// function halyard_add_model() (generators/halyard.cmake) runs at build time:
//
//   <generator> --name N --config C --schedule S --batch B --seq L --target T --out DIR
//     writes DIR/N.h, DIR/N_program.cpp and DIR/N_kernels.o
//   <generator> ... --plan-only
//     prints the plan (stages, distinct kernels, the activation arena per
//     rank) without compiling anything
//   <generator> --runtime-only --target T --out FILE.o
//     writes the one Halide runtime that every model of that target links
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dsl/graph.h"

namespace halyard {

struct BuiltModel {
  std::unique_ptr<Graph> graph;
  Value loss;
  std::vector<Value> params;
  std::map<std::string, std::vector<int64_t>> hf_shapes;
  int64_t vocab = 0;
  int64_t ignore_index = -100;
  std::string config_json;
};

using ModelBuilder = std::function<BuiltModel(const std::string& config_path, int64_t batch, int64_t seq)>;

int aot_main(int argc, char** argv, const ModelBuilder& build);

}  // namespace halyard
