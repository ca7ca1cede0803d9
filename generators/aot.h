// halyard_aot: a model's generator program.
//
// A model example supplies a main() that calls aot_main() with a function
// building its graph; the result is the generator executable that the CMake
// function halyard_add_model() (generators/halyard.cmake) runs at build time:
//
//   <generator> --name N --config C --schedule S --batch B --seq L --target T --out DIR
//     writes DIR/N.h, DIR/N_program.cpp and DIR/N_kernels.o
//   <generator> ... --plan-only [--plan-json FILE]
//     prints the plan (schedules/plan.h: stages by layer, collectives, memory
//     per rank, predicted step time on --cluster) without compiling anything;
//     --plan-json writes the whole plan (also when compiling)
//   --cluster NAME|FILE (local-cpu): the cluster the plan predicts for
//   <generator> --runtime-only --target T --out FILE.o
//     writes the one Halide runtime that every model of that target links
#pragma once


#include "schedules/plan.h"

namespace halyard {

int aot_main(int argc, char** argv, const ModelBuilder& build);

}  // namespace halyard
