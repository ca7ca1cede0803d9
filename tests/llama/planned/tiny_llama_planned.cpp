// tiny_llama with a plan: a copy of the generated spec, plan_json set.
#include "tiny_llama_planned.h"

#include "tiny_llama.h"

const halyard::runtime::ModelSpec& halyard_models::tiny_llama_planned() {
  static const halyard::runtime::ModelSpec spec = [] {
    halyard::runtime::ModelSpec s = halyard_models::tiny_llama();
    s.name = "tiny_llama_planned";
    s.plan_json = R"({"predicted_peak_bytes_per_rank": 41943040, "predicted_step_s": 0.5,)"
                  R"( "memory_per_rank": {"params": 3145728, "arena": 8388608}, "schedule": "recompute"})";
    return s;
  }();
  return spec;
}
