// One check of attention kernels against the CPU library's entry points
// (runtime/attention_cpu.h), shared by the CUDA kernels' device test
// (tests/generators/test_cuda.cpp) and their emulated run on the CPU
// (tests/runtime/test_attention_cuda_emulated.cpp): fresh random inputs, a
// batch of two rows (the second two packed documents), outputs poisoned
// with NaN so that every element must be written; then, where there are 4
// heads on 2 kv heads, outputs holding only heads 1 and 2 of the forward
// (and of the log-sum-exp alone) and kv head 1 of the backward, as a stage
// split over heads asks. With a ring block, the CPU's _ring entry points
// are the reference, and each row's positions follow its queries' indices
// in the whole row (the second row's second document starting at doc).
#pragma once

#include <HalideBuffer.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "runtime/attention_cpu.h"
#include "runtime/bf16.h"

namespace halyard::testing {

using Halide::Runtime::Buffer;

// A ring attention key block (attention_cpu.h: the _ring entry points):
// each key's and each query's index in the whole row, [seq, batch].
struct RingBlock {
  Buffer<int32_t> kidx, qidx;
};

// Rank r's tokens' indices in a row of sp ranks of S tokens each, placed as
// schedules/sharding.cpp places them: contiguous, or zigzag (chunks r and
// 2 sp - 1 - r of S / 2).
inline std::vector<int32_t> ring_token_indices(int64_t S, int64_t sp, int64_t r, bool zigzag) {
  std::vector<int32_t> idx;
  const int64_t half = S / 2;
  for (int64_t i = 0; i < S; ++i)
    idx.push_back(static_cast<int32_t>(!zigzag ? r * S + i : i < half ? r * half + i : (2 * sp - 1 - r) * half + i - half));
  return idx;
}

// The block of key_rank's tokens that query_rank's queries meet in that
// ring (two rows, [S, 2]).
inline RingBlock ring_block(int S, int sp, int query_rank, int key_rank, bool zigzag) {
  auto tokens = [&](int r) {
    const std::vector<int32_t> idx = ring_token_indices(S, sp, r, zigzag);
    Buffer<int32_t> x(S, 2);
    for (int b = 0; b < 2; ++b)
      for (int i = 0; i < S; ++i) x(i, b) = idx[static_cast<size_t>(i)];
    return x;
  };
  return {tokens(key_rank), tokens(query_rank)};
}

// max |got - want| / max |want| (rms: the root mean squares' ratio
// instead); NaN anywhere in got gives 1e30. A row's log-sum-exp that says it
// sees no key (attention_cpu.h: kNoKeysLse) must be that exactly, and is
// left out of the scale.
inline double attention_rel(const Buffer<float>& got, const Buffer<float>& want, bool rms = false) {
  double diff = 0, scale = 1e-30;
  bool nan = false;
  got.for_each_element([&](const int* at) {
    const double g = got(at), w = want(at);
    nan = nan || std::isnan(g);
    if (want(at) == runtime::attention_cpu::kNoKeysLse || got(at) == runtime::attention_cpu::kNoKeysLse) {
      nan = nan || got(at) != want(at);
      return;
    }
    diff = rms ? diff + (g - w) * (g - w) : std::max(diff, std::abs(g - w));
    scale = rms ? scale + w * w : std::max(scale, std::abs(w));
  });
  return nan ? 1e30 : rms ? std::sqrt(diff / scale) : diff / scale;
}

// The calls under test: forward(q, k, v, pos, lse, o), lse_alone(q, k, pos,
// lse) (the log-sum-exp a backward recomputes) and backward(q, k, v,
// pos, o, dO, lse, dv, dq, dk), with head counts and head_dim bound, each
// leaving its outputs readable on the host; against the CPU library with
// its bf16 (the products in bf16) as given, the backward given the CPU's
// forward outputs. Returns the largest error: of the largest elements in
// f32; in bf16 of the root mean squares, since one probability or dS
// rounded the other way moves a few elements by up to 2^-9 of the largest.
template <class Forward, class LseAlone, class Backward>
double check_attention_against_cpu(int D, int H, int KV, int S, int doc, double limit, bool bf16, Forward forward,
                                   LseAlone lse_alone, Backward backward, RingBlock* ring = nullptr) {
  const int B = 2;
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0, 1);
  auto random = [&](std::vector<int> shape) {
    Buffer<float> x(shape);
    x.for_each_value([&](float& e) { e = normal(rng); });
    return x;
  };
  auto poisoned = [](std::vector<int> shape, std::vector<int> mins = {}) {
    Buffer<float> x(shape);
    if (!mins.empty()) x.set_min(mins);
    x.fill(std::nanf(""));
    return x;
  };
  Buffer<float> q = random({D, H, S, B}), k = random({D, KV, S, B}), v = random({D, KV, S, B}),
                dO = random({D, H, S, B});
  Buffer<int32_t> pos(S, B);
  for (int i = 0; i < S; ++i) {
    const int q0 = ring ? ring->qidx(i, 0) : i, q1 = ring ? ring->qidx(i, 1) : i;
    pos(i, 0) = q0, pos(i, 1) = q1 < doc ? q1 : q1 - doc;
  }
  Buffer<float> o = poisoned({D, H, S, B}), lse = poisoned({H, S, B}), dk = poisoned({D, KV, S, B}),
                dv = poisoned({D, KV, S, B}), dq = poisoned({D, H, S, B});
  if (ring) {
    EXPECT_EQ(halyard_attention_forward_lse_ring(q, k, v, pos, ring->kidx, ring->qidx, lse, H, KV, D, 0, 0, bf16, o), 0);
    EXPECT_EQ(halyard_attention_backward_ring(q, k, v, pos, o, dO, lse, ring->kidx, ring->qidx, dv, dq, H, KV, 0, 0,
                                              bf16, dk),
              0);
  } else {
    EXPECT_EQ(halyard_attention_forward_lse(q, k, v, pos, lse, H, KV, D, 0, 0, bf16, o), 0);
    EXPECT_EQ(halyard_attention_backward(q, k, v, pos, o, dO, lse, dv, dq, H, KV, 0, 0, bf16, dk), 0);
  }

