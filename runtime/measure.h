// Measurements of this process and machine, to set a plan's predictions of
// memory and time per rank beside what a run actually does.
//
//   int64_t rss = current_rss_bytes(), peak = peak_rss_bytes();      // this process, now / so far
//   LinearFit a2a = measure_collective(*comm, CollectiveKind::AllToAll, {4096, 65536, 1 << 20}, 10);
//   double t = a2a.alpha_s + a2a.beta_s_per_byte * bytes;            // predicted seconds of one call
//   double bw = measure_memory_bandwidth_bytes_per_s(4);             // triad bytes per second
//   nlohmann::json machine = calibrate_machine(comm.get(), 4);      // all of the above, as one object
//
// Contract:
// - Memory figures are exact bytes of resident memory (Linux /proc), never MiB.
// - Collective timings are the time the slowest rank spends in the call, taken
//   after a barrier: a collective is done when its last rank is. Every rank
//   gets bitwise the same fit, so a plan built from it agrees across ranks.
// - Bytes of a collective are the bytes this rank SENDS in the call, i.e. the
//   size of its send buffer:
//     all_to_all  the whole send buffer of all_to_all_v with equal blocks, the
//                 block a rank keeps for itself included (a plan knows the
//                 local slice of a tensor, not the part that leaves the rank;
//                 Communicator::all_to_all_bytes_sent() counts only the latter);
//     all_reduce  the f32 array reduced in place (all_reduce_sum);
//     all_gather  this rank's f32 block (it receives size() times as much).
// - Functions taking a Communicator are collectives: every rank calls them with
//   the same arguments in the same order. Nothing here asserts a speed: the
//   numbers describe the machine, whatever it is.
// - Bad arguments (no sizes, a negative size, reps or threads below 1) throw
//   Error before anything is sent.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/comm.h"

namespace halyard::runtime {

// Resident memory of this process now: /proc/self/statm's resident pages times
// the page size. Throws Error where /proc is missing (not Linux).
int64_t current_rss_bytes();
// The most resident memory this process has had (VmHWM of /proc/self/status;
// where that is missing, getrusage's ru_maxrss * 1024).
int64_t peak_rss_bytes();
// Returns freed heap to the system and restarts the peak from the current
// resident memory (Linux clear_refs "5"), so that one phase of a process can
// be measured apart from the ones before it. False where the kernel refuses.
bool reset_peak_rss();

// RingShift: ring attention's pass, each rank sending its buffer to the next
// rank and receiving the previous one's (Communicator::start_exchange).
enum class CollectiveKind { AllToAll, AllReduce, AllGather, RingShift };
inline constexpr CollectiveKind kCollectiveKinds[] = {CollectiveKind::AllToAll, CollectiveKind::AllReduce,
                                                      CollectiveKind::AllGather, CollectiveKind::RingShift};
// "all_to_all", "all_reduce", "all_gather", "ring_shift": the keys of
// calibrate_machine's JSON (and of the plan's collective coefficients).
const char* collective_kind_name(CollectiveKind kind);

// t = alpha_s + beta_s_per_byte * bytes, fitted to the sizes measured by least
// squares of the relative error (fit - measured) / measured, so that the
// latency-bound small sizes count as much as the large ones; both coefficients
// are held >= 0 (a call takes no negative time and does not get faster with
// more bytes; when noise makes the free fit negative, the best fit on that
// boundary is taken). rms_rel_error: the root mean square of that relative
// error over the sizes: how far to trust the line.
struct LinearFit {
  double alpha_s = 0, beta_s_per_byte = 0;
  double rms_rel_error = 0;
};

// The fit above of times t (seconds) against sizes x (bytes, or any size a
// cost grows with, e.g. flops of a kernel). Throws Error unless there is one
// time per size and at least two different sizes.
LinearFit fit_linear(const std::vector<double>& x, const std::vector<double>& t);

// Times `kind` on `comm` at each size of bytes_per_rank (bytes this rank sends,
// see above; rounded down to whole f32 elements, and for all_to_all to equal
// blocks per rank; at least two distinct sizes): one warm-up call, then `reps`
// calls each after a barrier; a call's time is the maximum over ranks, a
// size's the median over reps. Fits the medians against the bytes actually sent.
LinearFit measure_collective(Communicator& comm, CollectiveKind kind, const std::vector<int64_t>& bytes_per_rank,
                             int reps);

// STREAM's triad a[i] = b[i] + s * c[i] over three arrays of 64 MiB of doubles
// (far beyond any L3), split over `threads` threads, each touching its part
// first. Best of 5 runs. Counts 24 bytes per element: b and c read, a written
// (the write-allocate read of a is not counted, as STREAM does not).
double measure_memory_bandwidth_bytes_per_s(int threads);

// The machine as a plan's cost model sees it (collective when comm is given):
//   {"cpu": "<model name of /proc/cpuinfo>", "cores": <logical CPUs>,
//    "threads_per_rank": threads, "ranks": <comm size, or 1>,
//    "memory_bandwidth_bytes_per_s": <per rank, all ranks streaming at once; the slowest rank's>,
//    "process_baseline_bytes": <this rank's resident memory when called>,
//    "collectives": {"all_to_all": {"alpha_s", "beta_s_per_byte", "rms_rel_error"},
//                    "all_reduce": {...}, "all_gather": {...}}}
// "collectives" only when comm has more than one rank; sizes 4 KiB, 16 KiB, ...,
// 4 MiB. Every field but process_baseline_bytes is the same on every rank.
nlohmann::json calibrate_machine(Communicator* comm, int threads);

// The line a training program prints for a plan (the JSON object a generator
// stores in ModelSpec::plan_json), e.g.
//   plan: predicted peak 41.2 MiB per rank (params: 3.1, arena: 20.5), predicted step 0.052 s
// from "predicted_peak_bytes_per_rank", "memory_per_rank" (name -> bytes) and
// "predicted_step_s"; keys that are absent are left out, and with none of them
// it returns "".
std::string describe_plan(const nlohmann::ordered_json& plan);

// The lines before it that say what the schedule does and, when SCHEDULE
// autosp chose it ("autosp" in the plan), why: the mesh and ZeRO stage, the
// attention strategy, the sequence tiles, which modules (and modules' tiles)
// are recomputed, partly recomputed and kept, the budget and what one rank
// alone would need, e.g.
//   schedule "autosp": mesh dp=1 x sp=4, ZeRO-1; attention ulysses; sequence tiles: mlp and loss 128 tokens
//     recomputed in the backward: self_attn.o_proj, self_attn.residual, ...
//     partly recomputed: lm_head
//     kept from the forward: model.embed_tokens, self_attn, ..., mlp.gate_proj tiles, lm_head tiles
//     chosen by AutoSP for 4 ranks x 88.0 MiB (212 plans scored in 2.3 s); one rank alone
//     would need 245.1 MiB saving everything, 113.0 MiB with every layer checkpointed
// Each line ends in "\n"; "" when the plan has no "schedule_spec".
std::string describe_schedule(const nlohmann::ordered_json& plan);

}  // namespace halyard::runtime
