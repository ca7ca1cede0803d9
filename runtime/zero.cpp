// ZeRO-1 AdamW (see zero.h).
#include "runtime/zero.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "runtime/error.h"

namespace halyard::runtime {
namespace {

std::string range(int64_t begin, int64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

std::string param_at(size_t i, int64_t offset, int64_t size) {
  return "parameter " + std::to_string(i) + " (offset " + std::to_string(offset) + ", size " + std::to_string(size) +
         ", elements " + range(offset, offset + size) + ")";
}

}  // namespace

ZeroSlice zero_slice(int64_t total, int ranks, int rank, const std::vector<int64_t>& offsets,
                     const std::vector<int64_t>& sizes) {
  ZeroSlice s;
  s.block = total / ranks;
  s.begin = rank * s.block;
  s.end = rank == ranks - 1 ? total : s.begin + s.block;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t b = std::max(s.begin, offsets[i]), e = std::min(s.end, offsets[i] + sizes[i]);
    if (b < e) s.segments.push_back({i, b, e});
  }
  std::sort(s.segments.begin(), s.segments.end(),
            [](const ZeroSlice::Segment& a, const ZeroSlice::Segment& b) { return a.begin < b.begin; });
  return s;
}

ZeroAdamW::ZeroAdamW(Communicator& comm, int64_t total, std::vector<int64_t> offsets, std::vector<int64_t> sizes,
                     std::vector<bool> decay, AdamWConfig cfg)
    : comm_(comm),
      total_(total),
      offsets_(std::move(offsets)),
      sizes_(std::move(sizes)),
      decay_(std::move(decay)),
      cfg_(cfg) {
  if (total_ < 0)
    throw Error("error: ZeroAdamW: total is " + std::to_string(total_) +
                " elements; the flat parameter array cannot be shorter than 0.\nfix: pass the length of the flat "
                "array (the end of the last parameter plus any padding).");
  if (offsets_.size() != sizes_.size() || sizes_.size() != decay_.size())
    throw Error("error: ZeroAdamW got " + std::to_string(offsets_.size()) + " offsets, " +
                std::to_string(sizes_.size()) + " sizes and " + std::to_string(decay_.size()) +
                " decay flags; they describe the same parameters and must have the same length.\nfix: give one "
                "offset, one size and one decay flag per parameter.");
  for (size_t i = 0; i < sizes_.size(); ++i) {
    const int64_t o = offsets_[i], n = sizes_[i];
    if (o < 0 || n < 0)
      throw Error("error: ZeroAdamW: " + param_at(i, o, n) + ": offsets and sizes must be >= 0.\nfix: give " +
                  "parameter " + std::to_string(i) + " its element offset in the flat array and its number of "
                  "elements.");
    if (n > total_ - o)
      throw Error("error: ZeroAdamW: " + param_at(i, o, n) + " ends at element " + std::to_string(o + n) +
                  " but the flat array has total = " + std::to_string(total_) + " elements.\nfix: pass total >= " +
                  std::to_string(o + n) + " (the end of the last parameter plus its padding), or correct the " +
                  "offset or size of parameter " + std::to_string(i) + ".");
  }
  // Parameters in flat order; an overlap is with the one reaching furthest so far.
  std::vector<size_t> order(sizes_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  order.erase(std::remove_if(order.begin(), order.end(), [&](size_t i) { return sizes_[i] == 0; }), order.end());
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return offsets_[a] < offsets_[b]; });
  for (size_t k = 1, far = order.empty() ? 0 : order[0]; k < order.size(); ++k) {
    const size_t i = order[k];
    const int64_t far_end = offsets_[far] + sizes_[far];
    if (offsets_[i] < far_end)
      throw Error("error: ZeroAdamW: " + param_at(i, offsets_[i], sizes_[i]) + " overlaps " +
                  param_at(far, offsets_[far], sizes_[far]) + " in " +
                  std::to_string(std::min(far_end, offsets_[i] + sizes_[i]) - offsets_[i]) +
                  " elements; parameters must occupy disjoint ranges of the flat array.\nfix: start parameter " +
                  std::to_string(i) + " at offset >= " + std::to_string(far_end) + " (the end of parameter " +
                  std::to_string(far) + "), or correct the offsets and sizes.");
    if (offsets_[i] + sizes_[i] > far_end) far = i;
  }

  const int64_t P = comm_.size();
  ZeroSlice slice = zero_slice(total_, comm_.size(), comm_.rank(), offsets_, sizes_);
  block_ = slice.block, begin_ = slice.begin, end_ = slice.end;
  segments_ = std::move(slice.segments);
  m_.assign(static_cast<size_t>(end_ - begin_), 0.f);
  v_.assign(m_.size(), 0.f);
  grad_.assign(m_.size(), 0.f);
  tail_.assign(static_cast<size_t>(P * (total_ - P * block_)), 0.f);
}

