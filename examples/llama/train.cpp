// Trains the tiny Llama with its AOT-generated library on the bundled corpus:
// the path a user takes (model in the DSL -> schedule -> Halide kernels built
// by halyard_add_model -> a plain C++ loop), on one rank or with sequence
// parallelism over MPI ranks:
//
//   mpirun -np 4 llama_train [--steps N] [--lr X] ...   (llama_train --help: every option)
//
// The binary links one library per sp degree (all built for the same config
// and global seq; halyard_add_llama_train in examples/llama/CMakeLists.txt
// lists them: llama_train has sp 1, 2 and 4) and runs the one built for the
// number of ranks it is launched on: each rank holds seq/sp tokens of every
// row, attention redistributes heads with Ulysses all-to-alls, the loss and
// gradients are summed over ranks inside the generated step. --sp N (default: all ranks)
// makes groups of N consecutive ranks split each sequence, and the groups
// data-parallel replicas on different rows (dp = ranks / N; gradients and the
// loss are summed over all of them). --config and --seq, when
// given, must match what the libraries were built for (they are checked, not
// applied: the sizes are compiled in). --zero 1 shards the AdamW state over
// the ranks (ZeRO-1: gradients reduce-scattered, parameters all-gathered).
// Rank 0 prints the progress line and writes metrics and checkpoints; a rank
// that dies or hangs makes the others fail within --comm-timeout seconds with
// an error naming it.
//
// Data (runtime/data.h): --data reads a text file one byte per token (the
// default is the bundled corpus); --tokens reads a headerless little-endian
// uint16 or uint32 token file (nanoGPT's train.bin is --token-width 16).
// --pack SEP_ID or --doc-starts FILE packs documents: position ids restart at
// each document and attention stays within it (runtime::Packing).
// --save writes a checkpoint (runtime/checkpoint.h) every --save-every steps
// and after the last step; --resume continues from a checkpoint's step + 1 up
// to --steps. The batch of a step is a pure function of (seed, step), so a
// resumed run with the same flags reproduces the uninterrupted run exactly.
//
// --step-check OUT.safetensors (needs --resume DIR: a checkpoint or an HF
// folder with model.safetensors + config.json) runs ONE train_step on the
// batch of step 1 and writes OUT with `loss` (F64 []), `input_ids`, `labels`,
// `position_ids` (I32 [batch, seq]) and `grad/<HF name>` of every parameter
// (F32, HF shape), then exits without updating the parameters: the numbers to
// compare against another framework's step on the same weights and batch.
//
// Predicted vs measured: when the library carries a plan (ModelSpec::plan_json,
// the generator's predictions per rank), rank 0 prints it before the first
// step ("plan: predicted peak ... MiB per rank (...), predicted step ... s")
// and a fresh run writes it first in --metrics, with the launch it ran under:
//   {"plan": {...}, "launch": {"ranks":4,"dp":1,"sp":4,"zero":0,"grad_reduce":"f32","threads_per_rank":1}}
// Every step line then carries what happened: "peak_rss_bytes" per rank
// (exact, runtime/measure.h) and "step_s" (rank 0's wall time of train_step
// plus the optimizer), next to "loss", "tokens_per_s" and the other keys.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <deque>
#include <numeric>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "dsl/error.h"
#include "examples/llama/linked_models.h"
#include "examples/llama/llama_config.h"
#include "runtime/adamw.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "runtime/data.h"
#include "runtime/error.h"
#include "runtime/lr_schedule.h"
#include "runtime/measure.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"
#include "runtime/zero.h"

using namespace halyard;

