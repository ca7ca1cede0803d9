// ZeRO-1: AdamW with its moments sharded over the ranks of a Communicator.
//
// The model keeps every parameter in one flat f32 array and the gradients in a
// second array of the same layout: parameter i is [offsets[i], offsets[i] +
// sizes[i]); elements outside every parameter are alignment padding, never
// updated. Rank r of P owns the slice [shard_begin(), shard_end()): elements
// [r * q, (r + 1) * q) with q = total / P, the last rank also the total % P (< P)
// elements after P * q. It keeps m and v only for that slice, so its state is
// 2 * total / P floats (plus < P), instead of 2 * total.
//
//   ZeroAdamW opt(*comm, total, offsets, sizes, decay);   // same layout on every rank
//   double norm = opt.step(t, lr, params, grads, 1.0);    // grads: this rank's partial sums
//
// Contract:
// - Every rank constructs with the same layout and config, and calls step(),
//   gather_moments() (collectives) with the same arguments in the same order.
//   The constructor and set_moments() do not communicate.
// - step() gives every rank the parameters runtime::AdamW would compute on the
//   gradients summed over ranks, with the same global-norm clipping: the update
//   is the same code (adamw_update), and only the gradient norm is summed in a
//   different order (so the clip factor can differ in its last bits).
// - Padding elements of params are left as they are (zeros stay zeros), and
//   padding in grads is ignored, also by the norm.
// - params, grads and the state are host memory: the update runs on the CPU,
//   so the communicator must take host buffers (in-process, MPI).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/adamw.h"
#include "runtime/comm.h"

namespace halyard::runtime {

// Rank `rank`'s slice of a flat array of `total` elements over `ranks`:
// equal blocks of total / ranks elements (so that reduce-scatter and
// all-gather work on the flat arrays in place), the remainder (< ranks
// elements) the last rank's too; and the runs of each parameter (offsets,
// sizes: elements) inside it, in flat order. ZeroAdamW keeps its state by
// it, and so does a GPU model's ZeRO-1 on the device (Model::use_zero_adamw).
struct ZeroSlice {
  struct Segment {
    size_t param;
    int64_t begin, end;  // flat element range
  };
  int64_t block = 0, begin = 0, end = 0;
  std::vector<Segment> segments;
};
ZeroSlice zero_slice(int64_t total, int ranks, int rank, const std::vector<int64_t>& offsets,
                     const std::vector<int64_t>& sizes);

class ZeroAdamW {
 public:
  // Throws Error when the layout is inconsistent (counts that disagree, negative
  // offsets or sizes, a parameter past `total`, parameters that overlap).
  ZeroAdamW(Communicator& comm, int64_t total, std::vector<int64_t> offsets, std::vector<int64_t> sizes,
            std::vector<bool> decay, AdamWConfig cfg = {});

  // One update, step = 1, 2, ... (collective). `grads` holds this rank's partial
  // gradients, not yet summed over ranks; it is used as scratch and holds
  // nothing useful afterwards. Sums them over ranks (each rank only its slice),
  // clips by clip_scale(norm, max_norm) (max_norm <= 0: no clipping), updates
  // this rank's slice of `params` and gathers the slices so that every rank
  // holds all parameters. Returns the global gradient L2 norm before clipping.
  double step(int64_t step, double lr, float* params, float* grads, double max_norm);
  // Whether step() reduce-scatters the gradients in bf16, summed in f32
  // (Communicator::reduce_scatter_sum_bf16): half the bytes. Default f32.
  void set_reduce_bf16(bool on) { reduce_bf16_ = on; }

  int64_t total() const { return total_; }
  size_t num_params() const { return sizes_.size(); }
  // This rank's element range of the flat array (empty on some ranks when total < P).
  int64_t shard_begin() const { return begin_; }
  int64_t shard_end() const { return end_; }
  // Bytes of optimizer state (m and v) this rank holds.
  int64_t state_bytes() const { return static_cast<int64_t>((m_.size() + v_.size()) * sizeof(float)); }

  // Checkpoints. gather_moments is collective: every rank gets the full moments
  // of parameter i (sizes[i] floats each). set_moments is local: every rank
  // passes the full moments and keeps its slice.
  void gather_moments(size_t i, std::vector<float>& m, std::vector<float>& v) const;
  void set_moments(size_t i, const std::vector<float>& m, const std::vector<float>& v);

 private:
  using Segment = ZeroSlice::Segment;
  void check_index(const char* what, size_t i) const;

  Communicator& comm_;
  int64_t total_ = 0;
  std::vector<int64_t> offsets_, sizes_;
  std::vector<bool> decay_;
  AdamWConfig cfg_;
  int64_t block_ = 0;  // q: elements every rank owns; the last rank owns the rest too
  int64_t begin_ = 0, end_ = 0;
  std::vector<Segment> segments_;  // in flat order
  std::vector<float> m_, v_;       // indexed by flat element - begin_
  // Scratch of step(): this rank's summed gradients, then its updated slice to
  // gather; and the gathered last-rank tails (P * (total % P) floats).
  std::vector<float> grad_, tail_;
  bool reduce_bf16_ = false;
};

}  // namespace halyard::runtime