  Buffer<float> to = poisoned({D, H, S, B}), tlse = poisoned({H, S, B}), alone = poisoned({H, S, B}),
                tdk = poisoned({D, KV, S, B}), tdv = poisoned({D, KV, S, B}), tdq = poisoned({D, H, S, B});
  forward(q, k, v, pos, tlse, to);
  lse_alone(q, k, pos, alone);
  // (The backward reads the CPU's forward, so that its errors are its own.)
  backward(q, k, v, pos, o, dO, lse, tdv, tdq, tdk);
  const double e[6] = {attention_rel(to, o, bf16),      attention_rel(tlse, lse, bf16), attention_rel(alone, lse, bf16),
                       attention_rel(tdq, dq, bf16),    attention_rel(tdk, dk, bf16),   attention_rel(tdv, dv, bf16)};
  std::printf("  %shead_dim %3d, %d heads on %d%s: output %.1e, log-sum-exp %.1e (alone %.1e), dQ %.1e, dK %.1e, dV "
              "%.1e of the CPU's %s\n", ring ? "ring block, " : "", D, H, KV, bf16 ? ", bf16" : "", e[0], e[1], e[2], e[3], e[4], e[5],
              bf16 ? "rms" : "largest");
  for (double x : e) EXPECT_LE(x, limit) << "head_dim " << D;
  const double worst = *std::max_element(e, e + 6);
  if (H != 4 || KV != 2) return worst;

  Buffer<float> po = poisoned({D, 2, S, B}, {0, 1, 0, 0}), plse = poisoned({2, S, B}, {1, 0, 0}),
                pdk = poisoned({D, 1, S, B}, {0, 1, 0, 0}), pdv = poisoned({D, 1, S, B}, {0, 1, 0, 0}),
                pdq = poisoned({D, 2, S, B}, {0, 2, 0, 0});
  Buffer<float> palone = poisoned({2, S, B}, {1, 0, 0});
  forward(q, k, v, pos, plse, po);
  lse_alone(q, k, pos, palone);
  backward(q, k, v, pos, o, dO, lse, pdv, pdq, pdk);
  auto heads_like = [](const Buffer<float>& full, const Buffer<float>& like) {
    Buffer<float> x = full.copy();
    const int d = like.dimensions() - 3;  // the heads
    x.crop(d, like.dim(d).min(), like.dim(d).extent());
    return x;
  };
  EXPECT_LE(attention_rel(po, heads_like(o, po), bf16), limit) << "head_dim " << D << ": the output's heads 1 and 2";
  EXPECT_LE(attention_rel(plse, heads_like(lse, plse), bf16), limit) << "head_dim " << D;
  EXPECT_LE(attention_rel(palone, heads_like(lse, palone), bf16), limit) << "head_dim " << D << ": the log-sum-exp alone";
  EXPECT_LE(attention_rel(pdk, heads_like(dk, pdk), bf16), limit) << "head_dim " << D << ": kv head 1";
  EXPECT_LE(attention_rel(pdv, heads_like(dv, pdv), bf16), limit) << "head_dim " << D;
  EXPECT_LE(attention_rel(pdq, heads_like(dq, pdq), bf16), limit) << "head_dim " << D;
  return worst;
}

