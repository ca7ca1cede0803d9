// Linked into the programs scripts/gpu_check.sh carries to GPU nodes
// (halyard_portable in CMakeLists.txt), which link libstdc++ statically.
// GCC 12's libstdc++ built on glibc 2.36 calls arc4random (new in glibc 2.36)
// for std::random_device, which would make the programs refuse to load on
// any older glibc (Ubuntu 22.04 has 2.35). This definition, from getrandom
// (glibc 2.25), is found first, so the programs need no glibc newer than 2.34.
#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>

extern "C" uint32_t arc4random(void) {
  uint32_t v = 0;
  for (;;) {
    const ssize_t n = getrandom(&v, sizeof v, 0);
    if (n == static_cast<ssize_t>(sizeof v)) return v;
    if (n < 0 && errno != EINTR) std::abort();  // as glibc's arc4random: it never fails quietly
  }
}
