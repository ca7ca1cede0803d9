// Learning-rate schedule and per-rank thread count for training loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <thread>

namespace halyard::runtime {

// Linear warmup to `peak` over `warmup` steps, then cosine decay to
// `floor_frac * peak` at `total` steps. Steps count from 1.
inline double warmup_cosine_lr(int step, int total, int warmup, double peak, double floor_frac = 0.1) {
  if (warmup > 0 && step <= warmup) return peak * step / warmup;
  const double progress = std::clamp(static_cast<double>(step - warmup) / std::max(1, total - warmup), 0.0, 1.0);
  return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + std::cos(M_PI * progress)));
}

// Halide worker threads for one rank: the machine's cores shared among the
// ranks on this node (mpirun sets OMPI_COMM_WORLD_LOCAL_SIZE), so that
// oversubscribed ranks do not fight over cores. At least 1.
inline int default_threads_per_rank() {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  int local = 1;
  if (const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) local = std::max(1, std::atoi(s));
  return std::max(1, static_cast<int>(cores) / local);
}

}  // namespace halyard::runtime