namespace {

const char* kUsage = R"(usage: llama_train [options]          (one rank)
       mpirun -np N llama_train [options] (N ranks: dp x sp mesh)

training
  --steps N            steps to train (30)
  --lr X               peak learning rate (3e-3); warmup, then cosine decay to 0.1 x peak
  --warmup N           warmup steps (5)
  --clip MAX_NORM      global gradient-norm clipping (1.0; 0 = off)
  --seed S             initial weights and the batches drawn (0)
  --threads T          threads per rank (0 = cores / ranks)
data
  --data TEXT          a text file, one byte per token (the bundled corpus)
  --tokens FILE --token-width 16|32
                       a headerless little-endian uint16/uint32 token file
  --pack SEP_ID        packed documents: each ends with token SEP_ID; positions
                       restart after it and attention stays within a document
  --doc-starts FILE    packed documents starting at the token offsets in FILE
                       (text, ascending)
  --val-every N        every N steps (and after the last), the loss on held-out
                       data; 0 = no validation split (0)
  --val-fraction F     the file's tail held out for validation (0.05), 0 < F < 1
  --val-batches K      batches averaged for each validation loss (2)
checkpoints and output
  --save DIR           write a checkpoint after the last step (DIR is checked to
                       be writable before step 1)
  --save-every N       ... and every N steps
  --save-shard-bytes B the largest file of a checkpoint (5e9, as Hugging Face's
                       max_shard_size): larger models are saved in shards with
                       model.safetensors.index.json
  --resume DIR         continue from a checkpoint (or load an HF folder)
  --step-check OUT     with --resume: one forward+backward, loss and gradients
                       written to OUT.safetensors under HF names; no update
  --metrics FILE       one JSON line per step (appended)
mesh and checks
  --sp N               ranks along the sequence (default: the library's plan)
  --zero 0|1           ZeRO-1 sharded optimizer state (default: the plan's)
  --grad-reduce f32|bf16
                       the gradients' sum over the ranks: from f32, or from
                       bf16 copies summed in f32, half the bytes (default: the
                       plan's grad_reduce_precision, else f32)
  --config FILE        checked against the config the library was built for
  --seq N              checked against the library's sequence length
  --comm-timeout S     a dead or stuck rank fails the others after S s (60)
  --help               this text
)";

// The bundled corpus: in the source tree this binary was built from, or, in an
// installed tree (cmake --install), at <prefix>/share/halyard/data next to
// <prefix>/bin, wherever the tree was moved.
std::string default_corpus() {
  const std::string in_source = HALYARD_SOURCE_DIR "/examples/llama/data/corpus.txt";
  std::error_code ec;
  if (std::filesystem::exists(in_source, ec)) return in_source;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return in_source;
  return (exe.parent_path().parent_path() / "share/halyard/data/corpus.txt").string();
}

struct Options {
  int steps = 30, warmup = 5, threads = 0, save_every = 0, token_width = 0, val_every = 0, val_batches = 2;
  int64_t pack = -1;  // the document separator id, or -1
  std::string doc_starts;
  double clip = 1.0, lr = 3e-3, comm_timeout = runtime::kDefaultCommTimeoutS, val_fraction = 0.05;
  unsigned seed = 0;
  bool zero = false, zero_given = false, data_given = false, help = false;
  int64_t seq = 0, save_shard_bytes = runtime::kDefaultMaxShardBytes;
  int sp = 0;  // 0: every rank along the sequence
  std::string save_dir, resume_dir, tokens, step_check, metrics_path, config;
  std::string data = default_corpus();
  std::string grad_reduce;  // "": the plan's
};

// Returns an error message, or "" when the options are usable. Numbers are
// strict (dsl/error.h): "--steps 1e9" and "--steps -1" are errors, not 1 and 0.
std::string parse(int argc, char** argv, Options& o) {
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      o.help = true;
      return "";
    }
    if (i + 1 >= argc) return "error: " + k + " needs a value.\n(llama_train --help lists the options)";
    std::string v = argv[++i];
    auto integer = [&](int64_t lo, int64_t hi) { return static_cast<int>(parse_integer(k, v, lo, hi)); };
    try {
      if (k == "--steps") o.steps = integer(1, kMaxInt);
      else if (k == "--lr") o.lr = parse_real(k, v, 0, true);
      else if (k == "--warmup") o.warmup = integer(0, kMaxInt);
      else if (k == "--seed") o.seed = static_cast<unsigned>(parse_integer(k, v, 0, std::numeric_limits<unsigned>::max()));
      else if (k == "--threads") o.threads = integer(0, 4096);
      else if (k == "--data") o.data = v, o.data_given = true;
      else if (k == "--save") o.save_dir = v;
      else if (k == "--save-every") o.save_every = integer(0, kMaxInt);
      else if (k == "--save-shard-bytes") o.save_shard_bytes = parse_count(k, v);
      else if (k == "--resume") o.resume_dir = v;
      else if (k == "--tokens") o.tokens = v;
      else if (k == "--pack") o.pack = parse_integer(k, v, 0, std::numeric_limits<int32_t>::max());
      else if (k == "--doc-starts") o.doc_starts = v;
      else if (k == "--token-width") o.token_width = integer(16, 32);
      else if (k == "--step-check") o.step_check = v;
      else if (k == "--clip") o.clip = parse_real(k, v, 0, true);
      else if (k == "--metrics") o.metrics_path = v;
      else if (k == "--config") o.config = v;
      else if (k == "--seq") o.seq = parse_count(k, v);
      else if (k == "--zero") o.zero = integer(0, 1) != 0, o.zero_given = true;
      else if (k == "--grad-reduce") {
        if (v != "f32" && v != "bf16")
          return "error: --grad-reduce \"" + v + "\".\nlegal: f32, or bf16 (gradients rounded to bf16 on the wire, "
                 "summed in f32).";
        o.grad_reduce = v;
      }
      else if (k == "--sp") o.sp = integer(1, 1 << 20);
      else if (k == "--comm-timeout") o.comm_timeout = parse_real(k, v, 0, false);
      else if (k == "--val-every") o.val_every = integer(0, kMaxInt);
      else if (k == "--val-fraction") o.val_fraction = parse_real(k, v, 0, false);
      else if (k == "--val-batches") o.val_batches = integer(1, 1 << 20);
      else
        return "error: unknown option \"" + k + "\".\nlegal: --steps --lr --warmup --seed --threads --data --tokens "
               "--token-width --pack --doc-starts --val-every --val-fraction --val-batches --save --save-every --save-shard-bytes --resume "
               "--step-check "
               "--clip --metrics --config --seq --sp --zero --grad-reduce --comm-timeout --help";
    } catch (const UserError& e) {
      return e.what();
    }
  }
  if (o.save_every > 0 && o.save_dir.empty())
    return "error: --save-every " + std::to_string(o.save_every) +
           " needs --save DIR (0 saves only at the end).";
  if (!o.tokens.empty() && o.data_given)
    return "error: --data \"" + o.data + "\" and --tokens \"" + o.tokens +
           "\" both name the training data.\nfix: pass --data for a text file or --tokens for a token file, not both.";
  if (o.tokens.empty() != (o.token_width == 0) || (o.token_width != 0 && o.token_width != 16 && o.token_width != 32))
    return "error: --tokens needs --token-width and --token-width needs --tokens (got --tokens \"" + o.tokens +
           "\", --token-width " + std::to_string(o.token_width) + ").\nlegal widths: 16 (uint16 ids), 32 (uint32 ids)";
  if (o.pack >= 0 && !o.doc_starts.empty())
    return "error: --pack " + std::to_string(o.pack) + " and --doc-starts \"" + o.doc_starts +
           "\" both say where documents begin.\nfix: pass one of them.";
  if (!(o.val_fraction < 1))
    return "error: --val-fraction " + std::to_string(o.val_fraction) +
           " leaves nothing to train on.\nlegal: a fraction between 0 and 1, e.g. 0.05.";
  if (!o.step_check.empty() && o.resume_dir.empty())
    return "error: --step-check \"" + o.step_check +
           "\" needs --resume DIR: the weights must be ones another framework can load.\n"
           "fix: pass a checkpoint directory or an HF folder (model.safetensors + config.json).";
  return "";
}

// The linked library built for this sp degree (linked_models.h).
const runtime::ModelSpec& model_for(int ranks) {
  const std::string exe = halyard_train_target;
  const runtime::ModelSpec* found = nullptr;
  std::vector<int> degrees;
  for (int i = 0; i < halyard_linked_model_count; ++i) {
    const runtime::ModelSpec* s = halyard_linked_models[i];
    if (s->sp == ranks && found)
      throw runtime::Error("error: " + exe + " links two libraries for sp = " + std::to_string(ranks) + " (\"" +
                           found->name + "\" and \"" + s->name + "\") and cannot tell which to run.\nfix: list one "
                           "library per sp degree in halyard_add_llama_train(NAME " + exe + " MODELS ...).");
    if (s->sp == ranks) found = s;
    degrees.push_back(s->sp);
  }
  if (found) return *found;
  std::sort(degrees.begin(), degrees.end());
  std::string list, choices;  // "1, 2, 4" and "1, 2 or 4"
  for (size_t i = 0; i < degrees.size(); ++i) {
    list += (i ? ", " : "") + std::to_string(degrees[i]);
    choices += (i == 0 ? "" : i + 1 == degrees.size() ? " or " : ", ") + std::to_string(degrees[i]);
  }
  throw runtime::Error("error: " + exe + " splits the sequence over sp = " + std::to_string(ranks) +
                       " ranks, but it links libraries for sp = " + list + " only.\nfix: pass --sp " + choices +
                       " (the ranks beyond it become data-parallel replicas), or add halyard_add_model(... SP " +
                       std::to_string(ranks) + ") to examples/llama/CMakeLists.txt and list it in "
                       "halyard_add_llama_train(NAME " + exe + " MODELS ...).");
}

// The library's plan (ModelSpec::plan_json), or null when it carries none.
nlohmann::ordered_json plan_of(const runtime::ModelSpec& spec) {
  if (!spec.plan_json || !*spec.plan_json) return nullptr;
  auto plan = nlohmann::ordered_json::parse(spec.plan_json, nullptr, false);
  if (!plan.is_object())
    throw runtime::Error(std::string("error: the model library \"") + spec.name +
                         "\" carries a plan_json that is not a JSON object: " +
                         std::string(spec.plan_json).substr(0, 200) +
                         "\nfix: rebuild the library with this tree's halyard_aot (the generator and runtime differ).");
  return plan;
}

// The mesh a library's plan was made for (AutoSP chooses it): {dp, sp, zero},
// or {0, 0, 0} when the library carries no plan.
std::array<int, 3> planned_mesh(const runtime::ModelSpec& spec) {
  const nlohmann::ordered_json plan = plan_of(spec);
  if (plan.is_null() || !plan.contains("mesh")) return {0, 0, 0};
  const auto& m = plan["mesh"];
  return {m.value("dp", 0), m.value("sp", 0), m.value("zero", 0)};
}

// Without --sp: the linked library whose plan is for exactly these ranks
// (dp x sp, as SCHEDULE autosp chose), else every rank along the sequence.
int default_sp(int ranks) {
  for (int i = 0; i < halyard_linked_model_count; ++i) {
    const auto [dp, sp, zero] = planned_mesh(*halyard_linked_models[i]);
    if (dp * sp == ranks && dp > 1) return sp;
  }
  return ranks;
}

// --config and --seq are compiled into the library: check, never apply.
void check_matches_library(const Options& o, const runtime::ModelSpec& spec) {
  if (o.seq != 0 && o.seq != spec.seq)
    throw runtime::Error("error: --seq " + std::to_string(o.seq) + " but the model library \"" + spec.name +
                         "\" was built for seq " + std::to_string(spec.seq) +
                         ".\nfix: pass --seq " + std::to_string(spec.seq) +
                         ", or rebuild with halyard_add_model(... SEQ " + std::to_string(o.seq) + ").");
  if (o.config.empty()) return;
  const auto built = nlohmann::json::parse(spec.config_json);
  // --config is read with Llama's config reader; another model's trainer
  // (examples/qwen2: qwen2_train) cannot check it, and refuses rather than guess.
  if (const std::string type = built.value("model_type", std::string("llama")); type != "llama")
    throw runtime::Error("error: --config \"" + o.config + "\" given to the model library \"" + spec.name +
                         "\", a \"" + type + "\" model: this trainer checks --config only against Llama "
                         "libraries.\nfix: omit --config; the library's config is compiled in "
                         "(halyard_add_model CONFIG ...).");
  const auto given = nlohmann::json::parse(llama::LlamaConfig::load(o.config).to_json());
  for (auto it = built.begin(); it != built.end(); ++it)
    if (!given.contains(it.key()) || given[it.key()] != *it)
      throw runtime::Error("error: --config \"" + o.config + "\" does not match the model library \"" + spec.name +
                           "\": " + it.key() + " is " + (given.contains(it.key()) ? given[it.key()].dump() : "absent") +
                           " there but " + it->dump() + " in the library.\nfix: pass the config the library was "
                           "built from (examples/llama/configs/tiny.json), or rebuild the library from this one.");
}

// Every rank's peak RSS in bytes (collective when there are ranks): each rank
// fills its slot and a sum gives all of them, exactly (bytes < 2^53).
std::vector<int64_t> peaks(runtime::Communicator* comm) {
  std::vector<double> all(comm ? static_cast<size_t>(comm->size()) : 1, 0.0);
  all[comm ? static_cast<size_t>(comm->rank()) : 0] = static_cast<double>(runtime::peak_rss_bytes());
  if (comm) comm->all_reduce_sum(all.data(), static_cast<int64_t>(all.size()));
  return std::vector<int64_t>(all.begin(), all.end());
}

std::vector<int64_t> in_mib(const std::vector<int64_t>& bytes) {
  std::vector<int64_t> out;
  for (int64_t b : bytes) out.push_back(std::llround(static_cast<double>(b) / (1 << 20)));
  return out;
}

// "41/43/41/42" (sep "/") or "41,43,41,42" (sep ",").
std::string joined(const std::vector<int64_t>& v, const char* sep) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : sep) + std::to_string(x);
  return s;
}

