// The entry points of attention_cpu.h: Halide's buffers to one task's
// pointers, and the ISA chosen once from the CPU's features (the kernels are
// compiled for AVX-512, AVX2 + FMA and the baseline).
#include "runtime/attention_cpu.h"

#include <HalideRuntime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace halyard::runtime::attention_cpu {

#define HALYARD_DECLARE_ISA(ns)                                                                 \
  namespace ns {                                                                                \
  void forward_head(const Head& a, float* out, int64_t out_ld, float* lse, int64_t lse_ld);   \
  void backward_group(const Group& a, float* const* dq, int64_t dq_ld, float* dk, int64_t dk_ld, \
                      float* dv, int64_t dv_ld);                                                \
  }
HALYARD_DECLARE_ISA(base)
#if defined(__x86_64__)
HALYARD_DECLARE_ISA(avx2)
HALYARD_DECLARE_ISA(avx512)
#endif
#undef HALYARD_DECLARE_ISA

namespace {

struct Kernels {
  const char* name;
  void (*forward)(const Head&, float*, int64_t, float*, int64_t);
  void (*backward)(const Group&, float* const*, int64_t, float*, int64_t, float*, int64_t);
};

const Kernels kBase{"base", base::forward_head, base::backward_group};
#if defined(__x86_64__)
const Kernels kAvx2{"avx2", avx2::forward_head, avx2::backward_group};
const Kernels kAvx512{"avx512", avx512::forward_head, avx512::backward_group};
#endif

// The widest variant this CPU runs, or the one HALYARD_ATTENTION_ISA names
// (for tests and comparisons) when the CPU runs it.
const Kernels& kernels() {
  static const std::vector<const Kernels*> runnable = [] {
    std::vector<const Kernels*> r = {&kBase};
#if defined(__x86_64__)
    // The features each variant is compiled with (runtime/CMakeLists.txt).
    __builtin_cpu_init();
    const bool avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (avx2_fma) r.push_back(&kAvx2);
    if (avx2_fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
      r.push_back(&kAvx512);
#endif
    return r;
  }();
  if (const char* want = std::getenv("HALYARD_ATTENTION_ISA"); want && *want) {
    for (const Kernels* k : runnable)
      if (std::strcmp(k->name, want) == 0) return *k;
    static bool said = false;
    if (!said) {
      std::string legal;
      for (const Kernels* k : runnable) legal += std::string(legal.empty() ? "" : ", ") + k->name;
      std::fprintf(stderr, "warning: HALYARD_ATTENTION_ISA=%s is not a variant this CPU runs (legal: %s); using %s\n", want,
                   legal.c_str(), runnable.back()->name);
      said = true;
    }
  }
  return *runnable.back();
}

// The element at coordinates c (one per dimension) of a buffer.
template <typename T>
T* at(const halide_buffer_t* b, std::initializer_list<int> c) {
  int64_t off = 0;
  int d = 0;
  for (int x : c) {
    off += static_cast<int64_t>(x - b->dim[d].min) * b->dim[d].stride;
    ++d;
  }
  return reinterpret_cast<T*>(b->host) + off;
}

void whole(halide_buffer_t* b, std::initializer_list<std::pair<int, int>> dims) {
  int d = 0;
  for (auto [min, extent] : dims) {
    b->dim[d].min = min;
    b->dim[d].extent = extent;
    ++d;
  }
}

// Never reached from generated code (its lowering passes whole rows and
// dense head_dim); said on stderr, and the kernel fails with its name.
int fail(const char* what) {
  std::fprintf(stderr, "%s\n", what);
  return -1;
}

// Halide's thread pool, when the binary has Halide's runtime (every AOT
// library links one); JIT-compiled stages (tests, benchmarks) have it only
// inside libHalide, so there the tasks run on threads of their own, as many
// as HL_NUM_THREADS says (Halide's own setting), else one per core.
extern "C" int halide_do_par_for(void*, int (*)(void*, int, uint8_t*), int, int, uint8_t*) __attribute__((weak));

template <typename F>
void par_for(int n, F f) {
  if (halide_do_par_for) {
    auto task = [](void*, int i, uint8_t* closure) {
      (*reinterpret_cast<F*>(closure))(i);
      return 0;
    };
    halide_do_par_for(nullptr, task, 0, n, reinterpret_cast<uint8_t*>(&f));
    return;
  }
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  if (const char* t = std::getenv("HL_NUM_THREADS"); t && std::atoi(t) > 0) threads = std::atoi(t);
  threads = std::max(1, std::min(threads, n));
  std::atomic<int> next{0};
  auto worker = [&] {
    for (int i = next++; i < n; i = next++) f(i);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
}

// The kv head g of row b, as every task reads it.
KeyRows key_rows(const halide_buffer_t* k, const halide_buffer_t* v, const halide_buffer_t* pos, int g, int b, int S,
                 int D, int query_block, int key_block) {
  KeyRows a;
  a.S = S;
  a.D = D;
  a.query_block = query_block;
  a.key_block = key_block;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  a.k = at<const float>(k, {0, g, 0, b});
  a.v = at<const float>(v, {0, g, 0, b});
  a.k_ld = k->dim[2].stride;
  a.v_ld = v->dim[2].stride;
  a.pos = at<const int32_t>(pos, {0, b});
  return a;
}

}  // namespace

const char* isa() { return kernels().name; }

}  // namespace halyard::runtime::attention_cpu

using namespace halyard::runtime::attention_cpu;

extern "C" int halyard_attention_forward(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                                         int heads, int kv_heads, int head_dim, int query_block, int key_block,
                                         halide_buffer_t* out) {
  const int D = head_dim, S = out->dim[1].extent, b0 = out->dim[3].min, nb = out->dim[3].extent;
  const bool lse = out->dim[0].extent > D;  // asked for only where the stage writes it
  if (out->is_bounds_query()) {
    // The output's rows are whole; q, k, v and pos are asked for whole rows too.
    whole(q, {{0, D}, {0, heads}, {0, S}, {b0, nb}});
    whole(k, {{0, D}, {0, kv_heads}, {0, S}, {b0, nb}});
    whole(v, {{0, D}, {0, kv_heads}, {0, S}, {b0, nb}});
    whole(pos, {{0, S}, {b0, nb}});
    return 0;
  }
  if (out->dim[0].min != 0 || out->dim[1].min != 0 || q->dim[0].stride != 1 || k->dim[0].stride != 1 ||
      v->dim[0].stride != 1 || out->dim[0].stride != 1)
    return fail("halyard_attention_forward: rows must be whole and head_dim dense");
  if (kv_heads < 1 || heads % kv_heads) return fail("halyard_attention_forward: kv_heads must divide heads");
  const int h0 = out->dim[2].min, nh = out->dim[2].extent;
  par_for(nb * nh, [&](int task) {
      const int b = b0 + task / nh, h = h0 + task % nh;
      Head a;
      static_cast<KeyRows&>(a) = key_rows(k, v, pos, h / (heads / kv_heads), b, S, D, query_block, key_block);
      a.q = at<const float>(q, {0, h, 0, b});
      a.q_ld = q->dim[2].stride;
      std::vector<float> unused(lse ? 0 : static_cast<size_t>(S));
      kernels().forward(a, at<float>(out, {0, 0, h, b}), out->dim[1].stride,
                        lse ? at<float>(out, {D, 0, h, b}) : unused.data(), lse ? out->dim[1].stride : 1);
  });
  return 0;
}

extern "C" int halyard_attention_backward(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                          halide_buffer_t* pos, halide_buffer_t* o, halide_buffer_t* dO,
                                          halide_buffer_t* lse, int heads, int kv_heads, int query_block,
                                          int key_block, halide_buffer_t* out) {
  const int D = out->dim[0].extent, S = out->dim[1].extent, grp = out->dim[2].extent - 2, b0 = out->dim[4].min,
            nb = out->dim[4].extent;
  if (out->is_bounds_query()) {
    for (halide_buffer_t* x : {q, o, dO}) whole(x, {{0, D}, {0, heads}, {0, S}, {b0, nb}});
    for (halide_buffer_t* x : {k, v}) whole(x, {{0, D}, {0, kv_heads}, {0, S}, {b0, nb}});
    whole(lse, {{0, heads}, {0, S}, {b0, nb}});
    whole(pos, {{0, S}, {b0, nb}});
    return 0;
  }
  if (out->dim[0].min != 0 || out->dim[1].min != 0 || out->dim[2].min != 0 || grp < 1 || grp > Group::kMaxHeads ||
      out->dim[0].stride != 1 || kv_heads < 1 || heads != grp * kv_heads)
    return fail("halyard_attention_backward: rows and groups must be whole and head_dim dense");
  for (const halide_buffer_t* x : {q, k, v, o, dO})
    if (x->dim[0].stride != 1) return fail("halyard_attention_backward: head_dim must be dense");
  const int g0 = out->dim[3].min, ng = out->dim[3].extent;
  par_for(nb * ng, [&](int task) {
      const int b = b0 + task / ng, g = g0 + task % ng;
      Group a;
      static_cast<KeyRows&>(a) = key_rows(k, v, pos, g, b, S, D, query_block, key_block);
      a.heads = grp;
      float* dq[Group::kMaxHeads];
      for (int w = 0; w < grp; ++w) {
        const int h = g * grp + w;
        a.q[w] = at<const float>(q, {0, h, 0, b});
        a.o[w] = at<const float>(o, {0, h, 0, b});
        a.dO[w] = at<const float>(dO, {0, h, 0, b});
        a.lse[w] = at<const float>(lse, {h, 0, b});
        dq[w] = at<float>(out, {0, 0, w, g, b});
      }
      a.q_ld = q->dim[2].stride;
      a.o_ld = o->dim[2].stride;
      a.dO_ld = dO->dim[2].stride;
      a.lse_ld = lse->dim[1].stride;
      kernels().backward(a, dq, out->dim[1].stride, at<float>(out, {0, 0, grp, g, b}), out->dim[1].stride,
                         at<float>(out, {0, 0, grp + 1, g, b}), out->dim[1].stride);
  });
  return 0;
}