// Values rounded to bf16 (nearest, ties to even), of `from` or else random,
// as f32 and as their 16 bits: the f32 values a schedule storing them in
// bf16 computes with, and the copy (uint16) it passes the kernels.
inline std::pair<Buffer<float>, Buffer<uint16_t>> bf16_operand(std::vector<int> shape, std::mt19937& rng,
                                                               const Buffer<float>* from = nullptr) {
  std::normal_distribution<float> normal(0, 1);
  std::pair<Buffer<float>, Buffer<uint16_t>> x{Buffer<float>(shape), Buffer<uint16_t>(shape)};
  x.first.for_each_element([&](const int* at) {
    x.second(at) = runtime::bf16_bits(from ? (*from)(at) : normal(rng));
    x.first(at) = runtime::bf16_value(x.second(at));
  });
  return x;
}

// The calls under test, given q, k, v (and the backward's O) in bf16 as
// their 16 bits, give the bits they give from f32 operands holding the same
// values: forward(q, k, v, pos, lse, o), lse_alone(q, k, pos, lse) and
// backward(q, k, v, pos, o, dO, lse, dv, dq, dk), with the operands as
// halide_buffer_t* (f32 or uint16) and the outputs as f32 buffers left
// readable on the host. dO is f32 (a gradient), or in bf16 too where
// dO_too. Two rows, the second two packed documents (the second from doc);
// a ring block's indices where given. Where the calls round q, k and v to
// bf16 themselves (their products in bf16), `rounding` makes those f32
// operands any values, and the uint16 ones hold their roundings (nearest,
// ties to even): what a schedule passes as the bf16 copy of an operand it
// computes inline (schedules/partition.h: attention_copies_bf16).
template <class Forward, class LseAlone, class Backward>
void expect_bf16_operands_give_f32_bits(int D, int H, int KV, int S, int doc, Forward forward, LseAlone lse_alone,
                                        Backward backward, const std::string& what, RingBlock* ring = nullptr,
                                        bool dO_too = false, bool rounding = false) {
  const int B = 2;
  std::mt19937 rng(static_cast<unsigned>(D * 1000 + S));
  auto operand = [&](std::vector<int> shape) {
    if (!rounding) return bf16_operand(shape, rng);
    std::normal_distribution<float> normal(0, 1);
    Buffer<float> any(shape);
    any.for_each_value([&](float& e) { e = normal(rng); });
    auto x = bf16_operand(shape, rng, &any);
    x.first = any;
    return x;
  };
  auto [q, q16] = operand({D, H, S, B});
  auto [k, k16] = operand({D, KV, S, B});
  auto [v, v16] = operand({D, KV, S, B});
  auto [dO, dO16] = bf16_operand({D, H, S, B}, rng);
  Buffer<int32_t> pos(S, B);
  for (int i = 0; i < S; ++i) {
    const int q0 = ring ? ring->qidx(i, 0) : i, q1 = ring ? ring->qidx(i, 1) : i;
    pos(i, 0) = q0, pos(i, 1) = q1 < doc ? q1 : q1 - doc;
  }
  auto pair = [](std::vector<int> shape) { return std::vector<Buffer<float>>{Buffer<float>(shape), Buffer<float>(shape)}; };
  std::vector<Buffer<float>> o = pair({D, H, S, B}), lse = pair({H, S, B}), alone = pair({H, S, B}),
                             dq = pair({D, H, S, B}), dk = pair({D, KV, S, B}), dv = pair({D, KV, S, B});
  for (int x = 0; x < 2; ++x) {
    halide_buffer_t *qx = x ? q16.raw_buffer() : q.raw_buffer(), *kx = x ? k16.raw_buffer() : k.raw_buffer(),
                    *vx = x ? v16.raw_buffer() : v.raw_buffer();
    forward(qx, kx, vx, pos, lse[x], o[x]);
    lse_alone(qx, kx, pos, alone[x]);
  }
  auto [o32, o16] = bf16_operand({D, H, S, B}, rng, &o[0]);  // the output stored in bf16
  for (int x = 0; x < 2; ++x)
    backward(x ? q16.raw_buffer() : q.raw_buffer(), x ? k16.raw_buffer() : k.raw_buffer(),
             x ? v16.raw_buffer() : v.raw_buffer(), pos, x ? o16.raw_buffer() : o32.raw_buffer(),
             x && dO_too ? dO16.raw_buffer() : dO.raw_buffer(), lse[0], dv[x], dq[x], dk[x]);
  const std::pair<const char*, std::vector<Buffer<float>>*> outputs[] = {
      {"output", &o}, {"log-sum-exp", &lse}, {"log-sum-exp alone", &alone}, {"dK", &dk}, {"dV", &dv}, {"dQ", &dq}};
  for (const auto& [name, x] : outputs)
    EXPECT_EQ(std::memcmp((*x)[0].data(), (*x)[1].data(), (*x)[0].size_in_bytes()), 0)
        << name << ", head_dim " << D << ", " << what << (ring ? ", a ring block" : "")
        << (rounding ? ", q, k and v rounded by the calls" : "");
}

}  // namespace halyard::testing
