// The launcher of the CUDA attention kernels (attention_cuda.h): loads their
// fatbin (embedded at build time, cuda_fatbin.cpp.in) into the
// runtime's context once, and maps Halide's buffers onto the kernels' Args.
#include "runtime/attention_cuda.h"

#include <HalideRuntime.h>
#include <HalideRuntimeCuda.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "runtime/attention_cpu.h"
#include "runtime/cuda_context.h"
#include "runtime/cuda_driver.h"

#pragma weak halide_cuda_device_interface

#ifdef HALYARD_ATTENTION_FATBIN
extern "C" const unsigned char halyard_attention_fatbin[];
#endif

namespace halyard::runtime::attention_cuda {
namespace {

using attention_cpu::RingIndices;

constexpr int kRows = 64;  // rows per block (Shape<D>::R in attention_cuda.cu)

int fail(const std::string& why) {
  halide_error(nullptr, (why + "\n").c_str());
  return -1;
}

// The kernel a head_dim runs in: the least padded head_dim that holds it
// (of the bf16 kernels' where bf16).
int padded(int head_dim, bool bf16) {
  auto least = [head_dim](const auto& dims) {
    for (int d : dims)
      if (head_dim >= 1 && head_dim <= d) return d;
    return -1;
  };
  return bf16 ? least(kBf16HeadDims) : least(kPaddedHeadDims);
}

std::string kernel_name(const char* what, int head_dim, bool bf16) {
  return std::string("halyard_attention_") + what + (bf16 ? "_bf16_" : "_") + std::to_string(padded(head_dim, bf16));
}

// Threads per block: the f32 kernels' rows take head_dim / 32 threads each
// from 64; the bf16 ones are 4 warps.
unsigned threads_for(int head_dim, bool bf16) {
  const int p = padded(head_dim, false);
  return bf16 ? 128u : static_cast<unsigned>(kRows * (p > 32 ? p / 32 : 1));
}

// The functions of the loaded fatbin, by kernel name.
struct Kernels {
  std::string error;
  std::vector<std::pair<std::string, void*>> functions;
  void* find(const std::string& name) const {
    for (const auto& [n, f] : functions)
      if (n == name) return f;
    return nullptr;
  }
};

const Kernels& kernels() {
  static const Kernels k = [] {
    Kernels out;
#ifndef HALYARD_ATTENTION_FATBIN
    out.error = "this runtime was built without nvcc, so it has no CUDA attention kernels (rebuild where the CUDA "
                "toolkit is installed, or choose \"attention_kernel\": \"halide\" in the schedule)";
    return out;
#else
    std::vector<std::string> names;
    auto add = [&](const auto& dims, bool bf16) {
      for (int d : dims)
        for (const char* what : {"fwd", "dq", "dkdv"}) names.push_back(kernel_name(what, d, bf16));
    };
    add(kPaddedHeadDims, false);
    add(kBf16HeadDims, true);
    const CudaKernels loaded = load_cuda_kernels(halyard_attention_fatbin, names, "the CUDA attention kernels");
    for (size_t i = 0; i < names.size(); ++i) out.functions.emplace_back(names[i], loaded.functions[i]);
    out.error = loaded.error;
    return out;
#endif
  }();
  return k;
}

// The address of element (0, 0, 0, b0) of x, counted from its dims' mins.
template <class T>
T* origin(const halide_buffer_t* x, int b0) {
  int64_t off = 0;
  const int last = x->dimensions - 1;
  for (int d = 0; d < x->dimensions; ++d) off -= static_cast<int64_t>(x->dim[d].min) * x->dim[d].stride;
  off += static_cast<int64_t>(b0) * x->dim[last].stride;
  return reinterpret_cast<T*>(static_cast<uintptr_t>(x->device) + static_cast<uintptr_t>(off * x->type.bytes()));
}

// An operand's element (0, 0, 0, b0), f32 or bf16 as its 16 bits.
Operand operand(const halide_buffer_t* x, int b0) { return {origin<const void>(x, b0), attention_cpu::holds_bf16(x)}; }

// Whether q, k, v (and O) are each f32 or bf16 as its 16 bits, and dO
// (where given) f32.
std::string check_operands(std::initializer_list<const halide_buffer_t*> xs, const halide_buffer_t* dO = nullptr) {
  for (const halide_buffer_t* x : xs)
    if (!attention_cpu::holds_f32(x) && !attention_cpu::holds_bf16(x))
      return "q, k, v and O must be f32, or bf16 as its 16 bits (uint16)";
  if (dO && !attention_cpu::holds_f32(dO)) return "dO must be f32";
  return "";
}

Strides rows(const halide_buffer_t* x) {  // [head_dim, heads, seq, batch]
  return {x->dim[1].stride, x->dim[2].stride, x->dim[3].stride};
}
Strides stats(const halide_buffer_t* x) {  // [heads, seq, batch]
  return {x->dim[0].stride, x->dim[1].stride, x->dim[2].stride};
}

bool covers(const halide_buffer_t* x, int d, int min, int extent) {
  return x->dim[d].min <= min && x->dim[d].min + x->dim[d].extent >= min + extent;
}

std::string check(int heads, int kv_heads, int head_dim, int S) {
  if (padded(head_dim, false) < 0)
    return "head_dim " + std::to_string(head_dim) + " is over the " + std::to_string(kMaxHeadDim) +
           " the CUDA kernels hold; choose \"attention_kernel\": \"halide\" in the schedule";
  if (kv_heads < 1 || heads % kv_heads) return "kv_heads must divide heads";
  if (S < 1) return "no rows";
  return "";
}

// Inputs the host wrote last go up (one without device memory is the host's
// alone, marked or not); outputs get device memory.
int to_device(std::initializer_list<halide_buffer_t*> inputs, const std::vector<halide_buffer_t*>& outputs) {
  if (!halide_cuda_device_interface) return fail("halyard attention (CUDA): this program has no Halide CUDA runtime");
  const halide_device_interface_t* cuda = halide_cuda_device_interface();
  for (halide_buffer_t* x : inputs) {
    if (!x) continue;  // (a plain block's ring indices)
    if (!x->device) {
      if (!x->host) return fail("halyard attention (CUDA): an operand has neither host nor device memory");
      x->set_host_dirty(true);
    }
    if (x->host_dirty())
      if (int err = halide_copy_to_device(nullptr, x, cuda))
        return fail("halyard attention (CUDA): uploading an operand failed with Halide error " + std::to_string(err));
  }
  for (halide_buffer_t* x : outputs)
    if (!x->device)
      if (int err = halide_device_malloc(nullptr, x, cuda))
        return fail("halyard attention (CUDA): device memory for an output failed with Halide error " +
                    std::to_string(err));
  return 0;
}

// Runs the launches on the runtime's compute stream, then marks the outputs
// as newer on the device.
int run(const char* who, std::vector<Launch>& launches, const std::vector<halide_buffer_t*>& outputs) {
  const Kernels& k = kernels();
  const RuntimeCudaContext& ctx = runtime_cuda_context();
  const CudaDriver& drv = cuda_driver();
  drv.ctx_push(ctx.context);
  int rc = 0;
  for (Launch& l : launches) {
    void* params[] = {&l.args};
    rc = drv.launch_kernel(k.find(l.kernel), l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, 0, ctx.stream, params,
                           nullptr);
    if (rc != 0) break;
  }
  void* popped = nullptr;
  drv.ctx_pop(&popped);
  if (rc != 0) return fail(std::string(who) + ": cuLaunchKernel failed: " + drv.text(rc));
  for (halide_buffer_t* x : outputs) {
    x->set_host_dirty(false);
    x->set_device_dirty(true);
  }
  return 0;
}

// An entry point's call after its bounds query: checks, uploads, plans the
// launches (plan_launches(&launches) returns an error or ""), launches.
template <class PlanLaunches>
int call(const char* who, int heads, int kv_heads, int D, int S, std::initializer_list<halide_buffer_t*> inputs,
         const std::vector<halide_buffer_t*>& outputs, PlanLaunches plan_launches) {
  if (const std::string e = check(heads, kv_heads, D, S); !e.empty()) return fail(std::string(who) + ": " + e);
  if (!kernels().error.empty()) return fail(std::string(who) + ": " + kernels().error);
  if (int err = to_device(inputs, outputs)) return err;
  std::vector<Launch> launches;
  if (const std::string e = plan_launches(&launches); !e.empty()) return fail(std::string(who) + ": " + e);
  return run(who, launches, outputs);
}

int forward(const char* who, halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
            RingIndices idx, halide_buffer_t* lse, int heads, int kv_heads, int D, int bf16, halide_buffer_t* out) {
  if (out->is_bounds_query())
    return attention_cpu::ask_whole_rows(q, k, v, pos, heads, kv_heads, D, out, nullptr, nullptr, nullptr, idx);
  return call(who, heads, kv_heads, D, out->dim[2].extent, {q, k, v, pos, idx.kidx, idx.qidx},
              lse ? std::vector<halide_buffer_t*>{out, lse} : std::vector<halide_buffer_t*>{out},
              [&](std::vector<Launch>* launches) {
                return forward_launches(q, k, v, pos, lse, heads, kv_heads, D, bf16 != 0, out, launches, idx);
              });
}

int lse_alone(const char* who, halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* pos, RingIndices idx,
              int heads, int kv_heads, int D, int bf16, halide_buffer_t* out) {
  if (out->is_bounds_query())
    return attention_cpu::ask_whole_rows(q, k, nullptr, pos, heads, kv_heads, D, out, nullptr, nullptr, nullptr, idx);
  return call(who, heads, kv_heads, D, out->dim[1].extent, {q, k, pos, idx.kidx, idx.qidx}, {out},
              [&](std::vector<Launch>* launches) {
                return lse_launches(q, k, pos, heads, kv_heads, D, bf16 != 0, out, launches, idx);
              });
}

int backward(const char* who, halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
             halide_buffer_t* o, halide_buffer_t* dO, halide_buffer_t* lse, RingIndices idx, halide_buffer_t* dq_sum,
             halide_buffer_t* dv, halide_buffer_t* dq, int heads, int kv_heads, int bf16, halide_buffer_t* out) {
  const int D = out->dim[0].extent;
  if (out->is_bounds_query())
    return attention_cpu::ask_whole_rows(q, k, v, pos, heads, kv_heads, D, out, o, dO, lse, idx, dq_sum);
  return call(who, heads, kv_heads, D, out->dim[2].extent, {q, k, v, pos, o, dO, lse, idx.kidx, idx.qidx, dq_sum},
              {out, dv, dq}, [&](std::vector<Launch>* launches) {
                return backward_launches(q, k, v, pos, o, dO, lse, dv, dq, heads, kv_heads, bf16 != 0, out, launches,
                                         idx, dq_sum);
              });
}

}  // namespace

bool supports_head_dim(int head_dim) { return padded(head_dim, false) >= 0; }

std::string why_unusable() { return kernels().error; }

namespace {

// What every launch of a call shares: the operands, the sizes, and a grid
// over row blocks and the nb batch rows from b0.
Launch common(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos, RingIndices idx,
              int heads, int kv_heads, int D, bool bf16, int S, int b0, int nb) {
  Launch l;
  Args& a = l.args;
  a.q = operand(q, b0), a.k = operand(k, b0), a.v = operand(v, b0);
  a.pos = origin<const int32_t>(pos, b0);
  a.pos_s = pos->dim[0].stride, a.pos_b = pos->dim[1].stride;
  if (idx.kidx) {
    a.kidx = origin<const int32_t>(idx.kidx, b0), a.qidx = origin<const int32_t>(idx.qidx, b0);
    a.kidx_s = idx.kidx->dim[0].stride, a.kidx_b = idx.kidx->dim[1].stride;
    a.qidx_s = idx.qidx->dim[0].stride, a.qidx_b = idx.qidx->dim[1].stride;
  }
  a.q_st = rows(q), a.k_st = rows(k), a.v_st = rows(v);
  a.S = S, a.H = heads, a.KV = kv_heads, a.D = D;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  l.grid[0] = static_cast<unsigned>((S + kRows - 1) / kRows);
  l.grid[2] = static_cast<unsigned>(nb);
  l.threads = threads_for(D, bf16);
  return l;
}

// The same with the output (the forward's, or dK) [head_dim, heads, seq, batch].
Launch common(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos, RingIndices idx,
              int heads, int kv_heads, int D, bool bf16, halide_buffer_t* out) {
  const int b0 = out->dim[3].min;
  Launch l = common(q, k, v, pos, idx, heads, kv_heads, D, bf16, out->dim[2].extent, b0, out->dim[3].extent);
  l.args.out = origin<float>(out, b0), l.args.out_st = rows(out);
  return l;
}

// A ring block's indices, where given, cover the call's rows.
std::string check_indices(RingIndices idx, int S, int b0, int nb) {
  if (!idx.kidx && !idx.qidx) return "";
  for (const halide_buffer_t* x : {idx.kidx, idx.qidx})
    if (!x || x->dimensions != 2 || x->type.bits != 32 || !covers(x, 0, 0, S) || !covers(x, 1, b0, nb))
      return "a ring block's key and query indices must both be int32 [seq, batch] covering the rows";
  return "";
}

}  // namespace

std::string forward_launches(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                             halide_buffer_t* lse, int heads, int kv_heads, int D, bool bf16, halide_buffer_t* out,
                             std::vector<Launch>* launches, RingIndices idx) {
  const int S = out->dim[2].extent, b0 = out->dim[3].min, nb = out->dim[3].extent;
  if (std::string e = check(heads, kv_heads, D, S); !e.empty()) return e;
  if (std::string e = check_indices(idx, S, b0, nb); !e.empty()) return e;
  if (out->dim[0].min != 0 || out->dim[0].extent != D || out->dim[2].min != 0) return "rows must be whole";
  for (const halide_buffer_t* x : {q, k, v, out})
    if (x->dim[0].stride != 1) return "head_dim must be dense";
  if (std::string e = check_operands({q, k, v}); !e.empty()) return e;
  if (lse && (!covers(lse, 0, out->dim[1].min, out->dim[1].extent) || !covers(lse, 1, 0, S) || !covers(lse, 2, b0, nb)))
    return "the log-sum-exp must cover the output's heads and rows";
  Launch l = common(q, k, v, pos, idx, heads, kv_heads, D, bf16, out);
  Args& a = l.args;
  if (lse) a.lse_out = origin<float>(lse, b0), a.lse_out_st = stats(lse);
  a.h0 = out->dim[1].min;
  l.kernel = kernel_name("fwd", D, bf16);
  l.grid[1] = static_cast<unsigned>(out->dim[1].extent);
  launches->assign(1, l);
  return "";
}

// The forward's kernel without an output, which reads no v (given k's
// pointer, which it never follows).
std::string lse_launches(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* pos, int heads, int kv_heads, int D,
                         bool bf16, halide_buffer_t* lse, std::vector<Launch>* launches,
                         RingIndices idx) {
  const int S = lse->dim[1].extent, b0 = lse->dim[2].min;
  if (std::string e = check(heads, kv_heads, D, S); !e.empty()) return e;
  if (std::string e = check_indices(idx, S, b0, lse->dim[2].extent); !e.empty()) return e;
  if (lse->dim[1].min != 0) return "rows must be whole";
  for (const halide_buffer_t* x : {q, k})
    if (x->dim[0].stride != 1) return "head_dim must be dense";
  if (std::string e = check_operands({q, k}); !e.empty()) return e;
  Launch l = common(q, k, k, pos, idx, heads, kv_heads, D, bf16, S, b0, lse->dim[2].extent);
  l.args.lse_out = origin<float>(lse, b0), l.args.lse_out_st = stats(lse);
  l.args.h0 = lse->dim[0].min;
  l.kernel = kernel_name("fwd", D, bf16);
  l.grid[1] = static_cast<unsigned>(lse->dim[0].extent);
  launches->assign(1, l);
  return "";
}

std::string backward_launches(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                              halide_buffer_t* o, halide_buffer_t* dO, halide_buffer_t* lse, halide_buffer_t* dv,
                              halide_buffer_t* dq, int heads, int kv_heads, bool bf16, halide_buffer_t* out,
                              std::vector<Launch>* launches, RingIndices idx, halide_buffer_t* dq_sum) {
  const int D = out->dim[0].extent, S = out->dim[2].extent, b0 = out->dim[3].min, nb = out->dim[3].extent;
  if (std::string e = check(heads, kv_heads, D, S); !e.empty()) return e;
  if (std::string e = check_indices(idx, S, b0, nb); !e.empty()) return e;
  const int grp = heads / kv_heads, g0 = out->dim[1].min, ng = out->dim[1].extent;
  if (out->dim[0].min != 0 || out->dim[2].min != 0) return "rows must be whole";
  for (const halide_buffer_t* x : {q, k, v, o, dO, dv, dq, out})
    if (x->dim[0].stride != 1) return "head_dim must be dense";
  if (std::string e = check_operands({q, k, v, o}, dO); !e.empty()) return e;
  if (!covers(dv, 1, g0, ng) || !covers(dv, 2, 0, S) || !covers(dv, 3, b0, nb) || !covers(dq, 1, g0 * grp, ng * grp) ||
      !covers(dq, 2, 0, S) || !covers(dq, 3, b0, nb))
    return "dV and dQ must cover dK's groups and rows";
  if (dq_sum && (dq_sum->type.code != halide_type_float || dq_sum->type.bits != 32 || dq_sum->dim[0].stride != 1 ||
                 !covers(dq_sum, 1, g0 * grp, ng * grp) || !covers(dq_sum, 2, 0, S) || !covers(dq_sum, 3, b0, nb)))
    return "the dQ sum added to must be f32, head_dim dense, and cover dQ";
  Launch l = common(q, k, v, pos, idx, heads, kv_heads, D, bf16, out);
  Args& a = l.args;
  a.o = operand(o, b0), a.dO = origin<const float>(dO, b0), a.lse = origin<const float>(lse, b0);
  a.o_st = rows(o), a.dO_st = rows(dO), a.lse_st = stats(lse);
  a.dv = origin<float>(dv, b0), a.dv_st = rows(dv);
  a.dq = origin<float>(dq, b0), a.dq_st = rows(dq);
  if (dq_sum) a.dq_in = origin<const float>(dq_sum, b0), a.dq_in_st = rows(dq_sum);
  Launch for_q = l, for_kv = l;  // dQ over the groups' query heads; dK and dV over the kv heads
  for_q.kernel = kernel_name("dq", D, bf16);
  for_q.args.h0 = g0 * grp;
  for_q.grid[1] = static_cast<unsigned>(ng * grp);
  for_kv.kernel = kernel_name("dkdv", D, bf16);
  for_kv.args.h0 = g0;
  for_kv.grid[1] = static_cast<unsigned>(ng);
  *launches = {for_q, for_kv};
  return "";
}

}  // namespace halyard::runtime::attention_cuda

