// Small helpers shared by the benchmark programs: median timing, peak RSS,
// and threads spread over the CPUs.
#pragma once

#include <dirent.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <vector>

namespace halyard::bench {

// Median wall time in seconds of `reps` runs of f after one warm-up run.
inline double median_seconds(const std::function<void()>& f, int reps) {
  f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

inline double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

// Pins the calling thread to the first CPU it may run on and every other
// thread of the process, in the order they were started, round-robin to the
// rest (Linux; elsewhere, and with one CPU, nothing). A pool's workers, all
// started together, so land on CPUs of their own. Why: after a pause every
// pool's workers sleep, and on a KVM guest a call then woke its worker onto
// the caller's vCPU, where both halves of every call ran one after the
// other for as long as the calls kept coming (a 64 x 256 weight gradient at
// 85 GFLOP/s in one run and 155 in the next, Eigen's 256 x 256 at 120 or
// 160; Zen 4, 2 vCPUs). Idempotent: call it again once a new pool started.
inline void spread_threads() {
#ifdef __linux__
  // The CPUs the process was given, read before the first call pinned this
  // thread to one of them.
  static const std::vector<int> cpus = [] {
    std::vector<int> v;
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) == 0)
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &allowed)) v.push_back(c);
    return v;
  }();
  if (cpus.size() < 2) return;
  std::vector<pid_t> tids;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') tids.push_back(static_cast<pid_t>(std::atoi(e->d_name)));
    closedir(d);
  }
  std::sort(tids.begin(), tids.end());
  auto pin = [](pid_t tid, int cpu) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    sched_setaffinity(tid, sizeof one, &one);
  };
  const pid_t self = gettid();
  pin(self, cpus[0]);
  size_t k = 0;
  for (pid_t t : tids)
    if (t != self) pin(t, cpus[1 + k++ % (cpus.size() - 1)]);
#endif
}

}  // namespace halyard::bench
