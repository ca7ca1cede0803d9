// A generated model, ready to train: parameters, gradients, the activation
// arena, and the executor of its step programs.
//
//   halyard::runtime::Model m(halyard_models::tiny_llama());
//   m.init_params(0);
//   double loss = m.train_step(ids, labels, positions);  // fills m.grad(i)
//
// Tokens are [batch, local_seq] int32 arrays of the sizes the library was
// built for: the whole sequence on one rank, or this rank's slice of it when
// the library splits the sequence over sp ranks (then pass the communicator
// of those ranks; the step performs the collectives between its kernels,
// returns the global loss, and leaves every rank the summed gradients).
// Position ids either increase along each row (one document: causal
// attention) or restart at 0 where each document of a packed row begins
// (attention within each document, Hugging Face's packed position_ids).
// Bad input (an id outside the vocabulary, a label that is neither a token
// nor the ignore index, a negative position, positions that are neither)
// throws runtime::Error naming the position; a failing kernel throws naming
// the kernel and node.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/adamw.h"
#include "runtime/collectives.h"
#include "runtime/comm.h"
#include "runtime/step_program.h"

struct halide_buffer_t;

namespace halyard::runtime {

class CudaCopyStream;
class DeviceBlock;
class PinnedHost;

// Tunes glibc so that memory freed by kernels stays in the heap (see model.cpp).
// Model does this itself; programs that call kernels directly (benchmarks) call it.
void keep_freed_memory();

class Model {
 public:
  // `sp` (not owned) must outlive the model: the ranks of one sequence, used
  // for the all-to-alls; required, with exactly spec.sp ranks, when the
  // library splits the sequence (spec.sp > 1). `mesh` is every rank of a
  // dp x sp mesh (data-parallel replicas of that sequence group, each with
  // its own rows): the loss and gradients are summed over it. It defaults to
  // `sp` (dp = 1); its size must be a multiple of spec.sp.
  explicit Model(const ModelSpec& spec, Communicator* sp = nullptr, Communicator* mesh = nullptr);
  ~Model();  // frees a GPU library's device buffers
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelSpec& spec() const { return spec_; }
  int num_params() const { return spec_.num_params; }
  const ParamSpec& param_spec(int i) const { return spec_.params[i]; }
  int param_index(const std::string& name) const;  // throws listing names
  // The host's copies. Until use_adamw puts a GPU library's update on the
  // device, the host holds the truth: each step uploads the parameters and
  // brings the gradients home, so pointers may be kept from step to step.
  // After it, parameters and gradients stay on the device: these fetch the
  // device's newer values when called, and what the host writes through a
  // non-const one goes up before the next kernel reads it (call them again
  // after each step and update: a pointer kept from before reads stale
  // values, and writes through it are lost).
  float* param(int i) { return reinterpret_cast<float*>(params_on_host(true) + offsets_[static_cast<size_t>(i)]); }
  const float* param(int i) const {
    return reinterpret_cast<const float*>(params_on_host(false) + offsets_[static_cast<size_t>(i)]);
  }
  const float* grad(int i) const {
    return reinterpret_cast<const float*>(grads_on_host(false) + offsets_[static_cast<size_t>(i)]);
  }

  // Hugging Face's init: N(0, 0.02) for matrices and embeddings, 1 for norms.
  void init_params(uint64_t seed);
  // Which parameters AdamW's weight decay applies to, as Halyard's training
  // programs choose: matrices and embeddings, not norm weights.
  std::vector<bool> decay_flags() const {
    std::vector<bool> decay;
    for (int i = 0; i < spec_.num_params; ++i) decay.push_back(spec_.params[i].rank > 1);
    return decay;
  }

  // Forward + backward: returns the loss and fills every gradient.
  double train_step(const int32_t* input_ids, const int32_t* labels, const int32_t* position_ids);
  // Forward only (a smaller arena): returns the loss.
  double forward_loss(const int32_t* input_ids, const int32_t* labels, const int32_t* position_ids);

  // Tokens of one step's arrays on this rank: batch * local_seq.
  int64_t tokens() const { return spec_.batch * spec_.local_seq; }
  int sp() const { return spec_.sp; }
  Communicator* comm() const { return comm_; }
  Communicator* mesh() const { return mesh_; }
  int dp() const { return mesh_ ? mesh_->size() / spec_.sp : 1; }