// Stops every rank together when any of them failed a check (`error` is this
// rank's failure, "" when it passed): one small all-reduce on the world
// communicator, so a check that fails on rank 0 alone (an unwritable --save
// directory, say) does not leave the other ranks waiting in the next
// collective until --comm-timeout.
void agree(runtime::Communicator* comm, const std::string& error) {
  if (!comm) {
    if (!error.empty()) throw runtime::Error(error);
    return;
  }
  std::vector<double> failed(static_cast<size_t>(comm->size()), 0.0);
  failed[static_cast<size_t>(comm->rank())] = error.empty() ? 0.0 : 1.0;
  comm->all_reduce_sum(failed.data(), static_cast<int64_t>(failed.size()));
  if (!error.empty()) throw runtime::Error(error);
  for (size_t r = 0; r < failed.size(); ++r)
    if (failed[r] > 0)
      throw runtime::Error("error: stopped: rank " + std::to_string(r) + " failed a check (its message says which).");
}

// "" when `dir` exists or can be created and a file can be written in it;
// otherwise the error, found before step 1 rather than after the last.
std::string save_dir_error(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string probe = dir + "/.halyard-write-check";
  if (!ec) {
    std::ofstream f(probe, std::ios::binary | std::ios::trunc);
    f << "ok";
    f.close();
    if (!f) ec = std::make_error_code(std::errc::io_error);
    if (f && std::filesystem::exists(probe)) std::filesystem::remove(probe, ec);
    else if (!ec) ec = std::make_error_code(std::errc::permission_denied);
  }
  if (!ec) return "";
  return "error: --save \"" + dir + "\" cannot be written: " + ec.message() +
         ".\nIt was checked before step 1, so no training is lost.\nfix: pass a directory this user can create and "
         "write (a checkpoint there holds the parameters, AdamW state and config).";
}

