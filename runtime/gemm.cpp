// The runtime's GEMM (see gemm.h): the buffers' dimensions as column-major
// GEMM calls, run by cuBLAS on device buffers or by the reference on host ones.
#include "runtime/gemm.h"

#include <HalideRuntime.h>
#include <dlfcn.h>

#include <climits>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "runtime/bf16.h"
#include "runtime/cuda_context.h"
#include "runtime/cuda_driver.h"

namespace halyard::runtime::gemm {
namespace {

// A dimension of the GEMM, or of a loop around it: its extent, and its
// stride in a, b and out (0 in a buffer that lacks it).
struct Dim {
  int64_t extent = 1, sa = 0, sb = 0, sc = 0;
  bool sums = false;  // a k dimension: the loop accumulates
};

// A group's dimensions (innermost first) as the innermost run that is one
// dimension in every buffer holding it, and the loops around it. A
// dimension of extent 1 is never stepped, so it joins any run.
struct Split {
  Dim core;
  std::vector<Dim> loops;
};
Split split(const std::vector<Dim>& dims) {
  Split s;
  size_t i = 0;
  for (; i < dims.size(); ++i) {
    const Dim& d = dims[i];
    if (d.extent == 1) continue;
    if (s.core.extent == 1) {
      s.core = d;
      continue;
    }
    const int64_t e = s.core.extent;
    if (d.sa != s.core.sa * e || d.sb != s.core.sb * e || d.sc != s.core.sc * e) break;
    s.core.extent *= d.extent;
  }
  for (; i < dims.size(); ++i)
    if (dims[i].extent > 1) s.loops.push_back(dims[i]);
  return s;
}

// The leading dimension of a matrix whose inner dimension (extent `rows`,
// stride `inner`) must be dense and whose outer one has stride `outer`
// (extent `cols`), or -1 when the memory does not read so.
int64_t leading(int64_t rows, int64_t inner, int64_t cols, int64_t outer) {
  if (rows > 1 && inner != 1) return -1;
  if (cols == 1) return std::max<int64_t>(rows, 1);
  return outer >= rows ? outer : -1;
}

}  // namespace

Calls describe(const halide_buffer_t* a, const halide_buffer_t* b, int m_dims, int n_dims, int k_dims, bool a_k_inner,
               bool b_k_inner, const halide_buffer_t* out) {
  Calls r;
  if (m_dims < 1 || n_dims < 1 || k_dims < 1 || a->dimensions != m_dims + k_dims ||
      b->dimensions != n_dims + k_dims || out->dimensions != m_dims + n_dims) {
    r.error = "halyard_gemm: the buffers' dimensions are not (m..., k...), (n..., k...) and (n..., m...)";
    return r;
  }
  const int a_m = a_k_inner ? k_dims : 0, a_k = a_k_inner ? 0 : m_dims;
  const int b_n = b_k_inner ? k_dims : 0, b_k = b_k_inner ? 0 : n_dims;
  std::vector<Dim> m, n, k;
  for (int i = 0; i < m_dims; ++i) {
    const halide_dimension_t &x = a->dim[a_m + i], &o = out->dim[n_dims + i];
    if (x.min != o.min || x.extent != o.extent) r.error = "halyard_gemm: a's m dimensions are not the output's";
    m.push_back({o.extent, x.stride, 0, o.stride, false});
  }
  for (int i = 0; i < n_dims; ++i) {
    const halide_dimension_t &x = b->dim[b_n + i], &o = out->dim[i];
    if (x.min != o.min || x.extent != o.extent) r.error = "halyard_gemm: b's n dimensions are not the output's";
    n.push_back({o.extent, 0, x.stride, o.stride, false});
  }
  for (int i = 0; i < k_dims; ++i) {
    const halide_dimension_t &x = a->dim[a_k + i], &y = b->dim[b_k + i];
    if (x.min != y.min || x.extent != y.extent) r.error = "halyard_gemm: a and b do not hold the same k dimensions";
    k.push_back({x.extent, x.stride, y.stride, 0, true});
  }
  if (!r.error.empty()) return r;
  const Split sm = split(m), sn = split(n), sk = split(k);
  const int64_t M = sm.core.extent, N = sn.core.extent, K = sk.core.extent;
  // Row-major: out[M][N], a [M][K] or [K][M], b [N][K] or [K][N].
  const int64_t ldc = leading(N, sn.core.sc, M, sm.core.sc);
  const int64_t lda = a_k_inner ? leading(K, sk.core.sa, M, sm.core.sa) : leading(M, sm.core.sa, K, sk.core.sa);
  const int64_t ldb = b_k_inner ? leading(K, sk.core.sb, N, sn.core.sb) : leading(N, sn.core.sb, K, sk.core.sb);
  if (ldc < 0 || lda < 0 || ldb < 0) {
    r.error = "halyard_gemm: the innermost run of a group of dimensions is not dense in " +
              std::string(ldc < 0 ? "the output" : lda < 0 ? "a" : "b");
    return r;
  }
  // Column-major, out is C^T[N][M] = B^T A^T: cuBLAS's A is b, its B is a.
  Call core;
  core.trans_a = b_k_inner;
  core.trans_b = !a_k_inner;
  core.m = N, core.n = M, core.k = K;
  core.lda = ldb, core.ldb = lda, core.ldc = ldc;
  std::vector<Dim> loops = sm.loops;
  loops.insert(loops.end(), sn.loops.begin(), sn.loops.end());
  loops.insert(loops.end(), sk.loops.begin(), sk.loops.end());
  int64_t count = 1;
  for (const Dim& d : loops) count *= d.extent;
  for (int64_t i = 0; i < count; ++i) {
    Call c = core;
    int64_t rest = i;
    for (const Dim& d : loops) {
      const int64_t x = rest % d.extent;
      rest /= d.extent;
      c.offset_a += x * d.sb;
      c.offset_b += x * d.sa;
      c.offset_c += x * d.sc;
      c.accumulate = c.accumulate || (d.sums && x > 0);
    }
    r.calls.push_back(c);
  }
  return r;
}

namespace {

float value(float x) { return x; }
float value(uint16_t bits) { return bf16_value(bits); }

template <typename T>
void reference_of(const Call& c, const T* a, const T* b, float* out) {
  a += c.offset_a, b += c.offset_b, out += c.offset_c;
  for (int64_t j = 0; j < c.n; ++j)
    for (int64_t i = 0; i < c.m; ++i) {
      double sum = 0;
      for (int64_t p = 0; p < c.k; ++p)
        sum += static_cast<double>(value(c.trans_a ? a[p + i * c.lda] : a[i + p * c.lda])) *
               static_cast<double>(value(c.trans_b ? b[j + p * c.ldb] : b[p + j * c.ldb]));
      float& o = out[i + j * c.ldc];
      o = c.accumulate ? o + static_cast<float>(sum) : static_cast<float>(sum);
    }
}

}  // namespace

void reference(const Call& c, const float* a, const float* b, float* out) { reference_of(c, a, b, out); }
void reference(const Call& c, const uint16_t* a, const uint16_t* b, float* out) { reference_of(c, a, b, out); }

namespace {

// cuBLAS, opened at run time like the driver (cuda_driver.h): a program
// linking the runtime needs no CUDA to start, and a GPU node finds the
// library in its Python's nvidia-cublas wheel (scripts/gpu_check.sh).
struct Cublas {
  using Status = int;
  Status (*create)(void**) = nullptr;
  Status (*set_stream)(void*, void*) = nullptr;
  Status (*sgemm)(void*, int, int, int, int, int, const float*, const float*, int, const float*, int, const float*,
                  float*, int) = nullptr;
  // cublasGemmEx: types and the compute type as cuBLAS's enums (below).
  Status (*gemm_ex)(void*, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                    const void*, void*, int, int, int, int) = nullptr;
  Status (*sgeam)(void*, int, int, int, int, const float*, const float*, int, const float*, const float*, int, float*,
                  int) = nullptr;
  void* handle = nullptr;
  std::string why_unusable;
};

Cublas load_cublas() {
  Cublas c;
  void* lib = nullptr;
  for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"})
    if ((lib = dlopen(name, RTLD_LAZY | RTLD_LOCAL))) break;
  if (!lib) {
    c.why_unusable = "no cuBLAS (libcublas.so.13 or .12 not found on the library path)";
    return c;
  }
  auto get = [&](auto& f, const char* name) {
    f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(lib, name));
    if (!f) c.why_unusable = std::string("cuBLAS lacks ") + name;
  };
  get(c.create, "cublasCreate_v2");
  get(c.set_stream, "cublasSetStream_v2");
  get(c.sgemm, "cublasSgemm_v2");
  get(c.gemm_ex, "cublasGemmEx");
  get(c.sgeam, "cublasSgeam");
  if (!c.why_unusable.empty()) return c;
  // The handle belongs to the context current when it is made: the primary
  // one Halide's kernels run in.
  const RuntimeCudaContext& ctx = runtime_cuda_context();
  const CudaDriver& d = cuda_driver();
  if (!ctx.context) {
    c.why_unusable = "no CUDA context: " + ctx.error;
    return c;
  }
  d.ctx_push(ctx.context);
  const Cublas::Status s = c.create(&c.handle);
  if (s == 0) c.set_stream(c.handle, ctx.stream);
  void* popped = nullptr;
  d.ctx_pop(&popped);
  if (s != 0) c.why_unusable = "cublasCreate failed with status " + std::to_string(s);
  return c;
}

const Cublas& cublas() {
  static const Cublas c = load_cublas();
  return c;
}

// cuBLAS's enums (library_types.h, cublas_api.h), which the runtime does
// not include: it is built without the CUDA headers.
constexpr int kCudaR32F = 0, kCudaR16BF = 14;
constexpr int kCublasCompute32F = 68;
constexpr int kCublasGemmDefault = -1;

int fail(const std::string& why) {
  halide_error(nullptr, (why + "\n").c_str());
  return -1;
}

bool fits_int(const Call& c) {
  for (int64_t v : {c.m, c.n, c.k, c.lda, c.ldb, c.ldc})
    if (v > INT_MAX) return false;
  return true;
}

}  // namespace
}  // namespace halyard::runtime::gemm

