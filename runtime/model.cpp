// Executing a generated model's step programs (see model.h).
#include "runtime/model.h"

#include <HalideRuntime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <string_view>

#include "runtime/collectives.h"
#include "runtime/cuda_context.h"
#include "runtime/data.h"
#include "runtime/device_memory.h"
#include "runtime/error.h"
#include "runtime/offload_windows.h"
#include "runtime/scratch.h"
#include "runtime/zero.h"

namespace halyard::runtime {
namespace {

constexpr int64_t kAlign = 128;
// The chunk of a gradient one thread of the optimizer's grad_sumsq sums.
constexpr int32_t kNormChunk = 4096;
// Gradient sums start in buckets of at least this many bytes: large enough
// that each call moves data at the link's rate, small enough that the first
// starts well before the backward ends (a layer of the tiny Llama is 3.4 MB).
constexpr int64_t kGradBucketBytes = 4 << 20;

int64_t round_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

halide_type_t halide_type_of(ElemType t) {
  switch (t) {
    case ElemType::F64: return halide_type_t(halide_type_float, 64);
    case ElemType::I32: return halide_type_t(halide_type_int, 32);
    case ElemType::BF16: return halide_type_t(halide_type_uint, 16);
    default: return halide_type_t(halide_type_float, 32);
  }
}

// Under HALYARD_PROFILE, Halide's temporaries go through these, so that the
// profile states the most scratch memory each kernel held at once (what a
// plan's kernel_scratch predicts). Each block carries its size in front.
constexpr size_t kHeader = 128;  // keeps Halide's 128-byte alignment
std::atomic<int64_t> live_scratch{0}, peak_scratch{0};

void* counting_malloc(void*, size_t n) {
  auto* p = static_cast<uint8_t*>(scratch::allocate(n + kHeader));
  if (!p) return nullptr;
  *reinterpret_cast<size_t*>(p) = n;
  const int64_t now = live_scratch += static_cast<int64_t>(n);
  for (int64_t peak = peak_scratch.load(); now > peak && !peak_scratch.compare_exchange_weak(peak, now);) {
  }
  return p + kHeader;
}

void counting_free(void*, void* q) {
  if (!q) return;
  auto* p = static_cast<uint8_t*>(q) - kHeader;
  live_scratch -= static_cast<int64_t>(*reinterpret_cast<size_t*>(p));
  scratch::release(p);
}

std::string where(const ModelSpec& s, int64_t flat) {
  return "[batch=" + std::to_string(flat / s.local_seq) + ", seq=" + std::to_string(flat % s.local_seq) + "]";
}

}  // namespace

// The step's communication thread: runs collectives in the order they are
// submitted (the program's order, the same on every rank), each to its end,
// while the thread that submitted them goes on with kernels. A job returns
// the seconds it took; its error (a timeout naming a dead rank) reaches
// whoever waits for it. Destroying the thread finishes the jobs queued.
class Model::CommThread {
 public:
  CommThread() : thread_([this] { loop(); }) {}
  ~CommThread() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  std::future<double> submit(std::function<void()> job) {
    std::packaged_task<double()> task([job = std::move(job)] {
      const auto t0 = std::chrono::steady_clock::now();
      job();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
    std::future<double> done = task.get_future();
    {
      std::lock_guard<std::mutex> lock(m_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
    return done;
  }

 private:
  void loop() {
    for (;;) {
      std::packaged_task<double()> task;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<double()>> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: it starts once the rest exists
};

// Collectives on the device run in the order of the step's kernels (their
// copies on the compute stream), so never on a communication thread.
bool Model::background() const { return overlap_ && comm_thread_ != nullptr && !device_collectives_; }

// Communicators whose buffers are device memory (NCCL) serve a CUDA library
// only, all of its groups alike; their calls run on the runtime's
// communication stream after its compute stream's work.
void Model::check_communicators() {
  int on_device = 0, all = 0;
  const char* backend = "";
  for (Communicator* c : {comm_, mesh_}) {
    if (!c) continue;
    ++all;
    if (c->moves_device_memory()) ++on_device, backend = c->backend();
  }
  if (on_device == 0) return;
  const std::string who = "error: model \"" + std::string(spec_.name) + "\"";
  if (!cuda_)
    throw Error(who + " is a library for " + (spec_.target && *spec_.target ? spec_.target : "the host") +
                ", and its communicator (" + backend + ") moves CUDA device memory.\nfix: use "
                "make_mpi_communicator() for CPU ranks, or build the model for CUDA (TARGET host-cuda).");
  if (on_device != all)
    throw Error(who + " has one communicator over NCCL and one over host memory.\nfix: make the sequence group and "
                "the mesh of the same backend.");
  const RuntimeCudaContext& ctx = runtime_cuda_context();
  if (!ctx.context)
    throw Error(who + " runs its collectives over " + backend + " on the device, but this process has no CUDA "
                "context: " + ctx.error + "\nfix: run it where an NVIDIA GPU and its driver are.");
  for (Communicator* c : {comm_, mesh_})
    if (c) c->use_streams(ctx.comm_stream, ctx.stream);
  device_collectives_ = true;
}

Model::Block Model::allocate(int64_t bytes) {
  constexpr int64_t kPage = 4096;
  const auto size = static_cast<size_t>((std::max<int64_t>(bytes, 1) + kPage - 1) / kPage * kPage);
  void* p = std::aligned_alloc(kPage, size);
  if (!p) throw Error("error: cannot allocate " + std::to_string(bytes) + " bytes for a generated model.");
  std::memset(p, 0, size);
  return Block(static_cast<uint8_t*>(p));
}

Model::Model(const ModelSpec& spec, Communicator* comm, Communicator* mesh) : spec_(spec), comm_(comm), mesh_(mesh) {
  const int ranks = comm ? comm->size() : 1;
  if (ranks != spec.sp)
    throw Error("error: model \"" + std::string(spec.name) + "\" was generated for sp=" + std::to_string(spec.sp) +
                " (the sequence split over " + std::to_string(spec.sp) + " rank" + (spec.sp > 1 ? "s" : "") +
                "), but it runs on " + std::to_string(ranks) + " rank" + (ranks > 1 ? "s" : "") +
                (comm ? std::string(" (") + comm->backend() + ")" : std::string(" (no communicator)")) +
                ".\nfix: launch " + std::to_string(spec.sp) + " ranks (mpirun -np " + std::to_string(spec.sp) +
                "), or build the model for this many with halyard_add_model(... SP " + std::to_string(ranks) + ").");
  // Halide's kernels run in the device's primary context, on the runtime's
  // stream, where cuBLAS, cuDNN and NCCL can reach their buffers.
  cuda_ = spec.target && std::string_view(spec.target).find("cuda") != std::string_view::npos;
  if (cuda_) use_runtime_cuda_context();
  for (const char* api : {"cuda", "opencl", "metal", "vulkan", "d3d12", "webgpu"})
    gpu_ = gpu_ || (spec.target && std::string_view(spec.target).find(api) != std::string_view::npos);
  if (!mesh_) mesh_ = comm;
  if (mesh_ && mesh_->size() % spec.sp != 0)
    throw Error("error: model \"" + std::string(spec.name) + "\" splits the sequence over sp=" + std::to_string(spec.sp) +
                " ranks, but the mesh has " + std::to_string(mesh_->size()) +
                " ranks, not a multiple of it (dp x sp).\nfix: launch dp * " + std::to_string(spec.sp) + " ranks.");
  if (mesh_ && mesh_->size() == 1) mesh_ = nullptr;
  if (spec.sp == 1) comm_ = nullptr;
  check_communicators();
  // Hybrid: sp rank s = i * u + j is rank j of Ulysses group i and rank i of
  // ring group j (ModelSpec::ulysses_degree).
  if (comm_ && spec.ulysses_degree > 1) {
    const int u = spec.ulysses_degree, s = comm_->rank();
    ulysses_ = comm_->split(s / u, s);
    ring_ = comm_->split(s % u, s);
  }
  keep_freed_memory();
  // Halide's temporaries from the threads' scratch stacks, as the plan counts
  // them. (Here, not in keep_freed_memory: programs that JIT-compile their
  // kernels call that and have no Halide runtime of their own to hook.)
  static std::once_flag scratch_hooks;
  std::call_once(scratch_hooks, [] {
    halide_set_custom_malloc([](void*, size_t n) { return scratch::allocate(n); });
    halide_set_custom_free([](void*, void* p) { scratch::release(p); });
  });
  int64_t total = 0;
  for (int i = 0; i < spec.num_params; ++i) {
    offsets_.push_back(total);
    total += round_up(spec.params[i].numel * static_cast<int64_t>(sizeof(float)));
  }
  flat_size_ = total / static_cast<int64_t>(sizeof(float));
  params_ = allocate(total);
  grads_ = allocate(total);
  tokens_ = allocate(4 * token_slot_bytes());
  // Each token's index in the row: fixed by the rank and the layout.
  const std::vector<int32_t> index =
      Shard{comm_ ? comm_->rank() : 0, spec.sp, 0, 1, zigzag_layout(spec)}.row_index(spec.local_seq);
  for (int64_t b = 0; b < spec.batch; ++b) row_index_.insert(row_index_.end(), index.begin(), index.end());
  // A communication thread, when there is something to communicate and
  // every communicator may be called from it.
  bool threads_ok = comm_ || mesh_;
  for (const Communicator* c : {comm_, mesh_, ulysses_.get(), ring_.get()}) threads_ok = threads_ok && (!c || c->other_threads_may_call());
  if (threads_ok) comm_thread_ = std::make_shared<CommThread>();
  // Each gradient is final after the last call that touches it: from there
  // its sum over the mesh can run under the rest of the backward.
  grads_final_after_.assign(static_cast<size_t>(spec.train.num_calls), {});
  std::vector<int> last(static_cast<size_t>(spec.num_params), -1);
  for (int c = 0; c < spec.train.num_calls; ++c)
    for (int a = 0; a < spec.train.calls[c].num_args; ++a) {
      const BufferSpec& b = spec.train.buffers[spec.train.calls[c].args[a]];
      if (b.storage == Storage::Grad) last[static_cast<size_t>(b.index)] = c;
    }
  for (int i = 0; i < spec.num_params; ++i)
    if (last[static_cast<size_t>(i)] >= 0) grads_final_after_[static_cast<size_t>(last[static_cast<size_t>(i)])].push_back(i);
  arena_bytes_ = std::max(spec.train.arena_bytes, spec.forward.arena_bytes);
  arena_ = allocate(arena_bytes_);
  offload_ = allocate(std::max(spec.train.offload_bytes, spec.forward.offload_bytes));
}

int64_t Model::all_to_all_bytes_sent() const {
  int64_t n = 0;
  for (const Communicator* c : {comm_, ulysses_.get(), ring_.get()}) n += c ? c->all_to_all_bytes_sent() : 0;
  return n;
}

int64_t Model::p2p_bytes_sent() const {
  int64_t n = 0;
  for (const Communicator* c : {comm_, ulysses_.get(), ring_.get()}) n += c ? c->p2p_bytes_sent() : 0;
  return n;
}

void Model::reset_bytes_sent() {
  for (Communicator* c : {comm_, ulysses_.get(), ring_.get()})
    if (c) c->reset_all_to_all_bytes_sent();
}

int Model::param_index(const std::string& name) const {
  std::string names;
  for (int i = 0; i < spec_.num_params; ++i) {
    if (name == spec_.params[i].name) return i;
    if (i < 8) names += std::string(i ? ", " : "") + spec_.params[i].name;
  }
  throw Error("error: model \"" + std::string(spec_.name) + "\" has no parameter \"" + name + "\".\nlegal names: " +
              names + (spec_.num_params > 8 ? ", ..." : ""));
}

void Model::init_params(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 0.02f);
  for (int i = 0; i < spec_.num_params; ++i) {
    const bool norm = spec_.params[i].rank == 1;
    float* w = param(i);
    for (int64_t k = 0; k < spec_.params[i].numel; ++k) w[k] = norm ? 1.f : normal(rng);
  }
}

void Model::set_num_threads(int n) { halide_set_num_threads(n); }

void Model::validate(const int32_t* ids, const int32_t* labels, const int32_t* positions) const {
  const int64_t n = tokens();
  for (int64_t t = 0; t < n; ++t) {
    if (ids[t] < 0 || ids[t] >= spec_.vocab)
      throw Error("error: token id " + std::to_string(ids[t]) + " at input_ids" + where(spec_, t) +
                  " is outside the vocabulary.\nlegal ids: 0 .. " + std::to_string(spec_.vocab - 1) +
                  " (vocab = " + std::to_string(spec_.vocab) + " in model \"" + spec_.name + "\").");
    if (labels[t] != spec_.ignore_index && (labels[t] < 0 || labels[t] >= spec_.vocab))
      throw Error("error: label " + std::to_string(labels[t]) + " at labels" + where(spec_, t) +
                  " is outside the vocabulary.\nlegal labels: 0 .. " + std::to_string(spec_.vocab - 1) + ", or " +
                  std::to_string(spec_.ignore_index) + " to ignore the token.");
    if (positions[t] < 0)
      throw Error("error: position " + std::to_string(positions[t]) + " at position_ids" + where(spec_, t) +
                  " is negative.\nlegal: positions >= 0 (each token's place in its document).");
    // Attention sees keys from row index g - p to g (dsl/ops.h): the kernels
    // trim their loops to that interval, so the documents it implies must be
    // runs of the row, each token's start no earlier than the one before.
    const int64_t g = row_index_[static_cast<size_t>(t)], start = std::max<int64_t>(0, g - positions[t]);
    if (t % spec_.local_seq == 0) continue;
    const int64_t g0 = row_index_[static_cast<size_t>(t - 1)], start0 = std::max<int64_t>(0, g0 - positions[t - 1]);
    const bool next = g == g0 + 1;  // (zigzag chunks: other ranks' tokens lie between)
    if (start < start0 || (next && start > start0 && positions[t] != 0) ||
        (next && start == 0 && positions[t] <= positions[t - 1]))
      throw Error("error: position_ids" + where(spec_, t) + " is " + std::to_string(positions[t]) + " after " +
                  std::to_string(positions[t - 1]) + ": positions increase strictly along a row, and by one within a "
                  "document of a packed row,\nwhere the next document restarts at 0 (attention stays within each "
                  "document).\nlegal: e.g. 0, 1, 2, ... (a rank's global positions under sequence parallelism), or "
                  "0, 1, 2, 0, 1, ... for packed documents.");
  }
}

double Model::train_step(const int32_t* ids, const int32_t* labels, const int32_t* positions) {
  validate(ids, labels, positions);
  const int32_t* inputs[4] = {ids, positions, labels, row_index_.data()};
  return run(spec_.train, inputs);
}

double Model::forward_loss(const int32_t* ids, const int32_t* labels, const int32_t* positions) {
  validate(ids, labels, positions);
  const int32_t* inputs[4] = {ids, positions, labels, row_index_.data()};
  return run(spec_.forward, inputs);
}

void Model::to_host(const ProgramSpec& p, halide_buffer_t* bufs, int b) {
  const BufferSpec& s = p.buffers[b];  // a view's rows are its buffer's, wherever it lives
  to_host(bufs[s.storage == Storage::View ? s.index : b]);
}

void Model::to_host(halide_buffer_t& hb) {
  if (!hb.device || !(hb.flags & halide_buffer_flag_device_dirty)) return;
  settle_device_collectives();
  if (int err = halide_copy_to_host(nullptr, &hb))
    throw Error("error: model \"" + std::string(spec_.name) + "\": copying a device buffer home failed with Halide error " +
                std::to_string(err) + "; Halide printed the reason above.");
  ++times_.device_to_host_copies;
  wait_for_pinned_copies();
}

// Halide 21's CUDA copies run on the runtime's stream (cuMemcpy*Async) and
// it does not wait for them: from pageable memory the driver finishes them
// before returning, from pinned memory it does not. So with pinned blocks
// the host waits for the stream before it reads what came home, and before
// it writes host bytes an upload may still be reading (a collective's
// output shares the arena's bytes with buffers that went up earlier).
void Model::wait_for_pinned_copies() {
  if (!pinned_.empty()) wait_for_device("copies between the device and pinned host memory");
}

void Model::wait_for_device(const char* what) {
  settle_device_collectives();
  if (int err = device_blocks_.front()->sync())
    throw Error("error: model \"" + std::string(spec_.name) + "\": waiting for the device (" + what +
                ") failed with Halide error " + std::to_string(err) + "; Halide printed the reason above.");
}

void Model::sum_over_mesh(float* grads, int64_t n) {
  if (reduce_grads_bf16_ && device_collectives_) {  // (device memory: the same sums by the device's kernels)
    all_reduce_sum_bf16_on_device(grads, n, *mesh_, device_staging());
  } else if (reduce_grads_bf16_) {
    mesh_->all_reduce_sum_bf16(grads, n);
  } else {
    mesh_->all_reduce_sum(grads, n);
  }
}

void Model::collective(const CallSpec& call, const ProgramSpec& p, halide_buffer_t* bufs, bool finish_later) {
  if (!device_collectives_) wait_for_pinned_copies();  // (the host is about to read or write their bytes)
  if (call.kind == CallKind::ConcatSeq) {
    concat(call, p, bufs);
    return;
  }
  halide_buffer_t& in = bufs[call.args[0]];
  halide_buffer_t& out = bufs[call.args[1]];
  // Kernels of a GPU target leave results on the device; collectives move host memory.
  if (!device_collectives_) to_host(p, bufs, call.args[0]);
  // The call's mesh axis names its communicator: the sequence group, every
  // rank, or a hybrid step's Ulysses or ring groups.
  const std::string axis = call.mesh_axis ? call.mesh_axis : "";
  // (Every collective of a step comes here: compared in place, no table built per call.)
  const bool hybrid = spec_.ulysses_degree > 1;
  Communicator* over = nullptr;
  if (axis == "sp") over = comm_;
  else if (axis == "dp,sp") over = mesh_;
  else if (hybrid && axis == "sp_u") over = ulysses_.get();
  else if (hybrid && axis == "sp_r") over = ring_.get();
  else
    throw Error(std::string("error: model \"") + spec_.name + "\" calls " + call.kernel + " over mesh axis \"" + axis +
                "\"; this runtime has the axes \"sp\" and \"dp,sp\" (and \"sp_u\", \"sp_r\" in hybrid steps)."
                "\nfix: regenerate the library with this version of Halyard.");
  if (call.kind == CallKind::RingShift) {
    ring_shift(call, p, bufs, over);
    return;
  }
  if (!over && call.kind != CallKind::AllReduce)  // (one rank: the sum is the value)
    throw Error(std::string("error: model \"") + spec_.name + "\" calls " + call.kernel + " without a communicator.");
  CollectivePlan plan = plan_collective(call.kind, p.buffers[call.args[0]], p.buffers[call.args[1]],
                                              over ? over->size() : 1, over ? over->backend() : "one rank");
  if (device_collectives_) {
    // The plan on the buffers' device memory: its copies on the compute
    // stream, its transfer over NCCL after them (the communicator waits for
    // the compute stream by an event). With overlap, an all-to-all's copies
    // out of the staging wait for the transfer by another event, queued
    // here or at the program's Wait, and the host waits for neither; without,
    // the host waits for the transfer (the baseline). Nothing comes home.
    const int out = call.args[1];
    const void* src = device_address(p, bufs, call.args[0], true, call.kernel);
    void* dst = device_address(p, bufs, out, false, call.kernel);
    written_on_device(p, bufs, out);
    if (!overlap_) {
      run_plan(std::move(plan), src, dst, over, device_staging());
      return;
    }
    // The lowest slot no plan in flight stages in (they are few: q, k and v's).
    std::set<int> taken;
    for (const auto& [o, f] : device_in_flight_) taken.insert(f.slot);
    int slot = 0;
    while (taken.count(slot)) ++slot;
    InFlightPlan& f = device_in_flight_[out] =
        InFlightPlan{start_plan(std::move(plan), src, dst, over, device_staging(), slot), slot};
    // (A transfer done already, as a gather is: nothing to wait for later.)
    if (!finish_later || !f.plan.transfer) finish_device_plan(out);
    return;
  }
  run_plan(std::move(plan), in.host, out.host, over, host_staging_);
  if (gpu_) out.flags |= halide_buffer_flag_host_dirty;  // (Halide uploads only host-dirty buffers)
}

// Buffer b's device address for a collective (`read`: its input, uploaded
// first if the host wrote it last).
void* Model::device_address(const ProgramSpec& p, halide_buffer_t* bufs, int b, bool read, const char* what) {
  const BufferSpec& s = p.buffers[b];
  halide_buffer_t& owner = bufs[s.storage == Storage::View ? s.index : b];
  if (read && (owner.flags & halide_buffer_flag_host_dirty) &&
      halide_copy_to_device(nullptr, &owner, owner.device_interface))
    throw Error("error: model \"" + std::string(spec_.name) + "\": uploading " + s.name + " for " + what +
                " failed; Halide printed the reason above.");
  if (!bufs[b].device)
    throw Error("error: model \"" + std::string(spec_.name) + "\": " + s.name + " has no device memory for " + what + ".");
  return reinterpret_cast<void*>(static_cast<uintptr_t>(bufs[b].device));
}

// Buffer b (a view: its buffer too) was written on the device: kernels read
// it there, and the host's copy is stale.
void Model::written_on_device(const ProgramSpec& p, halide_buffer_t* bufs, int b) {
  const BufferSpec& s = p.buffers[b];
  for (int w : {b, s.storage == Storage::View ? s.index : b})
    bufs[w].flags = (bufs[w].flags & ~halide_buffer_flag_host_dirty) | halide_buffer_flag_device_dirty;
}

bool Model::finish_device_plan(int out) {
  auto it = device_in_flight_.find(out);
  if (it == device_in_flight_.end()) return false;
  InFlightPlan f = std::move(it->second);
  device_in_flight_.erase(it);  // (its slot is free: later copies into it queue after these)
  finish_plan(f.plan, device_staging());
  return true;
}

// Transfers the compute stream waits for by events (collective, ring
// passes): the host waits for them first, with their timeouts, so that a
// dead peer is the communicator's error rather than a synchronize that
// never returns.
void Model::settle_device_collectives() {
  if (device_staging_) device_staging_->settle();
}

CollectiveMemory& Model::device_staging() {
  if (!device_staging_) device_staging_ = make_cuda_collective_memory();
  return *device_staging_;
}

// An offloaded value out to its host memory, or back to its device bytes,
// which other buffers used in between. (Without a device the host copy is
// the value: nothing moves.)
void Model::offload(const CallSpec& call, const ProgramSpec& p, halide_buffer_t* bufs) {
  halide_buffer_t& hb = bufs[call.args[0]];
  if (!hb.device) return;
  const BufferSpec& s = p.buffers[call.args[0]];
  int err = 0;
  settle_device_collectives();  // (a copy between pageable memory and the device waits for the stream)
  if (call.kind == CallKind::Offload) {
    if (hb.flags & halide_buffer_flag_device_dirty) {
      err = halide_copy_to_host(nullptr, &hb);
      times_.offloaded_bytes += static_cast<int64_t>(hb.size_in_bytes());
    }
  } else {
    hb.flags |= halide_buffer_flag_host_dirty;
    err = halide_copy_to_device(nullptr, &hb, hb.device_interface);
  }
  if (err)
    throw Error("error: model \"" + std::string(spec_.name) + "\": " + call.kernel + " of " + s.name +
                " failed with Halide error " + std::to_string(err) + "; Halide printed the reason above.");
}

// Ring attention's block pass: rank r sends its buffer to r + direction and
// receives r - direction's. Without a communication thread the exchange
// runs in the background from its start to its wait (run() finishes it),
// unless overlap is off (then it finishes at once: the baseline that
// measures how much of it the kernels hide). On the communication thread it
// finishes here, while the kernels go on.
void Model::ring_shift(const CallSpec& call, const ProgramSpec& p, halide_buffer_t* bufs, Communicator* over) {
  const int out_index = call.args[1];
  const BufferSpec& s = p.buffers[call.args[0]];
  int64_t n = 1;
  for (int d = 0; d < s.rank; ++d) n *= s.shape[d];
  halide_buffer_t& in = bufs[call.args[0]];
  halide_buffer_t& out = bufs[out_index];
  if (s.type != ElemType::F32 && s.type != ElemType::I32)
    throw Error(std::string("error: model \"") + spec_.name + "\": ring_shift of " + s.name + " moves f32 or i32 only.");
  // Over NCCL the pass moves the buffers' device memory (queued after the
  // kernels before it; its wait is the program's Wait).
  const void* src = in.host;
  void* dst = out.host;
  if (device_collectives_) {
    src = device_address(p, bufs, call.args[0], true, call.kernel);
    dst = device_address(p, bufs, out_index, false, call.kernel);
    written_on_device(p, bufs, out_index);
  } else if (gpu_) {
    out.flags |= halide_buffer_flag_host_dirty;  // written on the host, read by kernels after its wait
  }
  if (!over) {  // one rank: its own block comes back
    if (device_collectives_) device_staging().rows({Area::In, Area::Out, 0, n, 0, n, n, 1}, src, dst, 4);
    else std::memcpy(dst, src, static_cast<size_t>(n) * 4);
    return;
  }
  const int size = over->size(), r = over->rank();
  const int to = ((r + call.direction) % size + size) % size, from = ((r - call.direction) % size + size) % size;
  // Several passes are in flight at once (k, v and positions): each has its
  // own tag, from its output buffer, so that no receive takes another's message.
  const int tag = out_index % kMaxCommTag;
  std::unique_ptr<Exchange> e =
      s.type == ElemType::I32
          ? over->start_exchange(static_cast<const int32_t*>(src), static_cast<int32_t*>(dst), n, to, from, tag)
          : over->start_exchange(static_cast<const float*>(src), static_cast<float*>(dst), n, to, from, tag);
  if (!overlap_ || background()) e->wait();
  else exchanges_[out_index] = std::move(e);
}

// Tiles of a sequence back to back: the one axis where the output's extent
// differs from a tile's is seq (rows before it are "outer", after "inner").
void Model::concat(const CallSpec& call, const ProgramSpec& p, halide_buffer_t* bufs) {
  const int tiles = call.num_args - 1;
  const BufferSpec& o = p.buffers[call.args[tiles]];
  const BufferSpec& t0 = p.buffers[call.args[0]];
  int d = 0;
  while (d < o.rank && o.shape[d] == t0.shape[d]) ++d;
  if (d == o.rank) d = 0;  // one tile: a copy
  const int64_t es = elem_bytes(o.type);
  int64_t outer = 1, inner = es;
  for (int k = 0; k < d; ++k) outer *= o.shape[k];
  for (int k = d + 1; k < o.rank; ++k) inner *= o.shape[k];
  halide_buffer_t& out = bufs[call.args[tiles]];
  int64_t at = 0;
  for (int t = 0; t < tiles; ++t) {
    halide_buffer_t& in = bufs[call.args[t]];
    to_host(p, bufs, call.args[t]);
    const int64_t len = p.buffers[call.args[t]].shape[d];
    for (int64_t r = 0; r < outer; ++r)
      std::memcpy(out.host + (r * o.shape[d] + at) * inner, in.host + r * len * inner, static_cast<size_t>(len * inner));
    at += len;
  }
  if (gpu_) out.flags |= halide_buffer_flag_host_dirty;  // (Halide uploads only host-dirty buffers)
}

// A program's Halide buffers, made on its first step and kept: over the
// token slots, the parameters, the gradients and the arena, whose addresses
// never change. A GPU library's device allocations stay with them from
// step to step (release_device frees them).
struct Model::Bound {
  std::vector<halide_buffer_t> bufs;
  std::vector<halide_dimension_t> dims;
  std::vector<bool> aliased;  // its device memory is an alias into device_blocks_
  std::vector<CopyWindow> windows;  // of its offload copies (offload_windows.h)
};

// A GPU library's update on the device: the moments, a block for the
// gradient norm's partial sums, and the optimizer kernels' buffers (aliases
// of the parameters', gradients' and moments' blocks) by segment, a run of
// one parameter's elements: the whole parameter, or under ZeRO-1 its run
// inside this rank's slice. Made at the first update and kept.
struct Model::DeviceAdamW {
  std::unique_ptr<DeviceBlock> m, v, partials;
  std::unique_ptr<DeviceBlock> grad_slice;  // ZeRO-1: the slice's summed gradients (its first `block` elements)
  ZeroSlice slice;  // ZeRO-1: this rank's; segments by parameter otherwise
  std::vector<ZeroSlice::Segment> segments;
  std::vector<halide_dimension_t> dims;  // one per buffer below
  std::vector<halide_buffer_t> w, g, mom, var, part;  // by segment
  std::vector<int64_t> part_at;  // segment s's partial sums: from this double of partials
  std::vector<double> partials_home;
  ~DeviceAdamW() {
    for (auto* list : {&w, &g, &mom, &var, &part})
      for (halide_buffer_t& b : *list)
        if (b.device) release_alias(b);
  }
};

int64_t Model::device_bytes() const {
  int64_t n = 0;
  for (const auto& b : device_blocks_) n += b->bytes();
  if (device_adamw_)
    for (const auto* b : {device_adamw_->m.get(), device_adamw_->v.get(), device_adamw_->partials.get(),
                          device_adamw_->grad_slice.get()})
      if (b) n += b->bytes();
  return n;
}

uint8_t* Model::params_on_host(bool writes) const {
  fetch(0, params_at_);
  if (writes) params_at_ = Current::Host;
  return params_.get();
}

uint8_t* Model::grads_on_host(bool writes) const {
  fetch(1, grads_at_);
  if (writes) grads_at_ = Current::Host;
  return grads_.get();
}

void Model::fetch(int block, Current& current) const {
  if (current != Current::Device) return;
  device_blocks_[static_cast<size_t>(block)]->copy_to_host((block ? grads_ : params_).get(), 0, flat_size_ * 4,
                                                            block ? "the gradients" : "the parameters");
  current = Current::Both;
  if (block == 1 && train_bufs_)  // their kernels' results are home: nothing may copy them over what the host writes
    for (int b = 0; b < spec_.train.num_buffers; ++b)
      if (spec_.train.buffers[b].storage == Storage::Grad)
        train_bufs_->bufs[static_cast<size_t>(b)].flags &= ~static_cast<uint64_t>(halide_buffer_flag_device_dirty);
}

void Model::upload_if_host_newer(int block, Current& current, int64_t& count) {
  if (current != Current::Host) return;
  device_blocks_[static_cast<size_t>(block)]->copy_from_host((block ? grads_ : params_).get(), 0, flat_size_ * 4,
                                                              block ? "the gradients" : "the parameters");
  current = Current::Both;
  ++count;
}

bool Model::adamw_on_device() const {
  return gpu_ && spec_.adamw && spec_.grad_sumsq && device_interface_of(spec_.target ? spec_.target : "");
}

void Model::use_zero_adamw(std::vector<bool> decay, AdamWConfig cfg) {
  if (!device_collectives_ || !mesh_ || !adamw_on_device())
    throw Error("error: model \"" + std::string(spec_.name) + "\": use_zero_adamw shards the update's state over the "
                "ranks of a CUDA library whose communicator moves device memory (NCCL); this model " +
                (!mesh_ ? "runs on one rank" : !device_collectives_ ? "moves host memory" : "has no device update") +
                ".\nfix: runtime::ZeroAdamW on the host for CPU ranks, or use_adamw on one rank.");
  use_adamw(std::move(decay), cfg);
  zero_ = true;
  reduce_grads_ = false;  // the update sums them, each rank its slice
}

void Model::use_adamw(std::vector<bool> decay, AdamWConfig cfg) {
  if (static_cast<int>(decay.size()) != spec_.num_params)
    throw Error("error: use_adamw got " + std::to_string(decay.size()) + " decay flags for model \"" + std::string(spec_.name) +
                "\", which has " + std::to_string(spec_.num_params) + " parameters; give one flag per parameter.");
  decay_ = std::move(decay);
  adamw_cfg_ = cfg;
  zero_ = false;
  device_adamw_.reset();
  host_adamw_.reset();
  pending_m_.clear();
  pending_v_.clear();
  device_update_ = adamw_on_device();
  if (device_update_) return;  // its state is made at the first update (the device is picked at the first step)
  std::vector<int64_t> sizes;
  for (int i = 0; i < spec_.num_params; ++i) sizes.push_back(spec_.params[i].numel);
  host_adamw_ = std::make_unique<AdamW>(sizes, decay_, cfg);
}

Model::DeviceAdamW& Model::device_adamw() {
  if (device_adamw_) return *device_adamw_;
  const halide_device_interface_t* device = device_interface_of(spec_.target);
  auto d = std::make_unique<DeviceAdamW>();
  std::vector<int64_t> offsets, sizes;
  for (int i = 0; i < spec_.num_params; ++i) {
    offsets.push_back(flat_offset(i));
    sizes.push_back(spec_.params[i].numel);
    if (sizes.back() > INT32_MAX)
      throw Error("error: parameter \"" + std::string(spec_.params[i].name) + "\" has " + std::to_string(sizes.back()) +
                  " elements, beyond a Halide buffer's 32-bit extent.\nfix: split it into parameters of fewer elements.");
  }
  // Moments by flat element from `base`: every element, or this rank's slice.
  int64_t base = 0, state = flat_size_, summed_end = flat_size_;  // summed_end: the slice's gradients in grad_slice before it
  if (zero_) {
    d->slice = zero_slice(flat_size_, mesh_->size(), mesh_->rank(), offsets, sizes);
    base = d->slice.begin;
    state = d->slice.end - d->slice.begin;
    summed_end = d->slice.begin + d->slice.block;
    d->grad_slice = std::make_unique<DeviceBlock>(device, std::max<int64_t>(d->slice.block, 1) * 4);
    // The last rank's run across its block's end reads two blocks: two segments.
    for (const ZeroSlice::Segment& s : d->slice.segments) {
      if (s.begin < summed_end && s.end > summed_end) {
        d->segments.push_back({s.param, s.begin, summed_end});
        d->segments.push_back({s.param, summed_end, s.end});
      } else {
        d->segments.push_back(s);
      }
    }
  } else {
    for (int i = 0; i < spec_.num_params; ++i)
      d->segments.push_back({static_cast<size_t>(i), offsets[static_cast<size_t>(i)],
                             offsets[static_cast<size_t>(i)] + sizes[static_cast<size_t>(i)]});
  }
  const size_t n = d->segments.size();
  int64_t partials = 0;
  for (const ZeroSlice::Segment& s : d->segments) {
    d->part_at.push_back(partials);
    partials += round_up((s.end - s.begin + kNormChunk - 1) / kNormChunk * 8) / 8;  // (aliases start aligned)
  }
  d->m = std::make_unique<DeviceBlock>(device, std::max<int64_t>(state, 1) * 4);
  d->v = std::make_unique<DeviceBlock>(device, std::max<int64_t>(state, 1) * 4);
  d->partials = std::make_unique<DeviceBlock>(device, std::max<int64_t>(partials, 1) * 8);
  d->partials_home.resize(static_cast<size_t>(partials));
  for (const DeviceBlock* b : {d->m.get(), d->v.get()}) b->fill_zero("the AdamW moments");
  d->dims.resize(5 * n);
  for (auto* list : {&d->w, &d->g, &d->mom, &d->var, &d->part}) list->assign(n, halide_buffer_t{});
  for (size_t k = 0; k < n; ++k) {
    const ZeroSlice::Segment& s = d->segments[k];
    const int64_t numel = s.end - s.begin;
    struct Place {
      halide_buffer_t& buf;
      const DeviceBlock& block;
      int64_t offset, extent;
      bool f64;
    };
    // The gradients: where the step left them, or (ZeRO-1) summed into the slice's block.
    const bool in_slice = zero_ && s.begin < summed_end;
    const Place places[] = {
        {d->w[k], *device_blocks_[0], s.begin * 4, numel, false},
        {d->g[k], in_slice ? *d->grad_slice : *device_blocks_[1], (in_slice ? s.begin - base : s.begin) * 4, numel, false},
        {d->mom[k], *d->m, (s.begin - base) * 4, numel, false},
        {d->var[k], *d->v, (s.begin - base) * 4, numel, false},
        {d->part[k], *d->partials, d->part_at[k] * 8, (numel + kNormChunk - 1) / kNormChunk, true}};
    for (size_t j = 0; j < 5; ++j) {
      const Place& pl = places[j];
      pl.buf.type = pl.f64 ? halide_type_t(halide_type_float, 64) : halide_type_t(halide_type_float, 32);
      pl.buf.dimensions = 1;
      pl.buf.dim = &d->dims[5 * k + j];
      *pl.buf.dim = halide_dimension_t(0, static_cast<int32_t>(pl.extent), 1);
      if (!pl.block.alias(pl.buf, pl.offset, kAlign))
        throw Error("error: model \"" + std::string(spec_.name) + "\": the optimizer's buffer at byte " +
                    std::to_string(pl.offset) + " is off the device's alignment (a bug in the executor).");
    }
    if (!pending_m_.empty()) {  // moments set before the state existed (a checkpoint)
      const size_t from = static_cast<size_t>(s.begin - offsets[s.param]);
      d->m->copy_from_host(reinterpret_cast<const uint8_t*>(pending_m_[s.param].data() + from), (s.begin - base) * 4,
                           numel * 4, "the AdamW moments");
      d->v->copy_from_host(reinterpret_cast<const uint8_t*>(pending_v_[s.param].data() + from), (s.begin - base) * 4,
                           numel * 4, "the AdamW moments");
    }
  }
  pending_m_.clear();
  pending_v_.clear();
  device_adamw_ = std::move(d);
  return *device_adamw_;
}

double Model::adamw_step(int64_t t, double lr, double max_norm) {
  const std::string who = "error: model \"" + std::string(spec_.name) + "\": adamw_step";
  if (!host_adamw_ && !device_update_) throw Error(who + " before use_adamw.\nfix: call use_adamw(decay) once, first.");
  if (!have_grads_) throw Error(who + " has no gradients yet.\nfix: call train_step first.");
  if (mesh_ && !reduce_grads_ && !zero_)
    throw Error(who + " needs the gradients summed over the mesh, and set_reduce_grads(false) leaves them partial."
                "\nfix: set_reduce_grads(true), or shard the moments with runtime::ZeroAdamW (ZeRO-1).");
  if (t < 1) throw Error(who + " step " + std::to_string(t) + ": steps count from 1.");
  const auto t0 = std::chrono::steady_clock::now();
  update_times_ = UpdateTimes{};
  const int n = spec_.num_params;
  double norm = 0;
  if (host_adamw_) {
    std::vector<float*> w;
    std::vector<const float*> g;
    std::vector<int64_t> sizes;
    for (int i = 0; i < n; ++i) {
      w.push_back(param(i));
      g.push_back(grad(i));
      sizes.push_back(spec_.params[i].numel);
    }
    norm = global_grad_norm(g.data(), sizes);
    if (std::isfinite(norm)) host_adamw_->step(t, lr, w.data(), g.data(), clip_scale(norm, max_norm));
  } else {
    DeviceAdamW& d = device_adamw();
    upload_if_host_newer(0, params_at_, update_times_.host_to_device_copies);
    upload_if_host_newer(1, grads_at_, update_times_.host_to_device_copies);
    auto launch = [&](KernelFn fn, void** args, const char* kernel, int i) {
      if (int err = fn(args))
        throw Error(who + ": kernel " + kernel + " failed on parameter \"" + spec_.params[i].name +
                    "\" with Halide error " + std::to_string(err) + "; Halide printed the reason above.");
    };
    if (zero_) zero_reduce_scatter(d);
    int32_t chunk = kNormChunk;
    for (size_t k = 0; k < d.segments.size(); ++k) {
      void* args[] = {&d.g[k], &chunk, &d.part[k]};
      launch(spec_.grad_sumsq, args, "grad_sumsq", static_cast<int>(d.segments[k].param));
    }
    d.partials->copy_to_host(reinterpret_cast<uint8_t*>(d.partials_home.data()), 0,
                             static_cast<int64_t>(d.partials_home.size()) * 8, "the gradient norm's partial sums");
    ++update_times_.device_to_host_copies;
    double ss = 0;
    for (size_t k = 0; k < d.segments.size(); ++k)
      for (int64_t j = 0; j < d.part[k].dim[0].extent; ++j) ss += d.partials_home[static_cast<size_t>(d.part_at[k] + j)];
    if (zero_) ss = mesh_->all_reduce_sum(ss);  // (every rank's slice)
    norm = std::sqrt(ss);
    if (std::isfinite(norm)) {
      AdamWStepConstants k = adamw_step_constants(adamw_cfg_, t, lr, clip_scale(norm, max_norm));
      for (size_t j = 0; j < d.segments.size(); ++j) {
        const size_t i = d.segments[j].param;
        float decay = decay_[i] ? k.decay : 1.f;
        void* args[] = {&d.w[j], &d.g[j], &d.mom[j], &d.var[j], &k.b1, &k.b2, &k.lr_over_c1, &k.inv_c2, &k.eps,
                        &k.grad_scale, &decay, &d.w[j], &d.mom[j], &d.var[j]};
        launch(spec_.adamw, args, "adamw", static_cast<int>(i));
      }
      if (zero_) zero_all_gather(d);
      params_at_ = Current::Device;
    }
  }
  update_times_.total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return norm;
}

// ZeRO-1 on the device: the gradients summed over the mesh, each rank its
// slice's (the first `block` elements into grad_slice; the remainder, fewer
// than the ranks, summed in place where the last rank's segments read it).
void Model::zero_reduce_scatter(DeviceAdamW& d) {
  auto* grads = reinterpret_cast<float*>(static_cast<uintptr_t>(device_blocks_[1]->handle()));
  const int64_t P = mesh_->size(), tail_begin = P * d.slice.block, tail = flat_size_ - tail_begin;
  auto* slice = reinterpret_cast<float*>(static_cast<uintptr_t>(d.grad_slice->handle()));
  if (reduce_grads_bf16_) {  // (the schedule's grad_reduce_precision; the remainder stays f32, as ZeroAdamW's)
    reduce_scatter_sum_bf16_on_device(grads, slice, d.slice.block, *mesh_, device_staging());
  } else {
    mesh_->reduce_scatter_sum(grads, slice, d.slice.block);
  }
  if (tail > 0) mesh_->all_reduce_sum(grads + tail_begin, tail);
}

// Every rank's updated slice to every rank: the blocks by an all-gather from
// a copy (a call's buffers must not overlap), the remainder from the last
// rank (a sum over ranks where the others give zeros; it is under P floats).
void Model::zero_all_gather(DeviceAdamW& d) {
  auto* params = reinterpret_cast<float*>(static_cast<uintptr_t>(device_blocks_[0]->handle()));
  auto* slice = reinterpret_cast<float*>(static_cast<uintptr_t>(d.grad_slice->handle()));
  const int64_t P = mesh_->size(), block = d.slice.block, tail_begin = P * block, tail = flat_size_ - tail_begin;
  if (block > 0) device_staging().rows({Area::In, Area::Out, d.slice.begin, block, 0, block, block, 1}, params, slice, 4);
  mesh_->all_gather(slice, block, params);
  if (tail > 0) {
    std::vector<float> last(static_cast<size_t>(tail), 0.f);
    if (mesh_->rank() == P - 1)
      device_blocks_[0]->copy_to_host(reinterpret_cast<uint8_t*>(last.data()), tail_begin * 4, tail * 4, "the parameters");
    mesh_->all_reduce_sum(last.data(), tail);
    device_blocks_[0]->copy_from_host(reinterpret_cast<const uint8_t*>(last.data()), tail_begin * 4, tail * 4,
                                      "the parameters");
  }
}

void Model::adamw_moments(int i, std::vector<float>& m, std::vector<float>& v) const {
  if (i < 0 || i >= spec_.num_params) throw Error("error: adamw_moments: no parameter " + std::to_string(i) + ".");
  const size_t k = static_cast<size_t>(i);
  const int64_t numel = spec_.params[i].numel;
  if (host_adamw_) {
    m = host_adamw_->m(k);
    v = host_adamw_->v(k);
  } else if (device_adamw_ && zero_) {
    // Each rank its runs, zeros elsewhere: x + 0 is exact, so the sum over
    // the mesh assembles them (a collective: every rank asks alike).
    std::vector<float> mv(static_cast<size_t>(2 * numel), 0.f);
    const DeviceAdamW& d = *device_adamw_;
    for (const ZeroSlice::Segment& s : d.segments) {
      if (s.param != k) continue;
      const int64_t at = s.begin - flat_offset(i), from = (s.begin - d.slice.begin) * 4, bytes = (s.end - s.begin) * 4;
      d.m->copy_to_host(reinterpret_cast<uint8_t*>(mv.data() + at), from, bytes, "the AdamW moments");
      d.v->copy_to_host(reinterpret_cast<uint8_t*>(mv.data() + numel + at), from, bytes, "the AdamW moments");
    }
    mesh_->all_reduce_sum(mv.data(), 2 * numel);
    m.assign(mv.begin(), mv.begin() + numel);
    v.assign(mv.begin() + numel, mv.end());
  } else if (device_adamw_) {
    m.resize(static_cast<size_t>(numel));
    v.resize(static_cast<size_t>(numel));
    device_adamw_->m->copy_to_host(reinterpret_cast<uint8_t*>(m.data()), offsets_[k], numel * 4, "the AdamW moments");
    device_adamw_->v->copy_to_host(reinterpret_cast<uint8_t*>(v.data()), offsets_[k], numel * 4, "the AdamW moments");
  } else if (!pending_m_.empty()) {
    m = pending_m_[k];
    v = pending_v_[k];
  } else {
    m.assign(static_cast<size_t>(numel), 0.f);
    v.assign(static_cast<size_t>(numel), 0.f);
  }
}

void Model::set_adamw_moments(int i, const std::vector<float>& m, const std::vector<float>& v) {
  if (i < 0 || i >= spec_.num_params) throw Error("error: set_adamw_moments: no parameter " + std::to_string(i) + ".");
  const size_t k = static_cast<size_t>(i);
  const int64_t numel = spec_.params[i].numel;
  if (static_cast<int64_t>(m.size()) != numel || static_cast<int64_t>(v.size()) != numel)
    throw Error("error: set_adamw_moments: parameter \"" + std::string(spec_.params[i].name) + "\" has " +
                std::to_string(numel) + " elements, the moments given " + std::to_string(m.size()) + " and " +
                std::to_string(v.size()) + ".");
  if (host_adamw_) {
    host_adamw_->m(k) = m;
    host_adamw_->v(k) = v;
  } else if (device_adamw_) {  // (under ZeRO-1 this rank's runs)
    const DeviceAdamW& d = *device_adamw_;
    for (const ZeroSlice::Segment& s : d.segments) {
      if (s.param != k) continue;
      const int64_t at = s.begin - flat_offset(i), to = (s.begin - d.slice.begin) * 4, bytes = (s.end - s.begin) * 4;
      d.m->copy_from_host(reinterpret_cast<const uint8_t*>(m.data() + at), to, bytes, "the AdamW moments");
      d.v->copy_from_host(reinterpret_cast<const uint8_t*>(v.data() + at), to, bytes, "the AdamW moments");
    }
  } else if (device_update_) {
    if (pending_m_.empty())
      for (int p = 0; p < spec_.num_params; ++p) {
        pending_m_.emplace_back(static_cast<size_t>(spec_.params[p].numel), 0.f);
        pending_v_.emplace_back(static_cast<size_t>(spec_.params[p].numel), 0.f);
      }
    pending_m_[k] = m;
    pending_v_[k] = v;
  } else {
    throw Error("error: set_adamw_moments before use_adamw.\nfix: call use_adamw(decay) first.");
  }
}

Model::Bound& Model::bind(const ProgramSpec& p, const int32_t* const inputs[4]) {
  std::unique_ptr<Bound>& slot = &p == &spec_.train ? train_bufs_ : forward_bufs_;
  if (slot) return *slot;
  auto fresh = std::make_unique<Bound>();
  Bound& b = *fresh;
  std::vector<halide_buffer_t>& bufs = b.bufs;
  std::vector<halide_dimension_t>& dims = b.dims;
  bufs.resize(static_cast<size_t>(p.num_buffers));
  std::vector<std::pair<int, int64_t>> place(static_cast<size_t>(p.num_buffers), {-1, 0});
  dims.resize(static_cast<size_t>(p.num_buffers * kMaxRank));
  for (int i = 0; i < p.num_buffers; ++i) {
    const BufferSpec& s = p.buffers[i];
    halide_buffer_t& hb = bufs[static_cast<size_t>(i)];
    hb = halide_buffer_t{};
    hb.type = halide_type_of(s.type);
    hb.dimensions = s.rank;
    hb.dim = &dims[static_cast<size_t>(i * kMaxRank)];
    // Strides are 32-bit in halide_dimension_t (the generator refused any
    // that overflow); a dimension of one element is never stepped, so its
    // stride may be clamped.
    int64_t stride = 1;
    for (int d = 0; d < s.rank; ++d) {  // innermost first
      const int64_t extent = s.shape[s.rank - 1 - d];
      if (extent > 1 && (stride > INT32_MAX || extent > INT32_MAX))
        throw Error("error: buffer \"" + std::string(s.name) + "\" has a dimension of " + std::to_string(extent) +
                    " elements, " + std::to_string(stride) + " apart: beyond a Halide buffer's 32-bit strides.\n"
                    "fix: rebuild the library with halyard_aot, which refuses such a tensor and says how to split it.");
      hb.dim[d] = halide_dimension_t(0, static_cast<int32_t>(extent), static_cast<int32_t>(std::min<int64_t>(stride, INT32_MAX)));
      stride *= extent;
    }
    // Where its device memory lies: which of the executor's blocks
    // (device_blocks_: parameters, gradients, tokens, arena), at what offset.
    auto& [block, at] = place[static_cast<size_t>(i)];
    if (s.storage == Storage::View) {  // a tile: the rows of an earlier buffer, with its strides
      const halide_buffer_t& of = bufs[static_cast<size_t>(s.index)];
      const int d = s.rank - 1 - s.dim;
      for (int k = 0; k < s.rank; ++k) hb.dim[k].stride = of.dim[k].stride;
      const int64_t rows = s.offset * of.dim[d].stride * of.type.bytes();
      hb.host = of.host + rows;
      block = place[static_cast<size_t>(s.index)].first;
      at = place[static_cast<size_t>(s.index)].second + rows;
      continue;
    }
    switch (s.storage) {
      case Storage::Input:
        hb.host = reinterpret_cast<uint8_t*>(const_cast<int32_t*>(inputs[s.index]));
        block = 2, at = hb.host - tokens_.get();
        break;
      case Storage::Param:
      case Storage::Grad:
        block = s.storage == Storage::Param ? 0 : 1, at = offsets_[static_cast<size_t>(s.index)];
        hb.host = (s.storage == Storage::Param ? params_ : grads_).get() + at;
        break;
      case Storage::Arena:  // an offloaded value's host copy is not in the arena (step_program.h)
        hb.host = s.host_offset >= 0 ? offload_.get() + s.host_offset : arena_.get() + s.offset;
        block = 3, at = s.offset;
        break;
      case Storage::View: break;
    }
  }
  // A GPU step's device memory: the executor's blocks, made on the first
  // step (not at construction: a CUDA library picks its device when its
  // first kernel runs, cuda_context.h), and every buffer an alias into them.
  b.aliased.assign(bufs.size(), false);
  if (gpu_ && device_blocks_.empty()) {
    // Without a device Halide's CUDA runtime would report it from inside a
    // kernel call, and its default handler aborts.
    if (cuda_ && !runtime_cuda_context().context)
      throw Error("error: model \"" + std::string(spec_.name) + "\" is a CUDA library (" + spec_.target +
                  "), and this process has no CUDA device: " + runtime_cuda_context().error +
                  ".\nfix: run it where an NVIDIA GPU and its driver are (nvidia-smi lists it), or build the "
                  "model for the CPU (halyard_add_model without TARGET).");
    if (const halide_device_interface_t* device = device_interface_of(spec_.target)) {
      // Halide's own temporaries come from its pool, not a cudaMalloc per step.
      halide_reuse_device_allocations(nullptr, true);
      for (int64_t bytes : {flat_size_ * 4, flat_size_ * 4, 4 * token_slot_bytes(), round_up(arena_bytes_)})
        device_blocks_.push_back(std::make_unique<DeviceBlock>(device, bytes));
      if (cuda_) pin_host_blocks();
    }
  }
  for (size_t i = 0; i < bufs.size() && !device_blocks_.empty(); ++i)  // (a tile's rows may start off OpenCL's alignment: then a copy)
    b.aliased[i] = device_blocks_[static_cast<size_t>(place[i].first)]->alias(bufs[i], place[i].second, kAlign);
  b.windows = copy_windows(p);
  slot = std::move(fresh);
  return *slot;
}

void Model::release_device(Bound* b, bool aliases) {
  if (!b) return;
  for (size_t i = 0; i < b->bufs.size(); ++i) {
    halide_buffer_t& hb = b->bufs[i];
    if (!hb.device) continue;
    if (b->aliased[i]) {
      if (aliases) release_alias(hb);
      continue;
    }
    halide_device_free(nullptr, &hb);
    ++times_.device_buffers_freed;
  }
}

int64_t Model::token_slot_bytes() const { return round_up(tokens() * static_cast<int64_t>(sizeof(int32_t))); }

void Model::pin_host_blocks() {
  if (const char* e = std::getenv("HALYARD_PIN_HOST"); e && std::string_view(e) == "0") return;
  const int64_t offload_bytes = std::max(spec_.train.offload_bytes, spec_.forward.offload_bytes);
  const std::pair<uint8_t*, int64_t> blocks[] = {{params_.get(), flat_size_ * 4}, {grads_.get(), flat_size_ * 4},
                                                 {tokens_.get(), 4 * token_slot_bytes()}, {arena_.get(), arena_bytes_},
                                                 {offload_.get(), offload_bytes}};
  for (const auto& [p, bytes] : blocks) {
    if (bytes <= 0) continue;
    auto pin = std::make_unique<PinnedHost>(p, static_cast<size_t>(bytes));
    if (p == offload_.get() && pin->error().empty()) {  // asynchronous copies need pinned host memory
      auto stream = std::make_unique<CudaCopyStream>();
      if (stream->error().empty()) copy_stream_ = std::move(stream);
    }
    if (!pin->error().empty()) {
      static std::once_flag said;
      std::call_once(said, [&] {
        std::fprintf(stderr, "warning: model \"%s\": host memory stays pageable, so copies to and from the device "
                     "run slower: %s\n", spec_.name, pin->error().c_str());
      });
      continue;
    }
    pinned_.push_back(std::move(pin));
  }
}

int64_t Model::pinned_host_bytes() const {
  int64_t n = 0;
  for (const auto& p : pinned_) n += static_cast<int64_t>(p->bytes());
  return n;
}

Model::~Model() {
  if (!pinned_.empty()) device_blocks_.front()->sync();  // no copy may still read or write the blocks (errors: freed anyway)
  device_adamw_.reset();  // its aliases, before the blocks they alias
  release_device(train_bufs_.get(), true);
  release_device(forward_bufs_.get(), true);
}

// A step's offload copies inside their windows (offload_windows.h) instead
// of at their calls: on the communication stream (a CUDA step whose host
// copies are pinned), each starting after the calls before its window, the
// call its window closes on waiting for it; or, to check the windows on any
// device, synchronously at their far edges, in the order one stream would
// take them: each offload only once a later call needs it done, each reload
// as soon as its window opens (with every copy queued before it).
struct Model::WindowedCopies {
  Model& m;
  const ProgramSpec& p;
  Bound& b;
  bool at_edges;
  bool active;  // the step has offload copies, and a stream or the edges to run them (else they run at their calls)
  std::vector<int> queued;  // at the edges: windows, in queue order
  std::vector<int> ticket;  // on the stream: each window's copy, or -1

  WindowedCopies(Model& model, const ProgramSpec& prog, Bound& bound)
      : m(model), p(prog), b(bound), at_edges(model.copies_at_edges_),
        active(model.gpu_ && !bound.windows.empty() && (at_edges || model.copy_stream_)),
        ticket(bound.windows.size(), -1) {
    if (active && !at_edges) m.copy_stream_->reset();  // (a failed step may have left copies)
  }

  // Before call c starts; c == num_calls: the step's end, after which the
  // host copies are whole (the next step writes them again).
  void before(int c) {
    for (size_t k = 0; k < b.windows.size(); ++k)
      if (b.windows[k].finish == c) done_before(k);
    for (size_t k = 0; k < b.windows.size(); ++k)
      if (b.windows[k].start == c) start(k);
    if (c == p.num_calls && !at_edges) m.copy_stream_->reset();
  }

 private:
  void done_before(size_t k) {
    if (!at_edges) {
      if (ticket[k] >= 0) m.copy_stream_->compute_waits(ticket[k]);
      return;
    }
    const auto it = std::find(queued.begin(), queued.end(), static_cast<int>(k));
    if (it == queued.end()) return;
    const std::vector<int> now(queued.begin(), it + 1);
    queued.erase(queued.begin(), it + 1);
    for (int w : now) m.offload(p.calls[b.windows[static_cast<size_t>(w)].call], p, b.bufs.data());
  }

  void start(size_t k) {
    const CallSpec& copy = p.calls[b.windows[k].call];
    if (at_edges) {
      queued.push_back(static_cast<int>(k));
      if (copy.kind == CallKind::Reload) done_before(k);
      return;
    }
    halide_buffer_t& hb = b.bufs[static_cast<size_t>(copy.args[0])];
    if (!hb.device) return;
    const size_t bytes = hb.size_in_bytes();
    if (copy.kind == CallKind::Offload) {
      ticket[k] = m.copy_stream_->copy_to_host(hb.host, hb.device, bytes);
      hb.flags &= ~static_cast<uint64_t>(halide_buffer_flag_device_dirty);
      m.times_.offloaded_bytes += static_cast<int64_t>(bytes);
    } else {
      ticket[k] = m.copy_stream_->copy_to_device(hb.device, hb.host, bytes);
      hb.flags &= ~static_cast<uint64_t>(halide_buffer_flag_host_dirty);
    }
  }
};

double Model::run(const ProgramSpec& p, const int32_t* const caller_inputs[4]) {
  // The caller's token arrays need not be aligned; copy them (they are small).
  const int32_t* inputs[4];
  for (int k = 0; k < 4; ++k) {
    auto* dst = reinterpret_cast<int32_t*>(tokens_.get() + k * token_slot_bytes());
    std::memcpy(dst, caller_inputs[k], static_cast<size_t>(tokens()) * sizeof(int32_t));
    inputs[k] = dst;
  }
  Bound& bound = bind(p, inputs);
  std::vector<halide_buffer_t>& bufs = bound.bufs;
  // A GPU step reads the tokens anew: Halide uploads a buffer only when it
  // is host-dirty, also the first time. The parameters go up when the host
  // wrote them (all at once into their block; without the executor's blocks,
  // each buffer by Halide, every step). Every other device buffer keeps what
  // the last step left.
  times_ = StepTimes{};
  if (gpu_) {
    if (!device_blocks_.empty()) {
      if (!device_update_) params_at_ = Current::Host;  // the host's optimizer may have written through kept pointers
      upload_if_host_newer(0, params_at_, times_.host_to_device_copies);
    }
    for (int b = 0; b < p.num_buffers; ++b) {
      const Storage st = p.buffers[b].storage;
      if (st == Storage::Input || (st == Storage::Param && device_blocks_.empty())) {
        bufs[static_cast<size_t>(b)].flags |= halide_buffer_flag_host_dirty;
        ++times_.host_to_device_copies;
      }
    }
  }
  const bool profile = std::getenv("HALYARD_PROFILE") != nullptr;
  const bool timed = kernel_times_on_device_ && !device_blocks_.empty();
  if (profile) {
    static std::once_flag once;
    std::call_once(once, [] {
      halide_set_custom_malloc(counting_malloc);
      halide_set_custom_free(counting_free);
    });
  }
  std::ostringstream prof;
  exchanges_.clear();  // left by a step that failed
  device_in_flight_.clear();
  // Eval and training alternate rarely: the other program's device buffers
  // go (those Halide allocated; both programs alias the same blocks).
  release_device(&p == &spec_.train ? forward_bufs_.get() : train_bufs_.get(), false);
  const auto step_start = std::chrono::steady_clock::now();
  auto since = [](std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<void*> argv;
  bool sum_grads = false;
  auto ms = [](double s) { return s * 1e3; };
  // Communication by kind (StepTimes), and the collectives in flight on the
  // communication thread, by output buffer.
  auto time_of = [&](CallKind k) -> CommTime& {
    return k == CallKind::RingShift ? times_.ring
           : k == CallKind::SeqToHeads || k == CallKind::HeadsToSeq ? times_.all_to_all
                                                                      : times_.other;
  };
  struct InFlight {
    std::future<double> done;
    CommTime* time;
  };
  std::map<int, InFlight> in_flight;
  std::vector<std::future<double>> grad_sums;
  auto finish = [&](std::future<double>& done, CommTime& t) {
    const auto t0 = std::chrono::steady_clock::now();
    const double busy = done.get();  // rethrows the collective's error
    t.waited_s += since(t0);
    t.busy_s += busy;
  };
  // Whatever happens, nothing is left running on the step's buffers.
  struct Drain {
    std::map<int, InFlight>& a;
    std::vector<std::future<double>>& b;
    ~Drain() {
      for (auto& [k, f] : a)
        if (f.done.valid()) f.done.wait();
      for (auto& f : b)
        if (f.valid()) f.wait();
    }
  } drain{in_flight, grad_sums};
  const bool bg = background();
  // The collectives the program finishes later (a Wait on their output) run
  // on until then; the others are waited for where they stand.
  std::vector<bool> waited(static_cast<size_t>(p.num_buffers), false);
  for (int c = 0; c < p.num_calls; ++c)
    if (p.calls[c].kind == CallKind::Wait) waited[static_cast<size_t>(p.calls[c].args[1])] = true;
  // The gradient sums, bucket by bucket from the last parameter down (the
  // backward finishes them roughly in that order), each started once all of
  // its gradients are final: on the host on the communication thread (a GPU
  // step over MPI brings its gradients home at the end instead), or over
  // NCCL on the device, queued behind the kernels that finish them (f32; a
  // bf16 sum runs whole at the end).
  const bool sums_at_end = &p == &spec_.train && reduce_grads_ && mesh_ && p.num_calls > 0 &&
                          p.calls[p.num_calls - 1].kind == CallKind::AllReduceGrads;
  const bool grads_on_device = device_collectives_ && overlap_ && !reduce_grads_bf16_ && sums_at_end;
  const bool grads_in_background = (bg && !gpu_ && sums_at_end) || grads_on_device;
  std::vector<std::unique_ptr<Exchange>> device_sums;
  std::vector<bool> final_grad(static_cast<size_t>(spec_.num_params), false);
  int bucket_lo = spec_.num_params, bucket_hi = spec_.num_params;  // params [lo, hi) final, not yet summed
  auto end_of = [&](int hi) { return hi == spec_.num_params ? flat_size_ : flat_offset(hi); };
  auto sum_bucket = [&](int lo, int hi) {
    const int64_t n = end_of(hi) - flat_offset(lo);
    if (grads_on_device) {
      float* grads = reinterpret_cast<float*>(static_cast<uintptr_t>(device_blocks_.at(1)->handle()));
      device_sums.push_back(mesh_->start_all_reduce_sum(grads + flat_offset(lo), n));
      return;
    }
    float* at = grads_flat() + flat_offset(lo);
    grad_sums.push_back(comm_thread_->submit([this, at, n] { sum_over_mesh(at, n); }));
  };
  WindowedCopies copies(*this, p, bound);  // the offload copies inside their windows, instead of at their calls
  for (int c = 0; c < p.num_calls; ++c) {
    const CallSpec& call = p.calls[c];
    if (copies.active) {
      const auto t0 = std::chrono::steady_clock::now();
      copies.before(c);
      times_.offload_s += since(t0);
      if (call.kind == CallKind::Offload || call.kind == CallKind::Reload) continue;
    }
    if (call.kind == CallKind::AllReduceGrads) {
      if (grads_in_background) {
        if (bucket_hi > 0) sum_bucket(0, bucket_hi);
        bucket_hi = 0;
      } else {
        sum_grads = reduce_grads_ && mesh_;  // after the gradients are home (below)
      }
      continue;
    }
    if (call.kind == CallKind::Wait) {
      const auto t0 = std::chrono::steady_clock::now();
      if (auto it = in_flight.find(call.args[1]); it != in_flight.end()) {
        finish(it->second.done, *it->second.time);
        in_flight.erase(it);
      } else if (finish_device_plan(call.args[1])) {  // an all-to-all on the device: no host wait
        times_.all_to_all.waited_s += since(t0);
      } else if (auto e = exchanges_.find(call.args[1]); e != exchanges_.end()) {  // a ring pass, no thread
        std::unique_ptr<Exchange> x = std::move(e->second);
        exchanges_.erase(e);
        const auto w0 = std::chrono::steady_clock::now();
        // On the device the kernels after it wait for the pass by an event.
        if (device_collectives_) device_staging().join(std::move(x));
        else x->wait();
        const double took = since(w0);
        times_.ring.waited_s += took;
        times_.ring.busy_s += took;
      }
      if (profile) prof << "  " << ms(since(t0)) << " ms  wait " << call.kernel << "  " << call.label << "\n";
      continue;
    }
    if (call.kind == CallKind::Offload || call.kind == CallKind::Reload) {
      const auto t0 = std::chrono::steady_clock::now();
      offload(call, p, bufs.data());
      times_.offload_s += since(t0);
      if (profile) prof << "  " << ms(since(t0)) << " ms  " << call.kernel << "  " << call.label << "\n";
      continue;
    }
    if (call.kind != CallKind::Kernel) {
      const auto t0 = std::chrono::steady_clock::now();
      CommTime& t = time_of(call.kind);
      if (bg && call.kind != CallKind::ConcatSeq) {
        std::future<double> done = comm_thread_->submit([this, &call, &p, b = bufs.data()] { collective(call, p, b); });
        if (waited[static_cast<size_t>(call.args[1])]) in_flight[call.args[1]] = InFlight{std::move(done), &t};
        else finish(done, t);
      } else {
        collective(call, p, bufs.data(), waited[static_cast<size_t>(call.args[1])]);
        const double took = since(t0);
        t.waited_s += took;
        t.busy_s += took;
      }
      if (profile) prof << "  " << ms(since(t0)) << " ms  " << call.kernel << "  " << call.label << "\n";
      continue;
    }
    argv.clear();
    for (int a = 0; a < call.num_args; ++a) {
      halide_buffer_t& hb = bufs[static_cast<size_t>(call.args[a])];
      const BufferSpec& s = p.buffers[call.args[a]];
      if (s.storage == Storage::View && gpu_) {
        halide_buffer_t& of = bufs[static_cast<size_t>(s.index)];
        if (bound.aliased[static_cast<size_t>(call.args[a])]) {  // the view reads its buffer's device memory
          if ((of.flags & halide_buffer_flag_host_dirty) && halide_copy_to_device(nullptr, &of, of.device_interface))
            throw Error("error: model \"" + std::string(spec_.name) + "\": uploading " + p.buffers[s.index].name +
                        " failed; Halide printed the reason above.");
        } else {  // a fresh copy of the rows
          to_host(of);
          hb.flags |= halide_buffer_flag_host_dirty;
        }
      }
      argv.push_back(&hb);
    }
    peak_scratch = live_scratch.load();
    const int64_t scratch_before = live_scratch.load();
    if (timed) wait_for_device("before a timed kernel");  // (what ran before is not this kernel's time)
    const auto t0 = std::chrono::steady_clock::now();
    if (int err = call.fn(argv.data()))
      throw Error("error: kernel " + std::string(call.kernel) + " (" + call.label + ") of model \"" + spec_.name +
                  "\" failed with Halide error " + std::to_string(err) + "; Halide printed the reason above.");
    if (timed) wait_for_device(call.kernel);
    (std::strncmp(call.label, "attention", 9) == 0 ? times_.attention_s : times_.other_kernels_s) += since(t0);
    if (profile)
      prof << "  " << ms(since(t0)) << " ms  " << call.kernel << "  " << call.label << "  scratch "
           << peak_scratch.load() - scratch_before << "\n";
    if (grads_in_background) {
      for (int i : grads_final_after_[static_cast<size_t>(c)]) final_grad[static_cast<size_t>(i)] = true;
      while (bucket_lo > 0 && final_grad[static_cast<size_t>(bucket_lo - 1)]) --bucket_lo;
      const int64_t bytes = (end_of(bucket_hi) - flat_offset(bucket_lo)) * static_cast<int64_t>(sizeof(float));
      if (bucket_lo < bucket_hi && (bucket_lo == 0 || bytes >= kGradBucketBytes)) {
        sum_bucket(bucket_lo, bucket_hi);
        bucket_hi = bucket_lo;
      }
    }
  }
  if (!device_in_flight_.empty())
    throw Error("error: model \"" + std::string(spec_.name) + "\": a collective of its step was started and never "
                "waited for.\nfix: regenerate the library with this version of Halyard.");
  // The transfers in the background first, each with its timeout: what
  // follows synchronizes the streams they run on.
  settle_device_collectives();
  for (auto& s : device_sums) {
    const auto t0 = std::chrono::steady_clock::now();
    s->wait();
    times_.grads.waited_s += since(t0);
  }
  if (copies.active) copies.before(p.num_calls);
  for (auto& f : grad_sums) finish(f, times_.grads);
  if (profile && !device_sums.empty())
    prof << "  all_reduce_grads on the device: " << device_sums.size() << " buckets in the background\n";
  auto timed_sum = [&](float* grads, const char* where) {
    const auto t0 = std::chrono::steady_clock::now();
    sum_over_mesh(grads, flat_size_);
    const double took = since(t0);
    times_.grads.waited_s += took;
    times_.grads.busy_s += took;
    if (profile) prof << "  " << ms(took) << " ms  all_reduce_grads  " << flat_size_ << " floats " << where << "\n";
  };
  // Over NCCL the gradients are summed where the kernels left them.
  if (sum_grads && device_collectives_) {
    timed_sum(reinterpret_cast<float*>(static_cast<uintptr_t>(device_blocks_.at(1)->handle())), "on the device");
    sum_grads = false;
  }
  // GPU kernels leave results on the device: the loss comes home, and the
  // gradients when the host sums them over the mesh (or without the
  // executor's blocks); otherwise they stay until the update reads them
  // there, or the host asks (grad()). Activations stay for the next step.
  const bool grads_home = sum_grads || device_blocks_.empty() || !device_update_;
  for (int b = 0; b < p.num_buffers; ++b)
    if (b == p.loss || (grads_home && p.buffers[b].storage == Storage::Grad)) to_host(bufs[static_cast<size_t>(b)]);
  if (&p == &spec_.train) {
    have_grads_ = true;
    grads_at_ = gpu_ && !grads_home ? Current::Device : Current::Host;
  }
  if (sum_grads) timed_sum(grads_flat(), "on the host");
  profile_ = prof.str();
  times_.total_s = since(step_start);
  const BufferSpec& loss = p.buffers[p.loss];
  return loss.type == ElemType::F64 ? *reinterpret_cast<const double*>(bufs[static_cast<size_t>(p.loss)].host)
                                    : *reinterpret_cast<const float*>(bufs[static_cast<size_t>(p.loss)].host);
}

}  // namespace halyard::runtime
