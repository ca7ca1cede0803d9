// One rank's sequence-parallel train step, and the single-rank reference it
// must equal. Shared by the in-process test (test_sp.cpp: ranks are threads)
// and the MPI one (sp_mpi_main.cpp: ranks are processes under mpirun).
//
// Every rank initializes the same parameters (seed), takes its slice of the
// same batch of the bundled corpus (runtime::Batcher with its Shard: labels
// shifted before the split, global positions or packed documents' own,
// padding past seq), and runs
// forward_loss and train_step. The generated step sums the loss over ranks
// and the gradients over the mesh, so each rank's loss and gradients are
// compared with the reference's whole.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "examples/llama/llama_config.h"
#include "runtime/comm.h"
#include "runtime/data.h"
#include "runtime/model.h"

namespace halyard::sp_check {

inline const std::string kCorpus = std::string(HALYARD_SOURCE_DIR) + "/examples/llama/data/corpus.txt";
// Packed documents for the tests: every word of the corpus is one (it ends
// with the space after it), a dozen or more to a row of 128 tokens.
inline const runtime::Packing kWords{' ', {}};

struct StepResult {
  double forward_loss = 0, loss = 0;
  std::vector<std::vector<float>> grads;
  int64_t a2a_forward_bytes = 0, a2a_train_bytes = 0;  // sent to other ranks, from the comm's counter
  int64_t p2p_forward_bytes = 0, p2p_train_bytes = 0;  // ring passes (send), likewise
  runtime::Model::StepTimes train_times;  // of the train step (after the forward)
  int64_t device_bytes = 0, flat_size = 0, arena_bytes = 0;  // Model's, after the train step
};

// `comm`: this rank's sp group (null on one rank); `mesh`: every rank of a
// dp x sp mesh, this rank in data-parallel replica `replica` of `replicas`.
inline StepResult run_step(const runtime::ModelSpec& spec, runtime::Communicator* comm,
                           runtime::Communicator* mesh = nullptr, int replica = 0, int replicas = 1,
                           int64_t step = 3, uint64_t seed = 5, const runtime::Packing& packing = {}) {
  runtime::Model m(spec, comm, mesh);
  m.init_params(seed);
  const int rank = comm ? comm->rank() : 0, ranks = comm ? comm->size() : 1;
  const runtime::Batcher batcher(runtime::TokenFile::from_text(kCorpus), spec.batch, spec.seq, spec.vocab, seed,
                                 runtime::Shard{rank, ranks, replica, replicas, runtime::zigzag_layout(spec)}, packing);
  const auto b = batcher.get(step);
  m.reset_bytes_sent();
  StepResult r;
  r.forward_loss = m.forward_loss(b.input_ids.data(), b.labels.data(), b.position_ids.data());
  r.a2a_forward_bytes = m.all_to_all_bytes_sent(), r.p2p_forward_bytes = m.p2p_bytes_sent();
  m.reset_bytes_sent();
  r.loss = m.train_step(b.input_ids.data(), b.labels.data(), b.position_ids.data());
  r.a2a_train_bytes = m.all_to_all_bytes_sent(), r.p2p_train_bytes = m.p2p_bytes_sent();
  r.train_times = m.last_step_times();
  r.device_bytes = m.device_bytes(), r.flat_size = m.flat_size(), r.arena_bytes = m.arena_bytes();
  for (int i = 0; i < m.num_params(); ++i) r.grads.emplace_back(m.grad(i), m.grad(i) + m.param_spec(i).numel);
  return r;
}

// One step of `spec` on `ranks` in-process ranks (threads); (*errors)[r] is
// rank r's exception message, "" when it ran.
inline std::vector<StepResult> run_in_process(const runtime::ModelSpec& spec, int ranks, std::vector<std::string>* errors,
                                              const runtime::Packing& packing = {}) {
  auto comms = runtime::make_in_process_group(ranks, 120);
  std::vector<StepResult> out(static_cast<size_t>(ranks));
  errors->assign(static_cast<size_t>(ranks), "");
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        out[static_cast<size_t>(r)] = run_step(spec, comms[static_cast<size_t>(r)].get(), nullptr, 0, 1, 3, 5, packing);
      } catch (const std::exception& e) {
        (*errors)[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

// The single-rank reference of a dp x 1 mesh: each replica's rows stepped on
// one rank, combined as the whole mesh's batch would be, weighted by each
// replica's real tokens (the loss is the sum over tokens / the count).
inline StepResult data_parallel_reference(const runtime::ModelSpec& spec, int replicas, int64_t step = 3,
                                          uint64_t seed = 5) {
  StepResult total;
  double count = 0;
  for (int d = 0; d < replicas; ++d) {
    const StepResult r = run_step(spec, nullptr, nullptr, d, replicas, step, seed);
    const auto labels = runtime::Batcher(runtime::TokenFile::from_text(kCorpus), spec.batch, spec.seq, spec.vocab, seed,
                                         runtime::Shard{0, 1, d, replicas})
                            .get(step)
                            .labels;
    double c = 0;
    for (int32_t l : labels) c += l != spec.ignore_index;
    if (d == 0) {
      total.grads.assign(r.grads.size(), {});
      for (size_t i = 0; i < r.grads.size(); ++i) total.grads[i].assign(r.grads[i].size(), 0.f);
    }
    total.loss += r.loss * c;
    total.forward_loss += r.forward_loss * c;
    for (size_t i = 0; i < r.grads.size(); ++i)
      for (size_t k = 0; k < r.grads[i].size(); ++k) total.grads[i][k] += static_cast<float>(r.grads[i][k] * c);
    count += c;
  }
  total.loss /= count;
  total.forward_loss /= count;
  for (auto& g : total.grads)
    for (float& x : g) x = static_cast<float>(x / count);
  return total;
}

// max |got - ref| / max |ref| over one tensor.
inline double rel_error(const std::vector<float>& got, const std::vector<float>& ref) {
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - ref[i]));
    scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
  }
  return diff / scale;
}