  // Whether a train step ends by summing gradients over the mesh (the
  // default). ZeRO-1 turns it off and reduce-scatters them itself.
  void set_reduce_grads(bool on) { reduce_grads_ = on; }
  // Whether that sum moves the gradients in bf16, summed in f32
  // (Communicator::all_reduce_sum_bf16; the schedule's grad_reduce_precision;
  // over NCCL on the device: all_reduce_sum_bf16_on_device, the same bits;
  // under use_zero_adamw the update's reduce-scatter, likewise).
  void set_reduce_grads_bf16(bool on) { reduce_grads_bf16_ = on; }
  // All parameters (and gradients) as one flat array of flat_size() floats:
  // parameter i starts at flat_offset(i); the gaps between them are zeros.
  float* params_flat() { return reinterpret_cast<float*>(params_on_host(true)); }
  float* grads_flat() { return reinterpret_cast<float*>(grads_on_host(true)); }
  int64_t flat_size() const { return flat_size_; }
  int64_t flat_offset(int i) const { return offsets_[static_cast<size_t>(i)] / static_cast<int64_t>(sizeof(float)); }
  int64_t arena_bytes() const { return arena_bytes_; }
  // A GPU library's device memory the executor holds, from its first step:
  // one allocation each for the arena, the parameters, the gradients and
  // the token slots, which every buffer of a step aliases at its host
  // offset (runtime/device_memory.h); so the plan's arena holds on the
  // device too. 0 on CPU, and on GPU APIs other than CUDA and OpenCL (there
  // Halide allocates each buffer itself).
  int64_t device_bytes() const;
  // Of a CUDA library's host blocks (the parameters, the gradients, the
  // tokens, the arena's host side and the offloaded values' host copies),
  // the bytes page-locked at its first step (runtime/cuda_context.h:
  // PinnedHost), so that copies between them and the device run at the
  // link's rate. 0 elsewhere, where the driver refused (the step then
  // copies from pageable memory and says so once on stderr), and with
  // HALYARD_PIN_HOST=0 in the environment (to tell a fault of pinning apart).
  int64_t pinned_host_bytes() const;
  // AdamW on this model's own parameters, with the gradients of its last
  // train step (summed over the mesh, as set_reduce_grads(true) leaves them):
  //   m.use_adamw(decay);                            // a flag per parameter
  //   m.train_step(...); double norm = m.adamw_step(t, lr, max_norm);  // t = 1, 2, ...
  // A GPU library's update runs on the device (its optimizer kernels,
  // ModelSpec::adamw), the moments live there, and the parameters and
  // gradients stay there from step to step: a step uploads only the tokens,
  // and brings home only the loss; the update only the gradient norm's
  // partial sums. A CPU library's update is runtime::AdamW on the host, the
  // same bits as calling it directly. Every rank of a mesh applies the whole
  // update (ZeRO-1, the moments sharded, is runtime::ZeroAdamW). Returns the
  // gradients' global L2 norm before clipping by clip_scale(norm, max_norm).
  // A non-finite norm (a NaN or inf gradient) applies nothing: the parameters
  // and moments stay as they were, and the caller, seeing it, decides.
  void use_adamw(std::vector<bool> decay, AdamWConfig cfg = {});
  // ZeRO-1 on the device, for a CUDA library over NCCL on several ranks:
  // as use_adamw, but each rank keeps the moments of its slice of the flat
  // parameters only (runtime/zero.h: zero_slice, ZeroAdamW's slices), and
  // adamw_step reduce-scatters the step's partial gradients, updates the
  // slice and all-gathers the parameters, all on the device (the step then
  // leaves its gradients unsummed: set_reduce_grads(false)). adamw_moments
  // is then a collective (every rank asks for the same parameter);
  // set_adamw_moments keeps this rank's runs.
  void use_zero_adamw(std::vector<bool> decay, AdamWConfig cfg = {});
  double adamw_step(int64_t step, double lr, double max_norm);
  bool adamw_on_device() const;
  // The moments of parameter i (numel floats each), for checkpoints.
  void adamw_moments(int i, std::vector<float>& m, std::vector<float>& v) const;
  void set_adamw_moments(int i, const std::vector<float>& m, const std::vector<float>& v);
  // A CPU library's update state itself, for checkpoints without a copy of
  // the moments; nullptr before use_adamw and when the update is on a device.
  AdamW* host_adamw() { return host_adamw_.get(); }
  // The last adamw_step's device traffic: copies home (the norm's partial
  // sums), and uploads (parameters or gradients the host wrote since).
  struct UpdateTimes {
    double total_s = 0;
    int64_t device_to_host_copies = 0, host_to_device_copies = 0;
  };
  const UpdateTimes& last_update_times() const { return update_times_; }