extern "C" int halyard_gemm(halide_buffer_t* a, halide_buffer_t* b, int m_dims, int n_dims, int k_dims, int a_k_inner,
                            int b_k_inner, int bf16, int k0, int k1, int k2, halide_buffer_t* out) {
  using namespace halyard::runtime::gemm;
  const int ks[3] = {k0, k1, k2};
  if (m_dims < 1 || n_dims < 1 || k_dims < 1 || k_dims > 3 || a->dimensions != m_dims + k_dims ||
      b->dimensions != n_dims + k_dims || out->dimensions != m_dims + n_dims)
    return fail("halyard_gemm: the buffers' dimensions are not (m..., k...), (n..., k...) and (n..., m...)");
  if (out->is_bounds_query()) {  // the output's region of m and n, every k
    const int a_m = a_k_inner ? k_dims : 0, a_k = a_k_inner ? 0 : m_dims;
    const int b_n = b_k_inner ? k_dims : 0, b_k = b_k_inner ? 0 : n_dims;
    for (int i = 0; i < m_dims; ++i) a->dim[a_m + i].min = out->dim[n_dims + i].min, a->dim[a_m + i].extent = out->dim[n_dims + i].extent;
    for (int i = 0; i < n_dims; ++i) b->dim[b_n + i].min = out->dim[i].min, b->dim[b_n + i].extent = out->dim[i].extent;
    for (int i = 0; i < k_dims; ++i) {
      a->dim[a_k + i].min = b->dim[b_k + i].min = 0;
      a->dim[a_k + i].extent = b->dim[b_k + i].extent = ks[i];
    }
    return 0;
  }
  const int operand_bits = bf16 ? 16 : 32;
  if (a->type.bits != operand_bits || b->type.bits != operand_bits || out->type.bits != 32)
    return fail("halyard_gemm: the operands are not " + std::string(bf16 ? "bf16 (16 bits)" : "f32") +
                " or the output is not f32");
  const Calls d = describe(a, b, m_dims, n_dims, k_dims, a_k_inner != 0, b_k_inner != 0, out);
  if (!d.error.empty()) return fail(d.error);
  if (!out->device) {  // host buffers: the reference
    if (!a->host || !b->host || !out->host) return fail("halyard_gemm: host buffers without host memory");
    for (const Call& c : d.calls)
      if (bf16)
        reference(c, reinterpret_cast<const uint16_t*>(b->host), reinterpret_cast<const uint16_t*>(a->host),
                  reinterpret_cast<float*>(out->host));
      else
        reference(c, reinterpret_cast<const float*>(b->host), reinterpret_cast<const float*>(a->host),
                  reinterpret_cast<float*>(out->host));
    return 0;
  }
  if (!a->device || !b->device) return fail("halyard_gemm: the output is on the device but an operand is not");
  // The call is its stage's output, and its operands may be the stage's
  // inputs: Halide moves none of them for it. So an operand the host wrote
  // last (the parameters, each step) goes up here, on the stream the GEMM
  // then runs on, and the output's device copy is the newer one after.
  for (halide_buffer_t* x : {a, b})
    if (x->host_dirty())
      if (int err = halide_copy_to_device(nullptr, x, x->device_interface))
        return fail("halyard_gemm: uploading an operand failed with Halide error " + std::to_string(err));
  const Cublas& lib = cublas();
  if (!lib.why_unusable.empty()) return fail("halyard_gemm: " + lib.why_unusable);
  // (A CUDA buffer's device field is its CUdeviceptr.)
  const auto* pa = reinterpret_cast<const uint8_t*>(b->device);
  const auto* pb = reinterpret_cast<const uint8_t*>(a->device);
  auto* pc = reinterpret_cast<float*>(out->device);
  const size_t element = bf16 ? 2 : 4;
  const halyard::runtime::RuntimeCudaContext& ctx = halyard::runtime::runtime_cuda_context();
  const halyard::runtime::CudaDriver& drv = halyard::runtime::cuda_driver();
  drv.ctx_push(ctx.context);
  int status = 0;
  const float one = 1.f, zero = 0.f;
  for (const Call& c : d.calls) {
    if (!fits_int(c)) {
      status = -2;
      break;
    }
    const void* call_a = pa + static_cast<size_t>(c.offset_a) * element;
    const void* call_b = pb + static_cast<size_t>(c.offset_b) * element;
    const float* beta = c.accumulate ? &one : &zero;
    if (bf16)
      status = lib.gemm_ex(lib.handle, c.trans_a ? 1 : 0, c.trans_b ? 1 : 0, static_cast<int>(c.m), static_cast<int>(c.n),
                          static_cast<int>(c.k), &one, call_a, kCudaR16BF, static_cast<int>(c.lda), call_b, kCudaR16BF,
                          static_cast<int>(c.ldb), beta, pc + c.offset_c, kCudaR32F, static_cast<int>(c.ldc),
                          kCublasCompute32F, kCublasGemmDefault);
    else
      status = lib.sgemm(lib.handle, c.trans_a ? 1 : 0, c.trans_b ? 1 : 0, static_cast<int>(c.m), static_cast<int>(c.n),
                        static_cast<int>(c.k), &one, static_cast<const float*>(call_a), static_cast<int>(c.lda),
                        static_cast<const float*>(call_b), static_cast<int>(c.ldb), beta, pc + c.offset_c,
                        static_cast<int>(c.ldc));
    if (status != 0) break;
  }
  void* popped = nullptr;
  drv.ctx_pop(&popped);
  if (status == -2) return fail("halyard_gemm: a GEMM dimension exceeds cuBLAS's 32-bit sizes");
  if (status != 0)
    return fail(std::string("halyard_gemm: ") + (bf16 ? "cublasGemmEx (bf16)" : "cublasSgemm") + " failed with status " +
                std::to_string(status));
  out->set_host_dirty(false);
  out->set_device_dirty();
  return 0;
}

