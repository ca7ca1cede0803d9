// Process-wide allocator tuning for generated kernels (see model.h).
#include <malloc.h>

#include <mutex>

#include "runtime/model.h"

namespace halyard::runtime {

// Kernels allocate their per-tile scratch (a few MiB) inside parallel loops,
// thousands of times a step. With glibc's defaults those blocks are mmap'd or
// trimmed back to the OS on free, so every tile pays page faults: measured 7x
// on the attention backward at seq 4096. Kernels' temporaries come from the
// threads' scratch stacks (runtime/scratch.h; Model routes Halide's there),
// which keep their pages; what else a step allocates stays in the heap.
void keep_freed_memory() {
  static std::once_flag once;
  std::call_once(once, [] {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  });
}

}  // namespace halyard::runtime