std::string number_text(double x) { return std::isnan(x) ? "NaN" : std::isinf(x) ? (x > 0 ? "+inf" : "-inf") : std::to_string(x); }

// The first non-finite value of the gradients (or, with `params`, of the
// parameters) on this rank, as "grad/model.layers.0.mlp.up_proj.weight[1234]
// = NaN" or "model.norm.weight[3] = +inf"; "" when all are finite.
std::string first_non_finite(runtime::Model& m, bool params) {
  for (int i = 0; i < m.num_params(); ++i) {
    const float* x = params ? m.param(i) : m.grad(i);
    const int64_t n = m.param_spec(i).numel;
    for (int64_t j = 0; j < n; ++j)
      if (!std::isfinite(x[j]))
        return std::string(params ? "" : "grad/") + m.param_spec(i).name + "[" + std::to_string(j) +
               "] = " + number_text(x[j]);
  }
  return "";
}

// A non-finite loss or gradient stops the run before the optimizer applies it,
// so the parameters and every checkpoint stay finite. Every rank checks (the
// loss is global; ZeRO's gradients are each rank's own) and they stop together.
// Gradients on a device (the update runs there) are not read unless one is
// bad: a pass over them would bring them all home every step. Their norm
// tells instead, which Model::adamw_step computes first and applies nothing
// when it is not finite.
void check_finite(runtime::Communicator* comm, int rank, int step, double loss, runtime::Model& m, double lr,
                  const double* grad_norm = nullptr) {
  std::string bad = std::isfinite(loss) ? "" : "the loss is " + number_text(loss);
  const bool grads_finite = grad_norm ? std::isfinite(*grad_norm) : first_non_finite(m, false).empty();
  if (bad.empty() && grads_finite) return agree(comm, "");
  std::string where = first_non_finite(m, false);
  // Something is off: a non-finite parameter, when there is one, is the cause.
  if (std::string param = first_non_finite(m, true); !param.empty()) where = param;
  if (bad.empty()) bad = "a gradient is not finite";
  char lr_text[32];
  std::snprintf(lr_text, sizeof lr_text, "%g", lr);
  agree(comm, "error: step " + std::to_string(step) + ", rank " + std::to_string(rank) + ": " + bad +
                  (where.empty() ? "" : "; the first non-finite tensor is " + where) +
                  ".\nThis step was not applied and no checkpoint holding non-finite values is written.\n"
                  "fix: lower --lr (" + lr_text + " now), keep --clip on, or --resume from the last checkpoint.");
}