namespace halyard::runtime::gemm {

std::string add_rows_on_device(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t width, int64_t rows,
                               void* stream) {
  const Cublas& lib = cublas();
  if (!lib.why_unusable.empty()) return lib.why_unusable;
  for (int64_t v : {ldy, ldx, width, rows})
    if (v > INT_MAX) return "a dimension exceeds cuBLAS's 32-bit sizes";
  const CudaDriver& drv = cuda_driver();
  const RuntimeCudaContext& ctx = runtime_cuda_context();
  drv.ctx_push(ctx.context);
  const float one = 1.f;
  // (One handle for the process: another stream is set and put back under
  // a lock.)
  static std::mutex other_stream;
  std::unique_lock<std::mutex> lock(other_stream, std::defer_lock);
  const bool other = stream && stream != ctx.stream;
  if (other) lock.lock(), lib.set_stream(lib.handle, stream);
  // Column-major, one row of ours a column: y = 1 y + 1 x, in place (geam
  // allows C = A when ldc = lda and A is not transposed).
  const int status = lib.sgeam(lib.handle, 0, 0, static_cast<int>(width), static_cast<int>(rows), &one, y,
                               static_cast<int>(ldy), &one, x, static_cast<int>(ldx), y, static_cast<int>(ldy));
  if (other) lib.set_stream(lib.handle, ctx.stream);
  void* popped = nullptr;
  drv.ctx_pop(&popped);
  return status == 0 ? "" : "cublasSgeam failed with status " + std::to_string(status);
}

}  // namespace halyard::runtime::gemm
