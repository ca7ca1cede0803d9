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

void check(bool ok, const BufferSpec& in, const BufferSpec& out, int ranks, const char* backend, const char* what) {
  if (!ok)
    throw Error(std::string("error: collective ") + what + " from \"" + in.name + "\" to \"" + out.name +
                "\" does not fit " + std::to_string(ranks) + " ranks (" + backend +
                ").\nthe library was generated for another mesh; rebuild it for this one.");
}

CollectivePlan seq_to_heads(const BufferSpec& in, const BufferSpec& out, int p) {
  const int64_t b = in.shape[0], sl = in.shape[1], h = in.shape[2], d = in.shape[3], hr = out.shape[2];
  const int64_t block = b * sl * hr * d;  // elements to each rank
  CollectivePlan plan;
  plan.staging = (b == 1 ? 1 : 2) * block * p;
  for (int r = 0; r < p; ++r)
    plan.pack.push_back({Area::In, Area::Staging, first_head(r, p, h, hr) * d, h * d, r * block, hr * d, hr * d, b * sl});
  plan.transfer = Transfer::AllToAll;
  plan.count = block;
  plan.from = Area::Staging;
  // One row: rank q's block is exactly y's tokens [q*sl, (q+1)*sl), so it lands in place.
  if (b == 1) return plan.to = Area::Out, plan;
  plan.to = Area::Staging;
  plan.to_offset = block * p;
  const int64_t row = sl * hr * d;
  for (int q = 0; q < p; ++q)
    plan.unpack.push_back({Area::Staging, Area::Out, block * p + q * block, row, q * row, sl * p * hr * d, row, b});
  return plan;
}

CollectivePlan heads_to_seq(const BufferSpec& in, const BufferSpec& out, int p) {
  const int64_t b = in.shape[0], s = in.shape[1], hr = in.shape[2], d = in.shape[3], h = out.shape[2];
  const int64_t sl = s / p, block = b * sl * hr * d, row = sl * hr * d;
  CollectivePlan plan;
  plan.transfer = Transfer::AllToAll;
  plan.count = block;
  plan.to = Area::Staging;
  if (b == 1) {  // rank q's block is y's tokens [q*sl, (q+1)*sl) as they stand
    plan.staging = block * p;
  } else {
    plan.staging = 2 * block * p;
    for (int q = 0; q < p; ++q)
      plan.pack.push_back({Area::In, Area::Staging, q * row, s * hr * d, q * block, row, row, b});
    plan.from = Area::Staging;
    plan.to_offset = block * p;
  }
  const bool replicated = hr * p != h;  // replicas of a head are summed
  if (replicated) plan.zero_out = numel(out);
  for (int q = 0; q < p; ++q)
    plan.unpack.push_back({Area::Staging, Area::Out, plan.to_offset + q * block, hr * d, first_head(q, p, h, hr) * d,
                           h * d, hr * d, b * sl, replicated});
  return plan;
}

CollectivePlan gather_seq(const BufferSpec& in, int p) {
  const int64_t b = in.shape[0], sl = in.shape[1];
  CollectivePlan plan;
  plan.type = CommType::I32;
  plan.transfer = Transfer::AllGather;
  plan.count = b * sl;
  if (b == 1) return plan.to = Area::Out, plan;
  plan.to = Area::Staging;
  plan.staging = b * sl * p;
  for (int q = 0; q < p; ++q) plan.unpack.push_back({Area::Staging, Area::Out, q * b * sl, sl, q * sl, sl * p, sl, b});
  return plan;
}

}  // namespace

CollectivePlan plan_collective(CallKind kind, const BufferSpec& in, const BufferSpec& out, int p, const char* backend) {
  const bool f32 = in.type == ElemType::F32 && out.type == ElemType::F32;
  switch (kind) {
    case CallKind::SeqToHeads:
      check(f32 && in.rank == 4 && out.rank == 4 && out.shape[1] == in.shape[1] * p &&
                (out.shape[2] * p == in.shape[2] || (out.shape[2] == 1 && p % in.shape[2] == 0)),
            in, out, p, backend, "seq_to_heads");
      return seq_to_heads(in, out, p);
    case CallKind::HeadsToSeq:
      check(f32 && in.rank == 4 && out.rank == 4 && out.shape[1] * p == in.shape[1] &&
                (in.shape[2] * p == out.shape[2] || (in.shape[2] == 1 && p % out.shape[2] == 0)),
            in, out, p, backend, "heads_to_seq");
      return heads_to_seq(in, out, p);
    case CallKind::GatherSeq:
      check(in.type == ElemType::I32 && out.type == ElemType::I32 && in.rank == 2 && out.rank == 2 &&
                out.shape[1] == in.shape[1] * p,
            in, out, p, backend, "gather_seq");
      return gather_seq(in, p);
    case CallKind::AllReduce: {
      const int64_t n = numel(in);
      check(numel(out) == n && in.type == out.type && (in.type == ElemType::F32 || in.type == ElemType::F64), in, out,
            p, backend, "all_reduce");
      CollectivePlan plan;
      plan.type = in.type == ElemType::F64 ? CommType::F64 : CommType::F32;
      plan.pack.push_back({Area::In, Area::Out, 0, n, 0, n, n, 1});  // (nothing to copy when in is out)
      plan.from = plan.to = Area::Out;
      plan.count = n;
      return plan;
    }
    default:
      throw Error("error: call kind " + std::to_string(static_cast<int>(kind)) + " is not a buffer collective.");
  }
}