using namespace halyard::runtime::attention_cuda;

extern "C" int halyard_attention_forward_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                              halide_buffer_t* pos, int heads, int kv_heads, int head_dim, int,
                                              int, int bf16, halide_buffer_t* out) {
  return forward("halyard_attention_forward_cuda", q, k, v, pos, {}, nullptr, heads, kv_heads, head_dim, bf16, out);
}

extern "C" int halyard_attention_forward_lse_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                                  halide_buffer_t* pos, halide_buffer_t* lse, int heads, int kv_heads,
                                                  int head_dim, int, int, int bf16, halide_buffer_t* out) {
  return forward("halyard_attention_forward_lse_cuda", q, k, v, pos, {}, lse, heads, kv_heads, head_dim, bf16, out);
}

extern "C" int halyard_attention_lse_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* pos, int heads,
                                          int kv_heads, int head_dim, int, int, int bf16, halide_buffer_t* out) {
  return lse_alone("halyard_attention_lse_cuda", q, k, pos, {}, heads, kv_heads, head_dim, bf16, out);
}

extern "C" int halyard_attention_backward_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                               halide_buffer_t* pos, halide_buffer_t* o, halide_buffer_t* dO,
                                               halide_buffer_t* lse, halide_buffer_t* dv, halide_buffer_t* dq,
                                               int heads, int kv_heads, int, int, int bf16, halide_buffer_t* out) {
  return backward("halyard_attention_backward_cuda", q, k, v, pos, o, dO, lse, {}, nullptr, dv, dq, heads, kv_heads, bf16,
                  out);
}

