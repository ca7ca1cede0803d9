// The collectives of a generated step program, performed between kernels.
//
// Layouts are the DSL's (row-major, batch outermost). With P ranks and B
// batch rows, rank r holds tokens [r*S/P, (r+1)*S/P) of each row:
//
//   seq_to_heads: x[B, S/P, H, d] -> y[B, S, Hr, d]. Rank r receives every
//     rank's tokens for its heads: [r*H/P, (r+1)*H/P) when P divides H; when H
//     divides P (kv heads fewer than ranks) the single head r*H/P, which P/H
//     ranks then hold as replicas.
//   heads_to_seq: the transpose: y[B, S, Hr, d] -> x[B, S/P, H, d]; replicas
//     of one head are summed (in rank order, so every run adds alike).
//   gather_seq: i32 p[B, S/P] -> [B, S].
//   all_reduce: the sum over ranks, in place of a copy.
//
// `scratch` grows to the largest message and is reused; buffers are host
// memory (the executor copies device data home first).
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/comm.h"
#include "runtime/step_program.h"

namespace halyard::runtime {

void run_collective(CallKind kind, const BufferSpec& in, const void* in_data, const BufferSpec& out, void* out_data,
                    Communicator& comm, std::vector<float>& scratch);

}  // namespace halyard::runtime
