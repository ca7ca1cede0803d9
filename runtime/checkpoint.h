// Training checkpoints: written atomically, verified by checksum, loaded with
// strict validation, so that a resumed run continues exactly where the saved
// one stopped, and a bad disk or a diverged run never costs the last good step.
//
// Layout of a checkpoint directory `dir`:
//
//   dir/step-00000300/model.safetensors      every parameter under its HF name,
//                                            F32, HF shape (loads in transformers);
//                                            metadata "format": "pt", "step", "model"
//   dir/step-00000300/optimizer.safetensors  AdamW state "m/<name>", "v/<name>",
//                                            F32, HF shape; metadata "step", "model"
//   dir/step-00000300/config.json            the model spec's config_json
//   dir/step-00000300/checksums.json         {"algorithm": "xxh64", "files":
//                                            {name: {"bytes": N, "xxh64": "<16 hex>"}}}
//                                            for every other file of the step
//   dir/latest                               "step-00000300\n"
//
// Sharding, as Hugging Face publishes checkpoints: when a set's tensors
// exceed max_shard_bytes (tensor bytes, default 5 GB as in save_pretrained),
// model.safetensors is replaced by model-00001-of-0000N.safetensors ... and
// model.safetensors.index.json ({"metadata": {"total_size": <tensor bytes>},
// "weight_map": {tensor: file}}); shards are filled in parameter order, a new
// one started when the next tensor would overflow it (a tensor above the limit
// gets a shard of its own). The optimizer state is sharded the same way, with
// the same limit: optimizer-0000k-of-0000N.safetensors and
// optimizer.safetensors.index.json, m/<name> and v/<name> side by side.
//
// Saving: nothing is written when a parameter or moment is NaN or infinite
// (the error names the tensor and the element). The step is written whole into
// dir/step-00000300.partial (each file through a temporary, fsync'ed and
// renamed), then that directory is renamed to step-00000300, and only then is
// `latest` replaced (atomically) to name it. A crash or a failed write (disk
// full) at any point leaves `latest` naming the previous complete step; a
// failed write removes what it wrote and raises "checkpoint step N was not
// saved: <errno text> writing <file>; the previous checkpoint <dir/step-...>
// is intact". save_checkpoint keeps the new and the previous step directories
// and deletes older ones. Memory: tensors are streamed from the model and the
// optimizer; a save allocates no copy of them.
//
// Loading reads `dir/latest`, or `dir` itself when it holds model.safetensors
// or model.safetensors.index.json (a step directory, or a Hugging Face folder:
// config.json plus one file or shards and index, no optimizer state; its step
// is 0). model.safetensors wins over an index, as in transformers. Nothing is
// modified unless everything validates, in this order: the config (every key
// of the spec's config must match); checksums.json when present (each file
// read: size, then XXH64; a plain HF folder has none and loads without); the
// index (every file it names exists, every tensor is in the file it names,
// none in two files, none unlisted); every parameter present with a float
// dtype (F32; BF16, F16, F64 are converted) and its HF shape, no unexpected
// tensors; no NaN or infinity. Failures raise runtime::Error naming the file,
// the key or tensor, both values, and the fix (for a damaged step: the
// previous step directory to resume from). The index's total_size is written
// but not checked (published indexes disagree on what it counts). A step
// directory saved before checksums existed loads like a plain HF folder.
//
// Memory while loading: files are mapped (mmap), never read into a buffer, and
// each tensor is converted straight into its parameter or moment a few MiB at
// a time, the mapped pages handed back as it goes: the resident memory a load
// adds stays a few MiB, far below one shard. The data is read three times
// (checksum, finiteness, conversion), the last two from the page cache.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/adamw.h"
#include "runtime/model.h"

namespace halyard::runtime {

// Hugging Face's default max_shard_size of save_pretrained ("5GB": 5 * 10^9 bytes).
inline constexpr int64_t kDefaultMaxShardBytes = 5'000'000'000;

// The subdirectory name of a step: "step-00000042".
std::string checkpoint_step_name(int64_t step);

// Writes dir/step-<step>/ (creating dir if needed), then points dir/latest at
// it. A set of tensors above max_shard_bytes of data is split into shards.
void save_checkpoint(const std::string& dir, const Model& model, const AdamW& opt, int64_t step,
                     int64_t max_shard_bytes = kDefaultMaxShardBytes);

// Restores the parameters (and, if opt is given and the checkpoint has it, the
// AdamW moments) and returns the step the checkpoint was saved at (0 for a
// plain HF folder).
int64_t load_checkpoint(const std::string& dir, Model& model, AdamW* opt);

}  // namespace halyard::runtime