extern "C" int halyard_attention_forward_ring_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                                   halide_buffer_t* pos, halide_buffer_t* kidx, halide_buffer_t* qidx,
                                                   int heads, int kv_heads, int head_dim, int, int, int bf16,
                                                   halide_buffer_t* out) {
  return forward("halyard_attention_forward_ring_cuda", q, k, v, pos, {kidx, qidx}, nullptr, heads, kv_heads, head_dim,
                 bf16, out);
}

extern "C" int halyard_attention_forward_lse_ring_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                                       halide_buffer_t* pos, halide_buffer_t* kidx,
                                                       halide_buffer_t* qidx, halide_buffer_t* lse, int heads,
                                                       int kv_heads, int head_dim, int, int, int bf16,
                                                       halide_buffer_t* out) {
  return forward("halyard_attention_forward_lse_ring_cuda", q, k, v, pos, {kidx, qidx}, lse, heads, kv_heads, head_dim,
                 bf16, out);
}

extern "C" int halyard_attention_lse_ring_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* pos,
                                               halide_buffer_t* kidx, halide_buffer_t* qidx, int heads, int kv_heads,
                                               int head_dim, int, int, int bf16, halide_buffer_t* out) {
  return lse_alone("halyard_attention_lse_ring_cuda", q, k, pos, {kidx, qidx}, heads, kv_heads, head_dim, bf16, out);
}

