// When an offloaded value's copies may run, if they run beside the kernels
// (on a communication stream) instead of where the program calls them.
//
// An Offload call copies a value's device bytes home, and from there the
// plan gives those bytes to other buffers: the copy may start at its call,
// and must be done before the first later call that touches a buffer
// sharing any of those bytes. A Reload copies the value back over bytes
// other buffers used meanwhile: it may start once the last call between
// the Offload and it that touches such a buffer is done, and must be done
// before the first later call that touches the value's bytes. "Touches"
// counts every argument, read or written, and a collective's Wait as well
// as its start (it runs in between). Device-independent: the executor's
// CUDA path turns each window into events on its streams, and tests run
// every copy at the edge of its window to check the windows.
#pragma once

#include <vector>

#include "runtime/step_program.h"

namespace halyard::runtime {

struct CopyWindow {
  int call;    // the Offload or Reload call
  int start;   // the copy may start once calls [0, start) are done
  int finish;  // and must be done before call `finish` starts (num_calls: the step's end)
};

// One window per Offload and Reload call of `p`, in program order.
std::vector<CopyWindow> copy_windows(const ProgramSpec& p);

}  // namespace halyard::runtime