void* HostCollectiveMemory::staging(int64_t bytes, int slot) {
  if (staging_.size() <= static_cast<size_t>(slot)) staging_.resize(static_cast<size_t>(slot) + 1);
  std::vector<float>& area = staging_[static_cast<size_t>(slot)];
  const auto floats = static_cast<size_t>((bytes + 3) / 4);
  if (area.size() < floats) area.resize(floats);
  return area.data();
}

void HostCollectiveMemory::rows(const Rows& r, const void* src, void* dst, int64_t elem_bytes) {
  const auto* s = static_cast<const char*>(src);
  auto* t = static_cast<char*>(dst);
  for (int64_t i = 0; i < r.count; ++i) {
    const char* from = s + (r.src_offset + i * r.src_pitch) * elem_bytes;
    char* to = t + (r.dst_offset + i * r.dst_pitch) * elem_bytes;
    if (!r.add) {
      std::memcpy(to, from, static_cast<size_t>(r.width * elem_bytes));
      continue;
    }
    const auto* a = reinterpret_cast<const float*>(from);
    auto* y = reinterpret_cast<float*>(to);
    for (int64_t k = 0; k < r.width; ++k) y[k] += a[k];
  }
}

void HostCollectiveMemory::zero(void* dst, int64_t bytes) { std::memset(dst, 0, static_cast<size_t>(bytes)); }

void check_ordered(const Communicator* comm, const CollectiveMemory& memory) {
  if (comm == nullptr || memory.stream() == nullptr || !comm->moves_device_memory()) return;
  if (comm->runs_after() == memory.stream()) return;
  throw Error(std::string("error: a collective on device memory over ") + comm->backend() + " (rank " +
              std::to_string(comm->rank()) + " of " + std::to_string(comm->size()) +
              ") whose calls do not wait for the stream its copies run on: the transfer could read rows before "
              "they are written.\nfix: comm.use_streams(runtime_cuda_context().comm_stream, "
              "runtime_cuda_context().stream) first (a Model over NCCL does so).");
}

namespace {

// The start of area `a` of a plan's call.
char* area(Area a, const void* in, void* out, char* staging) {
  return static_cast<char*>(a == Area::In ? const_cast<void*>(in) : a == Area::Out ? out : staging);
}

void run_rows(const Rows& r, const void* in, void* out, char* staging, int64_t esize, CollectiveMemory& memory) {
  char* src = area(r.src, in, out, staging);
  char* dst = area(r.dst, in, out, staging);
  // A sum over ranks in place of its input has nothing to copy.
  if (!r.add && src + r.src_offset * esize == dst + r.dst_offset * esize) return;
  memory.rows(r, src, dst, esize);
}

}  // namespace

StartedPlan start_plan(CollectivePlan plan, const void* in, void* out, Communicator* comm, CollectiveMemory& memory,
                       int slot) {
  check_ordered(comm, memory);
  StartedPlan s;
  s.plan = std::move(plan);
  s.out = out;
  const CollectivePlan& p = s.plan;
  const int64_t esize = comm_type_size(p.type);
  s.staging = p.staging ? static_cast<char*>(memory.staging(p.staging * esize, slot)) : nullptr;
  for (const Rows& r : p.pack) run_rows(r, in, out, s.staging, esize, memory);
  char* from = area(p.from, in, out, s.staging) + p.from_offset * esize;
  char* to = area(p.to, in, out, s.staging) + p.to_offset * esize;
  if (!comm) {  // one rank: what it sends itself is what it receives, and a sum of one is the value
    if (p.transfer != Transfer::AllReduce)
      run_rows({p.from, p.to, p.from_offset, p.count, p.to_offset, p.count, p.count, 1}, in, out, s.staging, esize,
               memory);
  } else if (p.transfer == Transfer::AllToAll) {
    const std::vector<int64_t> counts(static_cast<size_t>(comm->size()), p.count);
    if (p.type != CommType::F32) throw Error("error: an all-to-all of a step moves f32 only.");
    s.transfer = comm->start_all_to_all_v(reinterpret_cast<const float*>(from), counts.data(),
                                          reinterpret_cast<float*>(to), counts.data());
  } else if (p.transfer == Transfer::AllGather) {
    if (p.type == CommType::I32)
      comm->all_gather(reinterpret_cast<const int32_t*>(from), p.count, reinterpret_cast<int32_t*>(to));
    else
      comm->all_gather(reinterpret_cast<const float*>(from), p.count, reinterpret_cast<float*>(to));
  } else if (p.type == CommType::F64) {
    comm->all_reduce_sum(reinterpret_cast<double*>(to), p.count);
  } else {
    comm->all_reduce_sum(reinterpret_cast<float*>(to), p.count);
  }
  return s;
}

void finish_plan(StartedPlan& s, CollectiveMemory& memory) {
  if (s.transfer) memory.join(std::move(s.transfer));
  const int64_t esize = comm_type_size(s.plan.type);
  if (s.plan.zero_out) memory.zero(s.out, s.plan.zero_out * esize);
  // (The unpack reads the staging area and writes `out`, never `in`.)
  for (const Rows& r : s.plan.unpack) run_rows(r, nullptr, s.out, s.staging, esize, memory);
}

void run_plan(CollectivePlan plan, const void* in, void* out, Communicator* comm, CollectiveMemory& memory) {
  StartedPlan s = start_plan(std::move(plan), in, out, comm, memory);
  if (s.transfer) s.transfer->wait();  // (the host waits, as a blocking call does)
  finish_plan(s, memory);
}

void run_collective(CallKind kind, const BufferSpec& in, const void* in_data, const BufferSpec& out, void* out_data,
                    Communicator& comm, CollectiveMemory& memory) {
  run_plan(plan_collective(kind, in, out, comm.size(), comm.backend()), in_data, out_data, &comm, memory);
}

}  // namespace halyard::runtime