  // Per-kernel wall time of the last step, when HALYARD_PROFILE is set.
  std::string profile() const { return profile_; }
  // Where the last step's time went on this rank: attention kernels, other
  // kernels, and communication by kind: ring attention's block passes,
  // Ulysses' all-to-alls, the gradient sums, and the rest (positions, the
  // loss). For each kind, `waited_s` is the time the step stood still for
  // it (what the kernels did not hide) and `busy_s` the time it took on the
  // communication thread (with overlap off, or without the thread, the two
  // are the same: every collective blocks).
  struct CommTime {
    double waited_s = 0, busy_s = 0;
    double hidden() const { return busy_s > 0 ? 1 - waited_s / busy_s : 0; }
  };
  struct StepTimes {
    double total_s = 0, attention_s = 0, other_kernels_s = 0;
    CommTime ring, all_to_all, grads, other;
    // A GPU library's traffic the executor causes (0 on CPU): buffers it
    // copied from the device to the host (for collectives, tiles, and at
    // the end of the step the loss and the gradients), and device buffers
    // it freed (those of the other program, when a step follows an
    // evaluation or the reverse; a program's buffers otherwise stay on the
    // device from step to step).
    int64_t device_to_host_copies = 0, device_buffers_freed = 0;
    // What it uploads as the step starts: the token arrays the program
    // reads, and the parameters when the host wrote them since the device
    // last had them (one copy of them all). (Collectives' outputs go up
    // too, and are not counted.)
    int64_t host_to_device_copies = 0;
    // Values the schedule offloads: bytes copied out to the host (each
    // comes back before the backward reads it) and the time both ways took.
    int64_t offloaded_bytes = 0;
    double offload_s = 0;
  };
  const StepTimes& last_step_times() const { return times_; }
  // Bytes this rank sent to other ranks of its sequence group (sp, and in a
  // hybrid step its Ulysses and ring groups) since construction or the last
  // reset: through all-to-alls, and point to point (ring passes).
  int64_t all_to_all_bytes_sent() const;
  int64_t p2p_bytes_sent() const;
  void reset_bytes_sent();
  // Overlap (the default): a communication thread runs the step's
  // collectives in program order while the kernels run; ring passes and
  // Ulysses' all-to-alls run between their start and their wait (the
  // program puts kernels between them), and the gradient sums start bucket
  // by bucket as the backward finishes them. Off, every collective blocks
  // where it stands (the baseline the overlap is measured against).
  // HALYARD_NO_OVERLAP=1 turns it off for every model of the process. It
  // needs communicators that other threads may call (MPI: initialized with
  // MPI_THREAD_SERIALIZED, as runtime::make_mpi_communicator does).
  void set_overlap(bool on) { overlap_ = on; }

  // A GPU library's kernels run asynchronously: StepTimes' attention_s and
  // other_kernels_s are then the time their launches took. With this on, the
  // executor waits for the device before and after each kernel, so that they
  // are the kernels' device time; it serializes the step (for measuring
  // only, as gpu_step_bench does). No effect on CPU libraries.
  void set_kernel_times_on_device(bool on) { kernel_times_on_device_ = on; }

  // Checks the windows in which an offloaded value's copies may run beside
  // the kernels (runtime/offload_windows.h) on any device: with this on, each
  // offload's copy runs as late as its window allows and each reload's as
  // early, in the order one communication stream would take them, instead
  // of at their calls. Correct windows leave the results unchanged.
  void set_copies_at_window_edges(bool on) { copies_at_edges_ = on; }

  // Halide's worker threads (the pool is global to the process).
  static void set_num_threads(int n);

 private:
  double run(const ProgramSpec& p, const int32_t* const inputs[4]);
  struct Bound;
  Bound& bind(const ProgramSpec& p, const int32_t* const inputs[4]);
  // Frees the device memory Halide gave a program's buffers; with
  // `aliases`, their aliases of the executor's blocks too (which otherwise
  // stay: they cost nothing).
  void release_device(Bound* b, bool aliases);
  void sum_over_mesh(float* grads, int64_t n);  // in f32 or, set so, bf16 summed in f32
  void pin_host_blocks();
  // Which copy of the parameters (the gradients) is current: a GPU step's
  // kernels and its update leave them on the device; the host accessors
  // fetch them and, when they may write, make the host's the current one.
  enum class Current : uint8_t { Host, Device, Both };
  uint8_t* params_on_host(bool writes) const;
  uint8_t* grads_on_host(bool writes) const;
  void fetch(int block, Current& current) const;  // device_blocks_[block] home, if the device's is newer
  void upload_if_host_newer(int block, Current& current, int64_t& count);
  struct WindowedCopies;
  struct DeviceAdamW;
  DeviceAdamW& device_adamw();  // made at the first update
  void zero_reduce_scatter(DeviceAdamW& d);
  void zero_all_gather(DeviceAdamW& d);
  void wait_for_pinned_copies();
  void wait_for_device(const char* what);  // throws naming `what`
  int64_t token_slot_bytes() const;  // one of tokens_'s four int32 arrays, aligned
  void check_communicators();
  // `finish_later`: on the device, a plan whose transfer can run on is
  // left in device_in_flight_ for the program's Wait (finish_device_plan).
  void collective(const CallSpec& call, const ProgramSpec& p, ::halide_buffer_t* bufs, bool finish_later = false);
  bool finish_device_plan(int out);  // false if out has none in flight
  void settle_device_collectives();  // before the host waits for the compute stream
  void* device_address(const ProgramSpec& p, ::halide_buffer_t* bufs, int b, bool read, const char* what);
  void written_on_device(const ProgramSpec& p, ::halide_buffer_t* bufs, int b);
  CollectiveMemory& device_staging();  // made at first use
  void to_host(::halide_buffer_t& hb);  // a GPU kernel's result, when the host copy is stale
  void to_host(const ProgramSpec& p, ::halide_buffer_t* bufs, int b);  // buffer b of p, or a view's buffer
  void concat(const CallSpec& call, const ProgramSpec& p, ::halide_buffer_t* bufs);
  void offload(const CallSpec& call, const ProgramSpec& p, ::halide_buffer_t* bufs);  // Offload, Reload
  void ring_shift(const CallSpec& call, const ProgramSpec& p, ::halide_buffer_t* bufs, Communicator* over);
  class CommThread;
  bool background() const;
  void validate(const int32_t* ids, const int32_t* labels, const int32_t* positions) const;

