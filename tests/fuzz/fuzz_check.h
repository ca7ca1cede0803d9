// What the fuzz targets share: a check that aborts with a message.
//
// A target lets its parser's documented error type pass and checks what the
// parser promises of the inputs it accepts (round trips, invariants); a broken
// promise aborts through HALYARD_FUZZ_REQUIRE, which libFuzzer (and the replay
// main) report as a crash with the input saved.
#pragma once

#include <cstdio>
#include <cstdlib>

#define HALYARD_FUZZ_REQUIRE(cond, what)                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s\n  %s\n", __FILE__, __LINE__, #cond, \
                   what);                                                                 \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)
