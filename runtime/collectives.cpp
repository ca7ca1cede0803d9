// The collectives of a step program (see collectives.h).
#include "runtime/collectives.h"

#include <cstring>
#include <string>

#include "runtime/error.h"

namespace halyard::runtime {
namespace {

int64_t numel(const BufferSpec& b) {
  int64_t n = 1;
  for (int d = 0; d < b.rank; ++d) n *= b.shape[d];
  return n;
}

// The first head rank `r` of P holds, for H heads and Hr heads per rank.
int64_t first_head(int r, int p, int64_t heads, int64_t per_rank) {
  return per_rank * p == heads ? r * per_rank : r * heads / p;
}

void check(bool ok, const BufferSpec& in, const BufferSpec& out, const Communicator& comm, const char* what) {
  if (!ok)
    throw Error(std::string("error: collective ") + what + " from \"" + in.name + "\" to \"" + out.name +
                "\" does not fit " + std::to_string(comm.size()) + " ranks (" + comm.backend() +
                ").\nthe library was generated for another mesh; rebuild it for this one.");
}

void seq_to_heads(const BufferSpec& in, const float* x, const BufferSpec& out, float* y, Communicator& comm,
                  std::vector<float>& scratch) {
  const int p = comm.size();
  const int64_t b = in.shape[0], sl = in.shape[1], h = in.shape[2], d = in.shape[3], hr = out.shape[2];
  check(in.rank == 4 && out.rank == 4 && out.shape[1] == sl * p && (hr * p == h || (hr == 1 && p % h == 0)), in, out,
        comm, "seq_to_heads");
  const int64_t block = b * sl * hr * d;  // elements to each rank
  scratch.resize(static_cast<size_t>(2 * block * p));
  float* send = scratch.data();
  float* recv = send + block * p;
  for (int r = 0; r < p; ++r) {
    const int64_t h0 = first_head(r, p, h, hr);
    float* dst = send + r * block;
    for (int64_t t = 0; t < b * sl; ++t)
      std::memcpy(dst + t * hr * d, x + (t * h + h0) * d, static_cast<size_t>(hr * d) * sizeof(float));
  }
  std::vector<int64_t> counts(static_cast<size_t>(p), block);
  // One row: rank q's block is exactly y's tokens [q*sl, (q+1)*sl), so it lands in place.
  float* target = b == 1 ? y : recv;
  comm.all_to_all_v(send, counts.data(), target, counts.data());
  if (b == 1) return;
  const int64_t row = sl * hr * d;
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < b; ++i)
      std::memcpy(y + (i * sl * p + q * sl) * hr * d, recv + q * block + i * row, static_cast<size_t>(row) * sizeof(float));
}

void heads_to_seq(const BufferSpec& in, const float* y, const BufferSpec& out, float* x, Communicator& comm,
                  std::vector<float>& scratch) {
  const int p = comm.size();
  const int64_t b = in.shape[0], s = in.shape[1], hr = in.shape[2], d = in.shape[3], h = out.shape[2];
  const int64_t sl = s / p;
  check(in.rank == 4 && out.rank == 4 && out.shape[1] * p == s && (hr * p == h || (hr == 1 && p % h == 0)), in, out,
        comm, "heads_to_seq");
  const int64_t block = b * sl * hr * d, row = sl * hr * d;
  scratch.resize(static_cast<size_t>(2 * block * p));
  float* send = scratch.data();
  float* recv = send + block * p;
  const float* src = y;
  if (b != 1) {
    for (int q = 0; q < p; ++q)
      for (int64_t i = 0; i < b; ++i)
        std::memcpy(send + q * block + i * row, y + (i * s + q * sl) * hr * d, static_cast<size_t>(row) * sizeof(float));
    src = send;
  }
  std::vector<int64_t> counts(static_cast<size_t>(p), block);
  comm.all_to_all_v(src, counts.data(), recv, counts.data());
  const bool replicated = hr * p != h;
  if (replicated) std::memset(x, 0, static_cast<size_t>(numel(out)) * sizeof(float));
  for (int q = 0; q < p; ++q) {
    const int64_t h0 = first_head(q, p, h, hr);
    const float* blk = recv + q * block;
    for (int64_t t = 0; t < b * sl; ++t) {
      float* dst = x + (t * h + h0) * d;
      const float* from = blk + t * hr * d;
      if (!replicated) {
        std::memcpy(dst, from, static_cast<size_t>(hr * d) * sizeof(float));
      } else {
        for (int64_t k = 0; k < d; ++k) dst[k] += from[k];
      }
    }
  }
}

void gather_seq(const BufferSpec& in, const int32_t* x, const BufferSpec& out, int32_t* y, Communicator& comm,
                std::vector<float>& scratch) {
  const int p = comm.size();
  const int64_t b = in.shape[0], sl = in.shape[1];
  check(in.rank == 2 && out.rank == 2 && out.shape[1] == sl * p, in, out, comm, "gather_seq");
  if (b == 1) {
    comm.all_gather(x, sl, y);
    return;
  }
  scratch.resize(static_cast<size_t>(b * sl * p));
  auto* recv = reinterpret_cast<int32_t*>(scratch.data());
  comm.all_gather(x, b * sl, recv);
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < b; ++i)
      std::memcpy(y + i * sl * p + q * sl, recv + (q * b + i) * sl, static_cast<size_t>(sl) * sizeof(int32_t));
}

}  // namespace

void run_collective(CallKind kind, const BufferSpec& in, const void* in_data, const BufferSpec& out, void* out_data,
                    Communicator& comm, std::vector<float>& scratch) {
  const bool f32 = in.type == ElemType::F32 && out.type == ElemType::F32;
  switch (kind) {
    case CallKind::SeqToHeads:
      check(f32, in, out, comm, "seq_to_heads");
      seq_to_heads(in, static_cast<const float*>(in_data), out, static_cast<float*>(out_data), comm, scratch);
      return;
    case CallKind::HeadsToSeq:
      check(f32, in, out, comm, "heads_to_seq");
      heads_to_seq(in, static_cast<const float*>(in_data), out, static_cast<float*>(out_data), comm, scratch);
      return;
    case CallKind::GatherSeq:
      check(in.type == ElemType::I32, in, out, comm, "gather_seq");
      gather_seq(in, static_cast<const int32_t*>(in_data), out, static_cast<int32_t*>(out_data), comm, scratch);
      return;
    case CallKind::AllReduce: {
      const int64_t n = numel(in);
      check(numel(out) == n && in.type == out.type && in.type != ElemType::I32, in, out, comm, "all_reduce");
      if (in.type == ElemType::F64) {
        if (out_data != in_data) std::memcpy(out_data, in_data, static_cast<size_t>(n) * sizeof(double));
        comm.all_reduce_sum(static_cast<double*>(out_data), n);
      } else {
        if (out_data != in_data) std::memcpy(out_data, in_data, static_cast<size_t>(n) * sizeof(float));
        comm.all_reduce_sum(static_cast<float*>(out_data), n);
      }
      return;
    }
    default:
      throw Error("error: call kind " + std::to_string(static_cast<int>(kind)) + " is not a buffer collective.");
  }
}

}  // namespace halyard::runtime