double ZeroAdamW::step(int64_t t, double lr, float* params, float* grads, double max_norm) {
  // Checked before any communication, so that every rank throws the same way.
  if (t < 1)
    throw Error("error: ZeroAdamW::step: step is " + std::to_string(t) +
                "; steps count from 1 (bias correction divides by 1 - beta^step).\nfix: pass 1 for the first "
                "update, 2 for the second, ...");
  if (total_ > 0 && (params == nullptr || grads == nullptr))
    throw Error("error: ZeroAdamW::step: " + std::string(params == nullptr ? "params" : "grads") +
                " is null but must hold the flat array of " + std::to_string(total_) + " floats.");
  const int64_t P = comm_.size(), last = P - 1, tail_begin = P * block_, tail = total_ - tail_begin;
  const bool owns_tail = comm_.rank() == last;

  if (reduce_bf16_) comm_.reduce_scatter_sum_bf16(grads, grad_.data(), block_);
  else comm_.reduce_scatter_sum(grads, grad_.data(), block_);
  if (tail > 0) {
    // Only the last rank needs the sum, but a reduce to one rank is not among
    // the collectives; the tail is shorter than P elements.
    comm_.all_reduce_sum(grads + tail_begin, tail);
    if (owns_tail) std::copy(grads + tail_begin, grads + total_, grad_.begin() + block_);
  }

  double ss = 0;  // in double, like global_grad_norm, and over parameters only
  for (const Segment& s : segments_)
    for (int64_t j = s.begin - begin_; j < s.end - begin_; ++j)
      ss += static_cast<double>(grad_[static_cast<size_t>(j)]) * grad_[static_cast<size_t>(j)];
  const double norm = std::sqrt(comm_.all_reduce_sum(ss));

  const AdamWStepConstants k = adamw_step_constants(cfg_, t, lr, clip_scale(norm, max_norm));
  for (const Segment& s : segments_) {
    const size_t j = static_cast<size_t>(s.begin - begin_);
    adamw_update(k, decay_[s.param], params + s.begin, grad_.data() + j, m_.data() + j, v_.data() + j,
                 s.end - s.begin);
  }

  // all_gather's send must not overlap its receive buffer: send a copy.
  std::copy(params + begin_, params + begin_ + block_, grad_.begin());
  comm_.all_gather(grad_.data(), block_, params);
  if (tail > 0) {
    comm_.all_gather(params + tail_begin, tail, tail_.data());
    if (!owns_tail) std::copy(tail_.begin() + last * tail, tail_.end(), params + tail_begin);
  }
  return norm;
}

void ZeroAdamW::check_index(const char* what, size_t i) const {
  if (i < sizes_.size()) return;
  throw Error("error: ZeroAdamW::" + std::string(what) + ": parameter " + std::to_string(i) + " does not exist; " +
              (sizes_.empty() ? std::string("there are no parameters.")
                              : "there are " + std::to_string(sizes_.size()) + " (0.." +
                                    std::to_string(sizes_.size() - 1) + ")."));
}

void ZeroAdamW::gather_moments(size_t i, std::vector<float>& m, std::vector<float>& v) const {
  check_index("gather_moments", i);
  // Each rank fills its part and zeros elsewhere; x + 0 is exact, so a sum
  // over ranks assembles the moments without rounding.
  const int64_t n = sizes_[i], o = offsets_[i];
  std::vector<float> mv(static_cast<size_t>(2 * n), 0.f);
  for (int64_t j = std::max(begin_, o); j < std::min(end_, o + n); ++j) {
    mv[static_cast<size_t>(j - o)] = m_[static_cast<size_t>(j - begin_)];
    mv[static_cast<size_t>(n + j - o)] = v_[static_cast<size_t>(j - begin_)];
  }
  comm_.all_reduce_sum(mv.data(), 2 * n);
  m.assign(mv.begin(), mv.begin() + n);
  v.assign(mv.begin() + n, mv.end());
}

void ZeroAdamW::set_moments(size_t i, const std::vector<float>& m, const std::vector<float>& v) {
  check_index("set_moments", i);
  const int64_t n = sizes_[i], o = offsets_[i];
  if (m.size() != static_cast<size_t>(n) || v.size() != static_cast<size_t>(n))
    throw Error("error: ZeroAdamW::set_moments: parameter " + std::to_string(i) + " has " + std::to_string(n) +
                " elements but got m of " + std::to_string(m.size()) + " and v of " + std::to_string(v.size()) +
                " floats.\nfix: pass the full moments of the parameter, " + std::to_string(n) +
                " floats each, on every rank.");
  for (int64_t j = std::max(begin_, o); j < std::min(end_, o + n); ++j) {
    m_[static_cast<size_t>(j - begin_)] = m[static_cast<size_t>(j - o)];
    v_[static_cast<size_t>(j - begin_)] = v[static_cast<size_t>(j - o)];
  }
}

}  // namespace halyard::runtime
