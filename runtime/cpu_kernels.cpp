// The entry points of attention_cpu.h and gemm_cpu.h: Halide's buffers to
// one task's pointers, and the ISA chosen once from the CPU's features (the
// kernels are compiled for AVX-512, AVX2 + FMA and the baseline).
#include "runtime/attention_cpu.h"
#include "runtime/gemm_cpu.h"
#include "runtime/scratch.h"

#include <HalideRuntime.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace halyard::runtime {

#define HALYARD_DECLARE_ISA(ns)                                                                  \
  namespace attention_cpu::ns {                                                                  \
  void forward_head(const Head& a, float* out, int64_t out_ld, float* lse, int64_t lse_ld);    \
  void backward_group(const Group& a, const float* const* dq_in, int64_t dq_in_ld, float* const* dq, \
                      int64_t dq_ld, float* dk, int64_t dk_ld, float* dv, int64_t dv_ld);         \
  }                                                                                              \
  namespace gemm_cpu::ns {                                                                       \
  Tile tile();                                                                                   \
  void rows(const Operands& o, int64_t m0, int64_t mc, float* c, float* bp);                    \
  }
HALYARD_DECLARE_ISA(base)
#if defined(__x86_64__)
HALYARD_DECLARE_ISA(avx2)
HALYARD_DECLARE_ISA(avx512)
#endif
#undef HALYARD_DECLARE_ISA