extern "C" int halyard_attention_backward_ring_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                                    halide_buffer_t* pos, halide_buffer_t* o, halide_buffer_t* dO,
                                                    halide_buffer_t* lse, halide_buffer_t* kidx, halide_buffer_t* qidx,
                                                    halide_buffer_t* dv, halide_buffer_t* dq, int heads, int kv_heads,
                                                    int, int, int bf16, halide_buffer_t* out) {
  return backward("halyard_attention_backward_ring_cuda", q, k, v, pos, o, dO, lse, {kidx, qidx}, nullptr, dv, dq, heads,
                  kv_heads, bf16, out);
}

extern "C" int halyard_attention_backward_ring_add_cuda(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                                        halide_buffer_t* pos, halide_buffer_t* o, halide_buffer_t* dO,
                                                        halide_buffer_t* lse, halide_buffer_t* kidx,
                                                        halide_buffer_t* qidx, halide_buffer_t* dq_sum,
                                                        halide_buffer_t* dv, halide_buffer_t* dq, int heads,
                                                        int kv_heads, int, int, int bf16, halide_buffer_t* out) {
  return backward("halyard_attention_backward_ring_add_cuda", q, k, v, pos, o, dO, lse, {kidx, qidx}, dq_sum, dv, dq,
                  heads, kv_heads, bf16, out);
}