  // Halide's kernels may use aligned vector loads: every buffer they see
  // starts on a 128-byte boundary (Halide's own allocation alignment). A
  // block starts on a page, which a CUDA step pins whole.
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  using Block = std::unique_ptr<uint8_t[], Free>;
  static Block allocate(int64_t bytes);

  const ModelSpec& spec_;
  std::vector<int64_t> offsets_;  // of each parameter in params_ and grads_
  Block params_, grads_, tokens_, arena_;
  mutable Current params_at_ = Current::Host, grads_at_ = Current::Host;
  Block offload_;  // host copies of offloaded values (ProgramSpec::offload_bytes)
  std::vector<std::unique_ptr<DeviceBlock>> device_blocks_;  // their device mirrors (GPU)
  std::vector<std::unique_ptr<PinnedHost>> pinned_;  // the blocks, page-locked (CUDA); released before them
  std::unique_ptr<CudaCopyStream> copy_stream_;  // offload copies beside the kernels (CUDA, offload block pinned)
  std::unique_ptr<Bound> train_bufs_, forward_bufs_;  // each program's buffers (bind)
  bool gpu_ = false;  // a GPU target's library: its kernels read and write device buffers
  bool cuda_ = false;  // a CUDA target's (the runtime's context and stream, pinned host blocks)
  std::vector<int32_t> row_index_;  // each local token's index in the row [batch, local_seq]: the step's token_index
  int64_t arena_bytes_ = 0;
  int64_t flat_size_ = 0;
  Communicator* comm_ = nullptr;  // sp group
  Communicator* mesh_ = nullptr;  // dp x sp
  std::unique_ptr<Communicator> ulysses_, ring_;  // hybrid: the sp group split (sp_u, sp_r)
  bool reduce_grads_ = true;
  bool reduce_grads_bf16_ = false;
  HostCollectiveMemory host_staging_;  // staging of collectives on the host
  // A CUDA library over NCCL: collectives on the device buffers (and their
  // staging there), with the gradients summed there too.
  bool device_collectives_ = false;
  std::unique_ptr<CollectiveMemory> device_staging_;
  std::map<int, std::unique_ptr<Exchange>> exchanges_;  // ring passes in flight, by output buffer (no thread)
  // Device plans started, finished at their Wait, by output buffer: each
  // stages in a slot of its own.
  struct InFlightPlan {
    StartedPlan plan;
    int slot;
  };
  std::map<int, InFlightPlan> device_in_flight_;
  bool overlap_ = std::getenv("HALYARD_NO_OVERLAP") == nullptr;
  bool kernel_times_on_device_ = false;
  bool copies_at_edges_ = false;
  std::shared_ptr<CommThread> comm_thread_;  // when every communicator may be called from it
  // The train step's gradients, by the call after which each is final.
  std::vector<std::vector<int>> grads_final_after_;
  StepTimes times_;
  std::vector<bool> decay_;
  AdamWConfig adamw_cfg_;
  std::unique_ptr<AdamW> host_adamw_;       // a CPU library's update
  std::unique_ptr<DeviceAdamW> device_adamw_;  // a GPU library's: moments and kernel buffers on the device
  std::vector<std::vector<float>> pending_m_, pending_v_;  // moments set before device_adamw_ exists
  bool have_grads_ = false;  // a train step has run
  bool zero_ = false;  // use_zero_adamw: the update's state sharded over the mesh, on the device
  bool device_update_ = false;  // use_adamw put the update on the device: parameters and gradients stay there
  UpdateTimes update_times_;
  std::string profile_;
};

}  // namespace halyard::runtime