namespace {

using attention_cpu::Group;
using attention_cpu::Head;
using attention_cpu::KeyRows;
using attention_cpu::RingIndices;
using gemm_cpu::Operands;
using gemm_cpu::Tile;

struct Kernels {
  const char* name;
  void (*forward)(const Head&, float*, int64_t, float*, int64_t);
  void (*backward)(const Group&, const float* const*, int64_t, float* const*, int64_t, float*, int64_t, float*, int64_t);
  Tile (*gemm_tile)();
  void (*gemm_rows)(const Operands&, int64_t, int64_t, float*, float*);
};

#define HALYARD_KERNELS(ns)                                                                              \
  Kernels {                                                                                              \
    #ns, attention_cpu::ns::forward_head, attention_cpu::ns::backward_group, gemm_cpu::ns::tile,         \
        gemm_cpu::ns::rows                                                                               \
  }
const Kernels kBase = HALYARD_KERNELS(base);
#if defined(__x86_64__)
const Kernels kAvx2 = HALYARD_KERNELS(avx2);
const Kernels kAvx512 = HALYARD_KERNELS(avx512);
#endif
#undef HALYARD_KERNELS

// The widest variant this CPU runs, or the one HALYARD_CPU_ISA names
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
  if (const char* want = std::getenv("HALYARD_CPU_ISA"); want && *want) {
    for (const Kernels* k : runnable)
      if (std::strcmp(k->name, want) == 0) return *k;
    static bool said = false;
    if (!said) {
      std::string legal;
      for (const Kernels* k : runnable) legal += std::string(legal.empty() ? "" : ", ") + k->name;
      std::fprintf(stderr, "warning: HALYARD_CPU_ISA=%s is not a variant this CPU runs (legal: %s); using %s\n", want,
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

// An attention operand's element at coordinates c: f32, or bf16 as its 16
// bits (attention_cpu.h).
attention_cpu::Elems elems_at(const halide_buffer_t* b, std::initializer_list<int> c) {
  if (attention_cpu::holds_bf16(b)) return {at<const uint16_t>(b, c), true};
  return {at<const float>(b, c), false};
}

// Whether each attention operand given is f32 or the 16 bits of bf16.
bool operand_types(std::initializer_list<const halide_buffer_t*> xs) {
  for (const halide_buffer_t* x : xs)
    if (x && !attention_cpu::holds_f32(x) && !attention_cpu::holds_bf16(x)) return false;
  return true;
}
constexpr const char* kOperandTypes = ": q, k, v, O and dO must be f32, or bf16 as its 16 bits (uint16)";

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
int fail(const std::string& what) {
  std::fprintf(stderr, "%s\n", what.c_str());
  return -1;
}

// Halide's thread pool, when the binary has Halide's runtime (every AOT
// library links one); JIT-compiled stages (tests, benchmarks) have it only
// inside libHalide, so there the tasks run on threads of their own, as many
// as HL_NUM_THREADS says (Halide's own setting), else one per core.
extern "C" int halide_do_par_for(void*, int (*)(void*, int, uint8_t*), int, int, uint8_t*) __attribute__((weak));
extern "C" int halide_get_num_threads() __attribute__((weak));

// The threads Halide's pool runs: what the trainer set (Model::set_num_threads,
// one per rank where 4 ranks share 2 cores: 2 tasks on 1 thread packed the
// other operand twice, 3-4% slower weight gradients, Zen 4); in JIT-compiled
// stages HL_NUM_THREADS (Halide's own setting), else one per core.
int threads() {
  if (halide_do_par_for && halide_get_num_threads) return std::max(1, halide_get_num_threads());
  static const int n = [] {
    int k = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* t = std::getenv("HL_NUM_THREADS"); t && std::atoi(t) > 0) k = std::atoi(t);
    return std::max(1, k);
  }();
  return n;
}

// The fallback: that many threads, started once (threads started per call
// cost 10-15% of a 4096-token weight gradient).

class Pool {
 public:
  Pool() {
    for (int t = 1; t < threads(); ++t) workers_.emplace_back([this] { serve(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  // Runs fn(arg, i) for i in [0, n) on the calling thread and the workers.
  void run(int n, void (*fn)(void*, int), void* arg) {
    std::lock_guard<std::mutex> one(run_mu_);  // one job at a time
    {
      std::lock_guard<std::mutex> l(mu_);
      fn_ = fn, arg_ = arg, n_ = n, next_ = 0, active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    work();
    std::unique_lock<std::mutex> l(mu_);
    done_.wait(l, [this] { return active_ == 0; });
  }

 private:
  void work() {
    for (int i = next_++; i < n_; i = next_++) fn_(arg_, i);
  }
  void serve() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> l(mu_);
        wake_.wait(l, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> l(mu_);
      if (--active_ == 0) done_.notify_one();
    }
  }
  std::vector<std::thread> workers_;
  std::mutex run_mu_, mu_;
  std::condition_variable wake_, done_;
  void (*fn_)(void*, int) = nullptr;
  void* arg_ = nullptr;
  int n_ = 0, active_ = 0;
  std::atomic<int> next_{0};
  uint64_t generation_ = 0;
  bool stop_ = false;
};

Pool& fallback_pool() {
  static Pool pool;
  return pool;
}

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
  fallback_pool().run(n, [](void* f, int i) { (*static_cast<F*>(f))(i); }, &f);
}

int64_t l2_bytes() {
  static const int64_t l2 = [] {
    const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return v > 0 ? static_cast<int64_t>(v) : int64_t{1} << 20;
  }();
  return l2;
}

// The kv head g of row b, as every task reads it.
KeyRows key_rows(const halide_buffer_t* k, const halide_buffer_t* v, const halide_buffer_t* pos, RingIndices idx, int g,
                 int b, int S, int D, int query_block, int key_block, int bf16) {
  KeyRows a;
  a.S = S;
  a.D = D;
  a.query_block = query_block > 0 ? query_block : attention_cpu::default_query_block();
  a.key_block = key_block;
  a.bf16 = bf16 != 0;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  a.k = elems_at(k, {0, g, 0, b});
  if (v) a.v = elems_at(v, {0, g, 0, b});  // (none for the log-sum-exp alone)
  a.k_ld = k->dim[2].stride;
  a.v_ld = v ? v->dim[2].stride : 0;
  a.pos = at<const int32_t>(pos, {0, b});
  if (idx.kidx) a.kidx = at<const int32_t>(idx.kidx, {0, b}), a.qidx = at<const int32_t>(idx.qidx, {0, b});
  return a;
}

}  // namespace

const char* attention_cpu::isa() { return kernels().name; }

bool attention_cpu::holds_f32(const halide_buffer_t* x) { return x->type.code == halide_type_float && x->type.bits == 32; }
bool attention_cpu::holds_bf16(const halide_buffer_t* x) { return x->type.code == halide_type_uint && x->type.bits == 16; }

// 256 queries where a block's scores and their gradients (2 x 256 x 128
// floats) fit in a quarter of the L2 (an L2 of 1 MiB or more), else 128
// (attention_cpu_impl.h).
int attention_cpu::default_query_block() { return 2 * 256 * 128 * 4 <= l2_bytes() / 4 ? 256 : 128; }

// One task per thread (a fork and join per block cost 10-15% of a 4096-token
// weight gradient on 2 cores), each a block of rows or of columns that packs
// its own blocks: 256 tokens (an A panel of 12 KiB stays in the L1), columns
// such that B's block fills at most half the L2.
void gemm_cpu::weight_grad(const Operands& given, float* c) {
  const Kernels& k = kernels();
  const Tile t = k.gemm_tile();
  Operands o = given;
  o.kc = std::clamp(o.kc > 0 ? o.kc : 256, 1, kMaxKc);
  if (o.nc <= 0) {
    const int64_t l2 = l2_bytes();
    o.nc = static_cast<int>(std::clamp<int64_t>(l2 / 2 / (4 * o.kc), t.cols, 1 << 20));
  }
  // Every task packs the whole of the operand it does not split: B's blocks
  // when tasks take rows, A's panels when they take columns. So the tasks
  // split the longer side (a 64 x 256 gradient split by rows packed B twice
  // and ran at 0.7x Eigen on a Zen 3; by columns, A, a quarter of the bytes).
  const bool by_rows = o.M >= o.N;
  const int64_t unit = by_rows ? t.rows : t.cols, extent = by_rows ? o.M : o.N;
  const int64_t panels = (extent + unit - 1) / unit;
  const int64_t tasks = std::clamp<int64_t>(threads(), 1, panels);
  par_for(static_cast<int>(tasks), [&](int i) {
    const int64_t p0 = panels * i / tasks, p1 = panels * (i + 1) / tasks;
    const int64_t x0 = p0 * unit, x1 = std::min(extent, p1 * unit);
    Operands part = o;
    if (!by_rows) part.b += x0, part.N = x1 - x0;
    scratch::Array<float> bp(static_cast<size_t>(o.kc) *
                             ((std::min<int64_t>(o.nc, part.N) + t.cols - 1) / t.cols * t.cols));
    if (by_rows) k.gemm_rows(part, x0, x1 - x0, c, bp.data());
    else k.gemm_rows(part, 0, o.M, c + x0, bp.data());
  });
}

}  // namespace halyard::runtime

using namespace halyard::runtime;
using namespace halyard::runtime::attention_cpu;

namespace {

// A group of a buffer's dimensions read as one: the product of extents, and
// whether the strides are those of one dense run from the group's first
// (dimensions of extent 1, whatever their stride, take no part).
struct Flat {
  int64_t extent = 1, stride = 0;
  bool dense = true;
};
Flat flatten(const halide_buffer_t* b, int from, int to) {
  Flat f;
  int64_t expect = -1;
  for (int d = from; d < to; ++d) {
    if (b->dim[d].extent == 1) continue;
    if (expect < 0) f.stride = expect = b->dim[d].stride;
    f.dense = f.dense && b->dim[d].stride == expect;
    expect *= b->dim[d].extent;
    f.extent *= b->dim[d].extent;
  }
  if (expect < 0) f.stride = 1;
  return f;
}

}  // namespace

extern "C" int halyard_weight_grad(halide_buffer_t* a, halide_buffer_t* b, int a_dims, int b_dims, int tokens0,
                                   int tokens1, int tokens2, halide_buffer_t* out) {
  const int tokens[3] = {tokens0, tokens1, tokens2};
  const int nt = a->dimensions - a_dims;
  if (nt < 1 || nt > 3 || b->dimensions - b_dims != nt)
    return fail("halyard_weight_grad: a and b need the same 1 to 3 token dimensions");
  if (out->is_bounds_query()) {
    // The output's region of rows and columns, every token.
    for (int d = 0; d < b_dims; ++d) b->dim[d].min = out->dim[d].min, b->dim[d].extent = out->dim[d].extent;
    for (int d = 0; d < a_dims; ++d) a->dim[d].min = out->dim[b_dims + d].min, a->dim[d].extent = out->dim[b_dims + d].extent;
    for (int d = 0; d < nt; ++d) {
      a->dim[a_dims + d].min = b->dim[b_dims + d].min = 0;
      a->dim[a_dims + d].extent = b->dim[b_dims + d].extent = tokens[d];
    }
    return 0;
  }
  if (out->dimensions != a_dims + b_dims)
    return fail("halyard_weight_grad: the output must be b's kept dimensions then a's");
  for (int d = 0; d < a_dims; ++d)
    if (a->dim[d].min != out->dim[b_dims + d].min || a->dim[d].extent != out->dim[b_dims + d].extent)
      return fail("halyard_weight_grad: a's kept dimensions must be the output's rows");
  for (int d = 0; d < b_dims; ++d)
    if (b->dim[d].min != out->dim[d].min || b->dim[d].extent != out->dim[d].extent)
      return fail("halyard_weight_grad: b's kept dimensions must be the output's columns");
  for (int d = 0; d < nt; ++d)
    if (a->dim[a_dims + d].min != b->dim[b_dims + d].min || a->dim[a_dims + d].extent != b->dim[b_dims + d].extent)
      return fail("halyard_weight_grad: a and b must hold the same tokens");
  const Flat rows = flatten(a, 0, a_dims), cols = flatten(b, 0, b_dims), oc = flatten(out, 0, b_dims),
             orow = flatten(out, b_dims, out->dimensions);
  if (rows.stride != 1 || cols.stride != 1 || oc.stride != 1 || !rows.dense || !cols.dense || !oc.dense || !orow.dense)
    return fail("halyard_weight_grad: the rows and columns of a, b and the output must be dense");
  // The token dimensions from the innermost that read as one run in both
  // operands (all of them for a whole tensor; a sequence tile of a batch of
  // rows breaks after seq); the sum loops over the rest.
  int inner = nt;
  while (inner > 1 && !(flatten(a, a_dims, a_dims + inner).dense && flatten(b, b_dims, b_dims + inner).dense)) --inner;
  const Flat ka = flatten(a, a_dims, a_dims + inner), kb = flatten(b, b_dims, b_dims + inner);
  gemm_cpu::Operands o;
  o.M = rows.extent, o.N = cols.extent, o.K = ka.extent;
  o.lda = ka.stride, o.ldb = kb.stride, o.ldc = orow.stride;
  if (const char* kc = std::getenv("HALYARD_GEMM_KC"); kc && std::atoi(kc) > 0) o.kc = std::atoi(kc);
  if (const char* nc = std::getenv("HALYARD_GEMM_NC"); nc && std::atoi(nc) > 0) o.nc = std::atoi(nc);
  int64_t outer = 1;
  for (int d = inner; d < nt; ++d) outer *= a->dim[a_dims + d].extent;
  for (int64_t i = 0; i < outer; ++i) {
    int64_t off_a = 0, off_b = 0, rest = i;
    for (int d = inner; d < nt; ++d) {
      const int64_t e = a->dim[a_dims + d].extent, x = rest % e;
      rest /= e;
      off_a += x * a->dim[a_dims + d].stride;
      off_b += x * b->dim[b_dims + d].stride;
    }
    o.a = reinterpret_cast<const float*>(a->host) + off_a;
    o.b = reinterpret_cast<const float*>(b->host) + off_b;
    o.accumulate = i > 0;
    gemm_cpu::weight_grad(o, reinterpret_cast<float*>(out->host));
  }
  return 0;
}

namespace {

// Whether buffer x holds every element of `want` ({min, extent} per
// dimension): what an output written beside the call's own must cover.
bool covers(const halide_buffer_t* x, std::initializer_list<std::pair<int, int>> want) {
  if (x->dimensions != static_cast<int>(want.size())) return false;
  int d = 0;
  for (auto [min, extent] : want) {
    if (x->dim[d].min > min || x->dim[d].min + x->dim[d].extent < min + extent) return false;
    ++d;
  }
  return true;
}

}  // namespace

// The output's rows are whole, and the inputs are asked for whole rows too.
int halyard::runtime::attention_cpu::ask_whole_rows(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                                    halide_buffer_t* pos, int heads, int kv_heads, int head_dim,
                                                    const halide_buffer_t* out, halide_buffer_t* o,
                                                    halide_buffer_t* dO, halide_buffer_t* lse, RingIndices idx,
                                                    halide_buffer_t* dq_sum) {
  const int rows = out->dimensions - 2;  // (the log-sum-exp alone has no head_dim)
  const int D = head_dim, S = out->dim[rows].extent, b0 = out->dim[rows + 1].min, nb = out->dim[rows + 1].extent;
  for (halide_buffer_t* x : {q, o, dO, dq_sum})
    if (x) whole(x, {{0, D}, {0, heads}, {0, S}, {b0, nb}});
  for (halide_buffer_t* x : {k, v})
    if (x) whole(x, {{0, D}, {0, kv_heads}, {0, S}, {b0, nb}});
  if (lse) whole(lse, {{0, heads}, {0, S}, {b0, nb}});
  for (halide_buffer_t* x : {pos, idx.kidx, idx.qidx})
    if (x) whole(x, {{0, S}, {b0, nb}});
  return 0;
}

namespace {

// The forward over the output's heads and rows: out is the output
// [head_dim, heads, seq, batch], lse (where the stage writes it) the
// log-sum-exp [heads, seq, batch], both the stage's own buffers. Without
// out (and v), the log-sum-exp alone, over its own heads and rows.
int attention_forward(const char* who, halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                      halide_buffer_t* pos, RingIndices idx, halide_buffer_t* lse, int heads, int kv_heads, int head_dim,
                      int query_block, int key_block, int bf16, halide_buffer_t* out) {
  halide_buffer_t* rows = out ? out : lse;
  if (rows->is_bounds_query()) return ask_whole_rows(q, k, v, pos, heads, kv_heads, head_dim, rows, nullptr, nullptr, nullptr, idx);
  const int x = out ? 1 : 0;  // rows' heads dimension
  const int D = head_dim, h0 = rows->dim[x].min, nh = rows->dim[x].extent, S = rows->dim[x + 1].extent,
            b0 = rows->dim[x + 2].min, nb = rows->dim[x + 2].extent;
  if (rows->dim[x + 1].min != 0 || q->dim[0].stride != 1 || k->dim[0].stride != 1 ||
      (out && (out->dim[0].min != 0 || out->dim[0].extent != D || v->dim[0].stride != 1 || out->dim[0].stride != 1)))
    return fail(std::string(who) + ": rows must be whole and head_dim dense");
  if (out && lse && !covers(lse, {{h0, nh}, {0, S}, {b0, nb}}))
    return fail(std::string(who) + ": the log-sum-exp must cover the output's heads and rows");
  if (kv_heads < 1 || heads % kv_heads) return fail(std::string(who) + ": kv_heads must divide heads");
  if (!operand_types({q, k, v})) return fail(std::string(who) + kOperandTypes);
  par_for(nb * nh, [&](int task) {
      const int b = b0 + task / nh, h = h0 + task % nh;
      Head a;
      static_cast<KeyRows&>(a) = key_rows(k, v, pos, idx, h / (heads / kv_heads), b, S, D, query_block, key_block, bf16);
      a.q = elems_at(q, {0, h, 0, b});
      a.q_ld = q->dim[2].stride;
      scratch::Array<float> unused(lse ? 0 : static_cast<size_t>(S));
      kernels().forward(a, out ? at<float>(out, {0, h, 0, b}) : nullptr, out ? out->dim[2].stride : 0,
                        lse ? at<float>(lse, {h, 0, b}) : unused.data(), lse ? lse->dim[1].stride : 1);
  });
  return 0;
}

}  // namespace

extern "C" int halyard_attention_forward(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, halide_buffer_t* pos,
                                         int heads, int kv_heads, int head_dim, int query_block, int key_block,
                                         int bf16, halide_buffer_t* out) {
  return attention_forward("halyard_attention_forward", q, k, v, pos, {}, nullptr, heads, kv_heads, head_dim, query_block,
                           key_block, bf16, out);
}

extern "C" int halyard_attention_forward_lse(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                             halide_buffer_t* pos, halide_buffer_t* lse, int heads, int kv_heads,
                                             int head_dim, int query_block, int key_block, int bf16,
                                             halide_buffer_t* out) {
  return attention_forward("halyard_attention_forward_lse", q, k, v, pos, {}, lse, heads, kv_heads, head_dim, query_block,
                           key_block, bf16, out);
}

extern "C" int halyard_attention_lse(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* pos, int heads,
                                     int kv_heads, int head_dim, int query_block, int key_block, int bf16,
                                     halide_buffer_t* out) {
  return attention_forward("halyard_attention_lse", q, k, nullptr, pos, {}, out, heads, kv_heads, head_dim, query_block,
                           key_block, bf16, nullptr);
}

namespace {

int attention_backward(const char* who, halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                       halide_buffer_t* pos, halide_buffer_t* o, halide_buffer_t* dO, halide_buffer_t* lse, RingIndices idx,
                       halide_buffer_t* dq_in, halide_buffer_t* dv, halide_buffer_t* dq, int heads, int kv_heads,
                       int query_block, int key_block, int bf16, halide_buffer_t* out) {
  const int D = out->dim[0].extent, S = out->dim[2].extent, b0 = out->dim[3].min, nb = out->dim[3].extent;
  if (out->is_bounds_query()) return ask_whole_rows(q, k, v, pos, heads, kv_heads, D, out, o, dO, lse, idx, dq_in);
  const int grp = kv_heads < 1 ? 0 : heads / kv_heads, g0 = out->dim[1].min, ng = out->dim[1].extent;
  if (out->dim[0].min != 0 || out->dim[2].min != 0 || grp < 1 || grp > Group::kMaxHeads || heads != grp * kv_heads ||
      out->dim[0].stride != 1)
    return fail(std::string(who) + ": rows and groups must be whole and head_dim dense");
  for (const halide_buffer_t* x : {q, k, v, o, dO, dv, dq})
    if (x->dim[0].stride != 1) return fail(std::string(who) + ": head_dim must be dense");
  if (dq_in && (dq_in->type.code != halide_type_float || dq_in->type.bits != 32 || dq_in->dim[0].stride != 1 ||
                !covers(dq_in, {{0, D}, {g0 * grp, ng * grp}, {0, S}, {b0, nb}})))
    return fail(std::string(who) + ": the dQ sum added to must be f32, head_dim dense, and cover dQ");
  if (!operand_types({q, k, v, o, dO})) return fail(std::string(who) + kOperandTypes);
  if (!covers(dv, {{0, D}, {g0, ng}, {0, S}, {b0, nb}}) || !covers(dq, {{0, D}, {g0 * grp, ng * grp}, {0, S}, {b0, nb}}))
    return fail(std::string(who) + ": dV and dQ must cover dK's groups and rows");
  par_for(nb * ng, [&](int task) {
      const int b = b0 + task / ng, g = g0 + task % ng;
      Group a;
      static_cast<KeyRows&>(a) = key_rows(k, v, pos, idx, g, b, S, D, query_block, key_block, bf16);
      a.heads = grp;
      float* dqs[Group::kMaxHeads];
      const float* sums[Group::kMaxHeads];
      for (int w = 0; w < grp; ++w) {
        const int h = g * grp + w;
        a.q[w] = elems_at(q, {0, h, 0, b});
        a.o[w] = elems_at(o, {0, h, 0, b});
        a.dO[w] = elems_at(dO, {0, h, 0, b});
        a.lse[w] = at<const float>(lse, {h, 0, b});
        dqs[w] = at<float>(dq, {0, h, 0, b});
        if (dq_in) sums[w] = at<const float>(dq_in, {0, h, 0, b});
      }
      a.q_ld = q->dim[2].stride;
      a.o_ld = o->dim[2].stride;
      a.dO_ld = dO->dim[2].stride;
      a.lse_ld = lse->dim[1].stride;
      kernels().backward(a, dq_in ? sums : nullptr, dq_in ? dq_in->dim[2].stride : 0, dqs, dq->dim[2].stride,
                         at<float>(out, {0, g, 0, b}), out->dim[2].stride,
                         at<float>(dv, {0, g, 0, b}), dv->dim[2].stride);
  });
  return 0;
}

}  // namespace

extern "C" int halyard_attention_backward(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                          halide_buffer_t* pos, halide_buffer_t* o, halide_buffer_t* dO,
                                          halide_buffer_t* lse, halide_buffer_t* dv, halide_buffer_t* dq, int heads,
                                          int kv_heads, int query_block, int key_block, int bf16,
                                          halide_buffer_t* out) {
  return attention_backward("halyard_attention_backward", q, k, v, pos, o, dO, lse, {}, nullptr, dv, dq, heads, kv_heads,
                            query_block, key_block, bf16, out);
}

extern "C" int halyard_attention_forward_ring(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                              halide_buffer_t* pos, halide_buffer_t* kidx, halide_buffer_t* qidx,
                                              int heads, int kv_heads, int head_dim, int query_block, int key_block,
                                              int bf16, halide_buffer_t* out) {
  return attention_forward("halyard_attention_forward_ring", q, k, v, pos, {kidx, qidx}, nullptr, heads, kv_heads,
                           head_dim, query_block, key_block, bf16, out);
}

extern "C" int halyard_attention_forward_lse_ring(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                                  halide_buffer_t* pos, halide_buffer_t* kidx, halide_buffer_t* qidx,
                                                  halide_buffer_t* lse, int heads, int kv_heads, int head_dim,
                                                  int query_block, int key_block, int bf16, halide_buffer_t* out) {
  return attention_forward("halyard_attention_forward_lse_ring", q, k, v, pos, {kidx, qidx}, lse, heads, kv_heads,
                           head_dim, query_block, key_block, bf16, out);
}

extern "C" int halyard_attention_lse_ring(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* pos,
                                          halide_buffer_t* kidx, halide_buffer_t* qidx, int heads, int kv_heads,
                                          int head_dim, int query_block, int key_block, int bf16,
                                          halide_buffer_t* out) {
  return attention_forward("halyard_attention_lse_ring", q, k, nullptr, pos, {kidx, qidx}, out, heads, kv_heads,
                           head_dim, query_block, key_block, bf16, nullptr);
}

extern "C" int halyard_attention_backward_ring(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                               halide_buffer_t* pos, halide_buffer_t* o, halide_buffer_t* dO,
                                               halide_buffer_t* lse, halide_buffer_t* kidx, halide_buffer_t* qidx,
                                               halide_buffer_t* dv, halide_buffer_t* dq, int heads, int kv_heads,
                                               int query_block, int key_block, int bf16, halide_buffer_t* out) {
  return attention_backward("halyard_attention_backward_ring", q, k, v, pos, o, dO, lse, {kidx, qidx}, nullptr, dv, dq,
                            heads, kv_heads, query_block, key_block, bf16, out);
}

extern "C" int halyard_attention_backward_ring_add(halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v,
                                                   halide_buffer_t* pos, halide_buffer_t* o, halide_buffer_t* dO,
                                                   halide_buffer_t* lse, halide_buffer_t* kidx, halide_buffer_t* qidx,
                                                   halide_buffer_t* dq_sum, halide_buffer_t* dv, halide_buffer_t* dq,
                                                   int heads, int kv_heads, int query_block, int key_block, int bf16,
                                                   halide_buffer_t* out) {
  return attention_backward("halyard_attention_backward_ring_add", q, k, v, pos, o, dO, lse, {kidx, qidx}, dq_sum, dv,
                            dq, heads, kv_heads, query_block, key_block, bf16, out);
}

// The extern stage of an output that another extern call of the same
// stage writes (the log-sum-exp, dV and dQ beside attention's): it runs
// nothing, and asks for nothing.
extern "C" int halyard_written_beside(halide_buffer_t*) { return 0; }