int train(const Options& o) {
  // mpirun sets OMPI_COMM_WORLD_SIZE; a plain launch is one rank without MPI.
  // Ranks form a dp x sp mesh: groups of sp consecutive ranks split each
  // sequence; the dp groups train on different rows.
  std::unique_ptr<runtime::Communicator> comm, group;
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) comm = runtime::make_mpi_communicator(o.comm_timeout);
  const int rank = comm ? comm->rank() : 0, ranks = comm ? comm->size() : 1;
  const int sp = o.sp > 0 ? o.sp : default_sp(ranks);
  const bool lead = rank == 0;
  try {
    if (ranks % sp != 0)
      throw runtime::Error("error: --sp " + std::to_string(sp) + " does not divide the " + std::to_string(ranks) +
                           " ranks (the mesh is dp x sp).\nfix: pass an --sp that divides the rank count, or launch "
                           "a multiple of it.");
    const int dp = ranks / sp;
    if (comm && sp > 1) group = sp == ranks ? nullptr : runtime::make_mpi_communicator(o.comm_timeout, rank / sp);
    runtime::Communicator* sp_comm = sp == 1 ? nullptr : group ? group.get() : comm.get();
    const int threads = o.threads > 0 ? o.threads : runtime::default_threads_per_rank();
    runtime::Model::set_num_threads(threads);
    // Rank 0 writes checkpoints: it checks the directory before any work.
    agree(comm.get(), lead && !o.save_dir.empty() ? save_dir_error(o.save_dir) : "");
    const runtime::ModelSpec& spec = model_for(sp);
    check_matches_library(o, spec);
    // The optimizer state as the plan has it, unless --zero says otherwise.
    Options run = o;
    if (!o.zero_given && planned_mesh(spec)[2] == 1 && ranks > 1) run.zero = true;
    // On every rank, before any collective: a broken plan fails them all alike.
    const nlohmann::ordered_json plan = plan_of(spec);
    // The gradients' sum as the plan's schedule has it, unless --grad-reduce says otherwise.
    if (run.grad_reduce.empty())
      run.grad_reduce = plan.is_object() && plan.contains("schedule_spec")
                            ? plan["schedule_spec"].value("grad_reduce_precision", "f32")
                            : "f32";
    const bool reduce_bf16 = run.grad_reduce == "bf16" && ranks > 1;
    const std::string plan_line = plan.is_null() ? "" : runtime::describe_plan(plan);
    // A CUDA library's step over NCCL, where this trainer links it
    // (halyard_add_llama_train(... NCCL)): its collectives and gradient sums
    // stay on the device. MPI carries the rest: the checks, the metrics,
    // ZeRO-1's state on the host, checkpoints.
    std::unique_ptr<runtime::Communicator> step_mesh, step_group;
    runtime::Communicator *step_sp = sp_comm, *step_all = comm.get();
#ifdef HALYARD_TRAIN_NCCL
    if (comm && std::string_view(spec.target).find("cuda") != std::string_view::npos) {
      step_mesh = runtime::make_nccl_communicator(o.comm_timeout);
      if (sp > 1 && sp != ranks) step_group = step_mesh->split(rank / sp, rank);
      step_sp = sp == 1 ? nullptr : step_group ? step_group.get() : step_mesh.get();
      step_all = step_mesh.get();
    }
#endif
    runtime::Model m(spec, step_sp, step_all);
    m.init_params(o.seed);
    const int64_t seq = spec.seq, batch = spec.batch;
    const runtime::TokenFile file =
        o.tokens.empty() ? runtime::TokenFile::from_text(o.data)
                         : runtime::TokenFile::open(o.tokens, o.token_width == 16 ? runtime::TokenWidth::U16
                                                                                  : runtime::TokenWidth::U32);
    // With --val-every, the file's tail is held out: training never reads it.
    const int64_t held_out = o.val_every > 0 ? std::llround(static_cast<double>(file.size()) * o.val_fraction) : 0;
    if (o.val_every > 0 && (held_out < seq + 1 || file.size() - held_out < seq + 1))
      throw runtime::Error("error: --val-fraction " + std::to_string(o.val_fraction) + " of \"" + file.path() + "\" (" +
                           std::to_string(file.size()) + " tokens) holds out " + std::to_string(held_out) +
                           " tokens and leaves " + std::to_string(file.size() - held_out) +
                           " to train on; each split needs at least seq + 1 = " + std::to_string(seq + 1) +
                           ".\nfix: use a larger file, or a fraction that leaves both splits a row.");
    const runtime::TokenFile train_file = held_out > 0 ? file.slice(0, file.size() - held_out) : file;
    // The batch of a step depends on (seed, step) alone, so resuming sees the
    // same data; each rank reads only its slice of every row.
    const runtime::Shard shard{rank % sp, sp, rank / sp, dp, runtime::zigzag_layout(spec)};
    runtime::Packing packing;
    packing.separator = o.pack;
    if (!o.doc_starts.empty()) packing.doc_starts = runtime::read_doc_starts(o.doc_starts, file.size());
    const runtime::Batcher batcher(train_file, batch, seq, spec.vocab, o.seed, shard, packing);
    // Validation: the same --val-batches windows of the held-out tail every
    // time, so the curve moves only with the model.
    std::unique_ptr<runtime::Batcher> val_batcher;
    if (held_out > 0)
      val_batcher = std::make_unique<runtime::Batcher>(file.slice(file.size() - held_out, file.size()), batch, seq,
                                                       spec.vocab, o.seed + 7919u, shard, packing);
    const int64_t n = batcher.local_tokens();
    std::vector<int32_t> ids(static_cast<size_t>(n)), labels(ids.size()), pos(ids.size());

    if (!o.step_check.empty()) {
      const int64_t loaded = runtime::load_checkpoint(o.resume_dir, m, nullptr);
      batcher.fill(1, ids.data(), labels.data(), pos.data());
      const double loss = m.train_step(ids.data(), labels.data(), pos.data());
      if (lead) {
        // The whole batch, as one rank would see it: every replica's rows, in replica order.
        const int64_t rows = batch * dp;
        const auto whole = runtime::Batcher(file, rows, seq, spec.vocab, o.seed, {}, packing).get(1);
        runtime::Safetensors out;
        out.put_f64("loss", {}, {loss});
        out.put_i32("input_ids", {rows, seq}, whole.input_ids);
        out.put_i32("labels", {rows, seq}, whole.labels);
        out.put_i32("position_ids", {rows, seq}, whole.position_ids);
        for (int i = 0; i < m.num_params(); ++i) {
          const runtime::ParamSpec& p = m.param_spec(i);
          out.put_f32(std::string("grad/") + p.name, {p.hf_shape, p.hf_shape + p.hf_rank},
                      std::vector<float>(m.grad(i), m.grad(i) + p.numel));
        }
        out.metadata["weights"] = o.resume_dir;
        out.metadata["weights_step"] = std::to_string(loaded);
        out.metadata["data"] = file.path();
        out.metadata["seed"] = std::to_string(o.seed);
        out.metadata["step"] = "1";
        out.metadata["sp"] = std::to_string(sp);
        out.metadata["dp"] = std::to_string(dp);
        out.write(o.step_check);
        std::printf("step-check: weights \"%s\" (step %lld), batch of step 1 (seed %u, %lld x %lld tokens of \"%s\"), "
                    "%d rank(s)\n",
                    o.resume_dir.c_str(), static_cast<long long>(loaded), o.seed, static_cast<long long>(rows),
                    static_cast<long long>(seq), file.path().c_str(), ranks);
        std::printf("step-check: loss %.9g; wrote %zu tensors to \"%s\"; parameters not updated\n", loss, out.size(),
                    o.step_check.c_str());
      }
      return 0;
    }

    std::vector<int64_t> sizes, offsets;
    const std::vector<bool> decay = m.decay_flags();
    for (int i = 0; i < m.num_params(); ++i) {
      sizes.push_back(m.param_spec(i).numel);
      offsets.push_back(m.flat_offset(i));
    }
    // Plain AdamW keeps the whole state on every rank (the summed gradients
    // are the same everywhere, so every rank takes the same step): the
    // model's own update, which for a GPU library runs on the device and keeps
    // parameters, gradients and moments there. ZeRO-1 keeps 1/ranks of the
    // state, on the host (runtime::ZeroAdamW); with the steps over NCCL, on
    // the device (Model::use_zero_adamw).
    std::unique_ptr<runtime::ZeroAdamW> zero;
    if (run.zero) {
      if (!comm) throw runtime::Error("error: --zero 1 shards the optimizer state over ranks, but this is one rank.\n"
                                      "fix: launch with mpirun -np 2 or 4, or pass --zero 0.");
      if (step_mesh && m.adamw_on_device()) {
        m.use_zero_adamw(decay);
        m.set_reduce_grads_bf16(reduce_bf16);
      } else {
        zero = std::make_unique<runtime::ZeroAdamW>(*comm, m.flat_size(), offsets, sizes, decay);
        zero->set_reduce_bf16(reduce_bf16);
        m.set_reduce_grads(false);  // ZeRO reduce-scatters them itself
      }
    } else {
      m.use_adamw(decay);
      m.set_reduce_grads_bf16(reduce_bf16);
    }
    const bool device_update = !zero && m.adamw_on_device();
    // Checkpoints hold the whole optimizer state: ZeRO gathers it for them
    // (a collective), a device update brings its moments home; the host's
    // update state is written and read in place (m.host_adamw()).
    auto full_state = [&]() {
      runtime::AdamW full(sizes, decay);
      for (size_t i = 0; i < sizes.size(); ++i) {
        if (zero) zero->gather_moments(i, full.m(i), full.v(i));
        else m.adamw_moments(static_cast<int>(i), full.m(i), full.v(i));
      }
      return full;
    };
    if (lead)
      std::printf("%s: %s, %s; %d rank(s) (dp=%d x sp=%d%s), batch %lld x seq %lld (%lld per rank) per replica, "
                  "%d kernels, activation arena %.1f MiB per rank%s%s%s\n",
                  spec.name, spec.target, plan.is_null() ? spec.schedule : plan.value("schedule", "").c_str(), ranks, dp, spec.sp,
                  comm ? (std::string(", ") + comm->backend() + (step_mesh ? ", steps over NCCL" : "")).c_str() : "",
                  static_cast<long long>(batch), static_cast<long long>(seq), static_cast<long long>(spec.local_seq),
                  spec.num_kernels, static_cast<double>(m.arena_bytes()) / (1 << 20),
                  run.zero ? ", ZeRO-1 optimizer state" : "",
                  reduce_bf16 ? ", gradients summed from bf16" : "",
                  device_update ? ", AdamW on the device" : "");
    int first = 1;
    if (!o.resume_dir.empty()) {
      int64_t loaded;
      if (runtime::AdamW* host = m.host_adamw()) {
        loaded = runtime::load_checkpoint(o.resume_dir, m, host);
      } else {
        runtime::AdamW full(sizes, decay);
        loaded = runtime::load_checkpoint(o.resume_dir, m, &full);
        for (size_t i = 0; i < sizes.size(); ++i) {
          if (zero) zero->set_moments(i, full.m(i), full.v(i));
          else m.set_adamw_moments(static_cast<int>(i), full.m(i), full.v(i));
        }
      }
      first = static_cast<int>(loaded) + 1;
      if (lead)
        std::printf("resumed from \"%s\" at step %lld; continuing with step %d of %d\n", o.resume_dir.c_str(),
                    static_cast<long long>(loaded), first, o.steps);
    }
    std::ofstream metrics;
    if (lead && !o.metrics_path.empty()) metrics.open(o.metrics_path, std::ios::app);
    agree(comm.get(), lead && !o.metrics_path.empty() && !metrics
                          ? "error: cannot open metrics file \"" + o.metrics_path + "\" for appending.\nfix: pass a "
                            "path in a directory this user can write."
                          : "");
    if (lead && !plan.is_null()) std::printf("%s", runtime::describe_schedule(plan).c_str());
    if (lead && !plan_line.empty()) std::printf("%s\n", plan_line.c_str());
    if (lead && held_out > 0)
      std::printf("validation: the last %lld tokens of \"%s\" (%.0f%%) held out; loss over %d batch(es) every %d "
                  "steps\n",
                  static_cast<long long>(held_out), file.path().c_str(), 100 * o.val_fraction, o.val_batches,
                  o.val_every);
    // The mean loss of the held-out batches (a collective: every rank runs it).
    auto validation_loss = [&]() {
      double sum = 0;
      for (int k = 1; k <= o.val_batches; ++k) {
        val_batcher->fill(k, ids.data(), labels.data(), pos.data());
        sum += m.train_step(ids.data(), labels.data(), pos.data());  // its gradients are discarded
      }
      return sum / o.val_batches;
    };
    std::vector<int64_t> last_peak_bytes;
    double train_s = 0;  // the steps' own time, without validation
    if (!plan.is_null()) {
      // A resumed run appends to its run's metrics, which hold the plan already.
      if (metrics.is_open() && o.resume_dir.empty()) {
        nlohmann::ordered_json head;
        head["plan"] = plan;
        head["launch"] = {{"ranks", ranks}, {"dp", dp}, {"sp", sp}, {"zero", run.zero ? 1 : 0},
                          {"grad_reduce", reduce_bf16 ? "bf16" : "f32"}, {"threads_per_rank", threads}};
        metrics << head.dump() << "\n" << std::flush;
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::deque<double> recent;  // the loss of one step is noisy (random windows); its mean over 10 is the trend
    for (int step = first; step <= o.steps; ++step) {
      batcher.fill(step, ids.data(), labels.data(), pos.data());
      const auto step_t0 = std::chrono::steady_clock::now();
      const double loss = m.train_step(ids.data(), labels.data(), pos.data());
      if (lead && std::getenv("HALYARD_PROFILE"))  // every call's time and scratch memory (runtime/model.h)
        std::fprintf(stderr, "profile of step %d:\n%s", step, m.profile().c_str());
      const double frac = runtime::warmup_cosine_lr(step, o.steps, o.warmup, 1.0);  // times --lr
      double norm;
      if (device_update) {
        // The loss is the same on every rank, so all skip the update alike.
        norm = std::isfinite(loss) ? m.adamw_step(step, o.lr * frac, o.clip) : std::numeric_limits<double>::quiet_NaN();
        check_finite(comm.get(), rank, step, loss, m, o.lr * frac, &norm);
      } else {
        check_finite(comm.get(), rank, step, loss, m, o.lr * frac);
        norm = zero ? zero->step(step, o.lr * frac, m.params_flat(), m.grads_flat(), o.clip)
                    : m.adamw_step(step, o.lr * frac, o.clip);
      }
      const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_t0).count();
      const int done = step - first + 1;
      train_s += step_s;
      const double tps = static_cast<double>(done * batch * seq * dp) / train_s;  // validation not counted
      const bool validate = val_batcher && (step % o.val_every == 0 || step == o.steps);
      const double val_loss = validate ? validation_loss() : 0.0;
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const std::vector<int64_t> peak_bytes = peaks(comm.get()), peak = in_mib(peak_bytes);
      last_peak_bytes = peak_bytes;
      recent.push_back(loss);
      if (recent.size() > 10) recent.pop_front();
      const double mean = std::accumulate(recent.begin(), recent.end(), 0.0) / static_cast<double>(recent.size());
      if (lead) {
        std::printf("step %4d/%d  loss %.4f (mean of %zu: %.4f)  |g| %.3f  lr %.2e  %7.0f tokens/s  peak %s MiB  "
                    "ETA %.0fs\n",
                    step, o.steps, loss, recent.size(), mean, norm, o.lr * frac, tps, joined(peak, "/").c_str(),
                    secs / done * (o.steps - step));
        if (validate) std::printf("step %4d/%d  validation loss %.4f (held-out text)\n", step, o.steps, val_loss);
        if (metrics.is_open())
          metrics << "{\"step\":" << step << ",\"loss\":" << loss << ",\"grad_norm\":" << norm << ",\"lr\":" << o.lr * frac
                  << ",\"tokens_per_s\":" << tps << ",\"dp\":" << dp << ",\"sp\":" << sp << ",\"peak_rss_mib\":["
                  << joined(peak, ",") << "],\"peak_rss_bytes\":[" << joined(peak_bytes, ",")
                  << "],\"step_s\":" << step_s
                  << (validate ? ",\"val_loss\":" + std::to_string(val_loss) : std::string()) << "}\n"
                  << std::flush;
      }
      if (!o.save_dir.empty() && ((o.save_every > 0 && step % o.save_every == 0) || step == o.steps)) {
        // Rank 0 writes; a failure there (a full disk) stops every rank at
        // once, and the previous checkpoint stays the one `latest` names.
        std::string save_error;
        try {
          if (const runtime::AdamW* host = m.host_adamw()) {
            if (lead) runtime::save_checkpoint(o.save_dir, m, *host, step, o.save_shard_bytes);
          } else if (zero || lead) {  // ZeRO's gathering is a collective
            const runtime::AdamW full = full_state();
            if (lead) runtime::save_checkpoint(o.save_dir, m, full, step, o.save_shard_bytes);
          }
        } catch (const runtime::Error& e) {
          save_error = e.what();
        }
        agree(comm.get(), save_error);  // also the barrier: nobody resumes from a checkpoint still being written
        if (lead)
          std::printf("saved step %d to \"%s/%s\"\n", step, o.save_dir.c_str(),
                      runtime::checkpoint_step_name(step).c_str());
      }
      std::fflush(stdout);
    }
    if (lead && !last_peak_bytes.empty()) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // A GPU library's host peak holds its GPU runtime's own memory (the
      // CUDA driver's took about 370 MiB on an H200), which no plan counts:
      // it is said, not compared.
      const bool gpu = m.device_bytes() > 0;
      std::string line = "done: " + std::to_string(o.steps - first + 1) + " steps in " +
                         std::to_string(static_cast<long long>(std::llround(secs))) + " s; measured peak per rank " +
                         joined(in_mib(last_peak_bytes), "/") +
                         (gpu ? " MiB of host memory (the GPU runtime's own included)" : " MiB");
      if (!gpu && !plan.is_null() && plan.contains("predicted_peak_bytes_per_rank") &&
          plan["predicted_peak_bytes_per_rank"].is_number()) {
        const double predicted = plan["predicted_peak_bytes_per_rank"].get<double>();
        const double most = static_cast<double>(*std::max_element(last_peak_bytes.begin(), last_peak_bytes.end()));
        char tail[128];
        std::snprintf(tail, sizeof tail, ", predicted %.1f MiB (highest rank at %.0f%% of the prediction)",
                      predicted / (1 << 20), 100 * most / predicted);
        line += tail;
      }
      if (m.device_bytes() > 0) {  // a GPU library's: what rank 0's blocks on the device hold
        char tail[64];
        std::snprintf(tail, sizeof tail, "; device memory %.1f MiB on rank 0",
                      static_cast<double>(m.device_bytes()) / (1 << 20));
        line += tail;
      }
      std::printf("%s\n", line.c_str());
    }
  } catch (const std::exception& e) {
    // One write per rank, so that ranks' messages do not interleave.
    std::string msg = e.what();
    if (msg.find("timed out after") != std::string::npos) msg += "\n(llama_train: --comm-timeout SECONDS)";
    std::cerr << (ranks > 1 ? "rank " + std::to_string(rank) + ": " : std::string()) + msg + "\n" << std::flush;
    return 2;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (std::string err = parse(argc, argv, o); !err.empty()) {
    std::cerr << err << "\n";
    return 2;
  }
  if (o.help) {
    std::printf("%s", kUsage);
    return 0;
  }
  try {
    return train(o);
  } catch (const std::exception& e) {  // no communicator (MPI failed to start)
    std::cerr << e.what() << "\n";
    return 2;
  }
}
