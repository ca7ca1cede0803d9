// Training checkpoints: written atomically, loaded with strict validation, so
// that a resumed run continues exactly where the saved one stopped.
//
// Layout of a checkpoint directory `dir`:
//
//   dir/step-00000300/model.safetensors      every parameter under its HF name,
//                                            F32, HF shape (loads in transformers)
//   dir/step-00000300/optimizer.safetensors  AdamW state "m/<name>", "v/<name>",
//                                            F32, HF shape; metadata "step"
//   dir/step-00000300/config.json            the model spec's config_json
//   dir/latest                               "step-00000300\n"
//
// Crash safety: every file is written to a temporary file, fsync'ed and renamed
// into place; `latest` is replaced the same way only after all files of the new
// step are complete. A crash at any point leaves `latest` naming the previous
// complete checkpoint. save_checkpoint keeps the new and the previous step
// directories and deletes older ones.
//
// Loading reads `dir/latest`, or `dir` itself when it holds model.safetensors
// (a Hugging Face folder: model.safetensors + config.json, no optimizer state;
// its step is 0). Nothing is modified unless everything validates: the config
// (every key of the spec's config must match), every parameter present with a
// float dtype (F32; BF16, F16, F64 are converted) and its HF shape, no
// unexpected tensors. Failures raise runtime::Error naming the file, the key or
// tensor, both values, and the fix.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/adamw.h"
#include "runtime/model.h"

namespace halyard::runtime {

// The subdirectory name of a step: "step-00000042".
std::string checkpoint_step_name(int64_t step);

// Writes dir/step-<step>/ (creating dir if needed), then points dir/latest at it.
void save_checkpoint(const std::string& dir, const Model& model, const AdamW& opt, int64_t step);

// Restores the parameters (and, if opt is given and the checkpoint has it, the
// AdamW moments) and returns the step the checkpoint was saved at (0 for a
// plain HF folder).
int64_t load_checkpoint(const std::string& dir, Model& model, AdamW* opt);

}  // namespace halyard::runtime