struct Comparison {
  double loss = 0, forward_loss = 0, worst_grad = 0;
  std::string worst_param;
};

inline Comparison compare(const runtime::ModelSpec& spec, const StepResult& got, const StepResult& ref) {
  Comparison c;
  c.loss = std::abs(got.loss - ref.loss) / std::abs(ref.loss);
  c.forward_loss = std::abs(got.forward_loss - ref.forward_loss) / std::abs(ref.forward_loss);
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    const double e = rel_error(got.grads[i], ref.grads[i]);
    if (e >= c.worst_grad) c.worst_grad = e, c.worst_param = spec.params[i].name;
  }
  return c;
}

// Ulysses' forward all-to-all volume per rank and layer, (2h + 2h_kv)·N/P
// bytes with h = heads·head_dim·4 (q and the output) and h_kv likewise (k, v)
// over N tokens of the whole batch; kv heads fewer than P are sent once per
// rank that holds a replica (h_kv counts P heads). The comm's counter leaves
// out the block a rank keeps: (P-1)/P of the formula leaves the rank.
struct Volume {
  int layers = 0;
  double formula = 0, over_the_wire = 0;  // per layer and rank
};
inline Volume ulysses_forward_bytes(const llama::LlamaConfig& c, const runtime::ModelSpec& spec, int p) {
  const double n = static_cast<double>(spec.batch * spec.local_seq * p);
  const double h = static_cast<double>(c.num_attention_heads * c.head_dim * 4);
  const double h_kv = static_cast<double>(std::max<int64_t>(c.num_key_value_heads, p) * c.head_dim * 4);
  Volume v;
  v.layers = static_cast<int>(c.num_hidden_layers);
  v.formula = (2 * h + 2 * h_kv) * n / p;
  v.over_the_wire = v.formula * (p - 1) / p;
  return v;
}

// Ring attention's volume per rank and layer: the forward passes the local
// k and v blocks (and their i32 token indices) P-1 times around the ring,
// 2·N·h_kv·(P−1)/P floats with h_kv = kv_heads·head_dim over N tokens; the
// backward passes dK and dV back the same number of times.
struct RingVolume {
  int layers = 0;
  double forward = 0, indices = 0, backward = 0;  // bytes per layer and rank
};
// Hybrid (ulysses u x ring r = p): the ring runs across r groups of u
// ranks, each rank holding its group's u slices for the kv heads it got
// from the all-to-all (kv_heads / u, or one replica when kv_heads < u).
inline RingVolume ring_bytes(const llama::LlamaConfig& c, const runtime::ModelSpec& spec, int p, int u = 1) {
  const double tokens = static_cast<double>(spec.batch * spec.local_seq * u);  // per rank of the ring
  const int64_t kv = c.num_key_value_heads;
  const double kv_per_rank = static_cast<double>(u == 1 ? kv : kv >= u ? kv / u : 1);
  const int r = p / u;
  RingVolume v;
  v.layers = static_cast<int>(c.num_hidden_layers);
  v.forward = 2 * tokens * kv_per_rank * static_cast<double>(c.head_dim) * (r - 1) * 4;
  v.indices = tokens * (r - 1) * 4;
  v.backward = v.forward;
  return v;
}

// The forward volume a rank measured, per layer, against the formula: within 5%.
inline bool volume_matches(const StepResult& r, const Volume& v) {
  const double per_layer = static_cast<double>(r.a2a_forward_bytes) / v.layers;
  return std::abs(per_layer - v.over_the_wire) <= 0.05 * v.over_the_wire;
}

}  // namespace halyard::sp_check
