// The CUDA attention kernels (runtime/attention_cuda.cu) and their launcher's
// mapping of Halide buffers onto launches (attention_cuda.h), run on the CPU
// through an emulator (cuda_emulation.h) against the CPU library kernels:
// what can be checked of them without a GPU (test_cuda runs them on one).
// Shapes are small: every thread of a block runs in turn on one core.
#include "tests/runtime/cuda_emulation.h"
// (after the emulator, which it needs)
#include "runtime/attention_cuda.cu"

#include <HalideBuffer.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "runtime/attention_cuda.h"
#include "tests/attention_against_cpu.h"

namespace {

using halyard::runtime::attention_cuda::Launch;
using Halide::Runtime::Buffer;

#define HALYARD_KERNELS_OF(SUFFIX)                                                 \
  {"halyard_attention_fwd_" #SUFFIX, halyard_attention_fwd_##SUFFIX},              \
      {"halyard_attention_dq_" #SUFFIX, halyard_attention_dq_##SUFFIX},            \
      {"halyard_attention_dkdv_" #SUFFIX, halyard_attention_dkdv_##SUFFIX}

void run(const std::vector<Launch>& launches) {
  static const std::map<std::string, void (*)(Args)> kernels = {
      HALYARD_KERNELS_OF(8),       HALYARD_KERNELS_OF(16),      HALYARD_KERNELS_OF(32),
      HALYARD_KERNELS_OF(64),      HALYARD_KERNELS_OF(128),     HALYARD_KERNELS_OF(bf16_16),
      HALYARD_KERNELS_OF(bf16_32), HALYARD_KERNELS_OF(bf16_64), HALYARD_KERNELS_OF(bf16_128)};
  for (const Launch& l : launches) {
    const auto it = kernels.find(l.kernel);
    ASSERT_NE(it, kernels.end()) << l.kernel;
    cuda_emulation::launch(it->second, l.grid[0], l.grid[1], l.grid[2], l.threads, l.args);
  }
}

// Buffers whose device field is their host memory's address, which is what
// the launcher maps; cleared before they are freed.
struct AsDevice {
  std::vector<halide_buffer_t*> bufs;
  AsDevice(std::initializer_list<halide_buffer_t*> xs, halyard::testing::RingBlock* ring = nullptr) : bufs(xs) {
    if (ring) bufs.insert(bufs.end(), {ring->kidx.raw_buffer(), ring->qidx.raw_buffer()});
    for (halide_buffer_t* x : bufs) x->device = reinterpret_cast<uint64_t>(x->host);
  }
  ~AsDevice() {
    for (halide_buffer_t* x : bufs) x->device = 0;
  }
};

// The kernels' launches run in the emulator against the CPU library with the
// same bf16 (tests/attention_against_cpu.h), a ring block's where given;
// the largest error.
double check_emulated(int D, int H, int KV, double limit, bool bf16, halyard::testing::RingBlock* ring = nullptr,
                      int S = 70, int doc = 30) {
  halyard::runtime::attention_cpu::RingIndices idx;
  if (ring) idx = {ring->kidx, ring->qidx};
  return halyard::testing::check_attention_against_cpu(
      D, H, KV, S, doc, limit, bf16,
      [&](Buffer<float>& q, Buffer<float>& k, Buffer<float>& v, Buffer<int32_t>& pos, Buffer<float>& lse,
          Buffer<float>& o) {
        AsDevice on({q, k, v, pos, lse, o}, ring);
        std::vector<Launch> launches;
        ASSERT_EQ(
            halyard::runtime::attention_cuda::forward_launches(q, k, v, pos, lse, H, KV, D, bf16, o, &launches, idx),
            "");
        run(launches);
      },
      [&](Buffer<float>& q, Buffer<float>& k, Buffer<int32_t>& pos, Buffer<float>& lse) {
        AsDevice on({q, k, pos, lse}, ring);
        std::vector<Launch> launches;
        ASSERT_EQ(halyard::runtime::attention_cuda::lse_launches(q, k, pos, H, KV, D, bf16, lse, &launches, idx), "");
        run(launches);
      },
      [&](Buffer<float>& q, Buffer<float>& k, Buffer<float>& v, Buffer<int32_t>& pos, Buffer<float>& o,
          Buffer<float>& dO, Buffer<float>& lse, Buffer<float>& dv, Buffer<float>& dq, Buffer<float>& dk) {
        AsDevice on({q, k, v, pos, o, dO, lse, dv, dq, dk}, ring);
        std::vector<Launch> launches;
        ASSERT_EQ(halyard::runtime::attention_cuda::backward_launches(q, k, v, pos, o, dO, lse, dv, dq, H, KV, bf16, dk,
                                                                      &launches, idx),
                  "");
        run(launches);
      },
      ring);
}


// The kernels through the launcher's launches against the CPU library
// (tests/attention_against_cpu.h): head_dims the kernels are built for and
// ones they run padded, grouped queries, packed documents, rows not a
// multiple of a block, outputs holding only some heads.
TEST(AttentionCudaEmulated, KernelsMatchTheCpuLibrary) {
  for (int D : {8, 24, 48, 128}) {
    // (Wide head_dims have several threads a row, whose every shuffle the
    // emulator runs as two barriers of the block: fewer heads for those.)
    const bool wide = D > 32;
    check_emulated(D, wide ? 2 : 4, wide ? 1 : 2, 1e-5, false);
  }
}

// The bf16 kernels (tensor cores: the emulator's mma.sync reads PTX's
// fragment layouts) against the CPU library's bf16, which rounds the same
// values: they differ where a probability or a dS lands on the other side
// of a bf16 rounding, mostly in the forward, whose unnormalized
// probabilities are rounded against a running max that moves with the key
// blocks (32 or 64 keys here, 128 on the CPU). Measured (rms, Zen 4, 15
// runs): outputs 3.9e-4 at most, gradients 8e-5; with the long documents
// below (Zen 4, 5 runs each, these kernels and the ones before whole tiles
// went unmasked alike) outputs 3.5e-4 to 5.9e-4, gradients 5e-5; the
// CPU's bf16 against its f32, 2.5e-3 to 4.7e-3.
TEST(AttentionCudaEmulated, Bf16KernelsOnTensorCoresMatchTheCpuLibrarysBf16) {
  for (int D : {8, 24, 64, 128}) {
    const bool wide = D > 32;
    check_emulated(D, wide ? 2 : 4, wide ? 1 : 2, 1e-3, true);
  }
  // Documents longer than a tile: there a warp's rows see whole tiles of
  // the other side, which the kernels take without a mask (the second block
  // of 64 queries against the first 64 keys, say), beside the diagonal's
  // masked ones; one document, and two of 130 tokens.
  struct Long {
    int D, S, doc;
  };
  for (const Long c : {Long{16, 200, 200}, Long{64, 260, 130}, Long{128, 160, 160}})
    check_emulated(c.D, 2, 1, 1e-3, true, nullptr, c.S, c.doc);
  // The CPU library's bf16 against its f32: apart by bf16's rounding, far
  // more than the kernels are from it.
  const double apart = halyard::testing::check_attention_against_cpu(
      64, 4, 2, 70, 30, 1.0, true,
      [&](Buffer<float>& q, Buffer<float>& k, Buffer<float>& v, Buffer<int32_t>& pos, Buffer<float>& lse,
          Buffer<float>& o) { ASSERT_EQ(halyard_attention_forward_lse(q, k, v, pos, lse, 4, 2, 64, 0, 0, 0, o), 0); },
      [&](Buffer<float>& q, Buffer<float>& k, Buffer<int32_t>& pos, Buffer<float>& lse) {
        ASSERT_EQ(halyard_attention_lse(q, k, pos, 4, 2, 64, 0, 0, 0, lse), 0);
      },
      [&](Buffer<float>& q, Buffer<float>& k, Buffer<float>& v, Buffer<int32_t>& pos, Buffer<float>& o,
          Buffer<float>& dO, Buffer<float>& lse, Buffer<float>& dv, Buffer<float>& dq, Buffer<float>& dk) {
        ASSERT_EQ(halyard_attention_backward(q, k, v, pos, o, dO, lse, dv, dq, 4, 2, 0, 0, 0, dk), 0);
      });
  EXPECT_GT(apart, 1.5e-3);
  EXPECT_LT(apart, 2e-2);
}

// Ring attention's key blocks (Args::kidx, qidx) against the CPU library's
// _ring entry points, on 4 ranks of 70 tokens, the second row's second
// document starting at token 100 (on rank 1): the rank's own block; a
// block every query sees (from rank 0 on rank 2); one no query sees (rank
// 2's on rank 0: output 0, log-sum-exp kNoKeysLse, no gradient); zigzag
// blocks half seen; in f32 and bf16, with a head_dim run padded.
TEST(AttentionCudaEmulated, RingBlocksMatchTheCpuLibrarysRingEntryPoints) {
  static_assert(halyard::runtime::attention_cuda::kNoKeysLse == halyard::runtime::attention_cpu::kNoKeysLse);
  struct Case {
    int query_rank, key_rank;
    bool zigzag;
  };
  for (const Case c : {Case{1, 1, false}, Case{2, 0, false}, Case{0, 2, false}, Case{1, 1, true}, Case{1, 2, true},
                       Case{2, 1, true}, Case{3, 0, true}})
    for (bool bf16 : {false, true}) {
      halyard::testing::RingBlock ring = halyard::testing::ring_block(70, 4, c.query_rank, c.key_rank, c.zigzag);
      std::printf("queries of rank %d, keys of rank %d%s\n", c.query_rank, c.key_rank, c.zigzag ? ", zigzag" : "");
      check_emulated(bf16 ? 16 : 24, 4, 2, bf16 ? 1e-3 : 1e-5, bf16, &ring, 70, 100);
    }
}

// The dQ kernels adding their part to a running sum over a ring's key
// blocks (Args::dq_in; halyard_attention_backward_ring_add_cuda), over the
// sum itself or into another buffer: the sum plus the part the plain
// launches write, to rounding (the product and the add may fuse); dK and
// dV are the plain launches' to the bit. f32 (a head_dim run padded) and
// bf16 kernels.
TEST(AttentionCudaEmulated, DqKernelsAddTheirPartToTheRunningSum) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const bool bf16 : {false, true}) {
    const int S = 70, H = 4, KV = 2, B = 1, D = bf16 ? 16 : 24;
    halyard::testing::RingBlock ring = halyard::testing::ring_block(S, 4, 2, 1, true);
    const halyard::runtime::attention_cpu::RingIndices idx{ring.kidx, ring.qidx};
    Buffer<float> q(D, H, S, B), k(D, KV, S, B), v(D, KV, S, B), dO(D, H, S, B), o(D, H, S, B), lse(H, S, B);
    for (Buffer<float>* x : {&q, &k, &v, &dO}) x->for_each_value([&](float& e) { e = normal(rng); });
    Buffer<int32_t> pos(S, B);
    for (int i = 0; i < S; ++i) pos(i, 0) = i;
    ASSERT_EQ(halyard_attention_forward_lse_ring(q, k, v, pos, ring.kidx, ring.qidx, lse, H, KV, D, 0, 0, bf16, o), 0);
    auto backward = [&](Buffer<float>& dk, Buffer<float>& dv, Buffer<float>& dq, Buffer<float>* sum) {
      // (the sum, where there is none, is dq listed twice)
      AsDevice on({q, k, v, pos, o, dO, lse, dv, dq, dk, sum ? sum->raw_buffer() : dq.raw_buffer()}, &ring);
      std::vector<Launch> launches;
      ASSERT_EQ(halyard::runtime::attention_cuda::backward_launches(q, k, v, pos, o, dO, lse, dv, dq, H, KV, bf16, dk,
                                                                    &launches, idx, sum ? sum->raw_buffer() : nullptr),
                "");
      run(launches);
    };
    Buffer<float> dk(D, KV, S, B), dv(D, KV, S, B), part(D, H, S, B), sum(D, H, S, B);
    backward(dk, dv, part, nullptr);
    sum.for_each_value([&](float& e) { e = normal(rng); });
    for (const bool in_place : {false, true}) {
      Buffer<float> dk2(D, KV, S, B), dv2(D, KV, S, B), out(D, H, S, B), running = sum.copy();
      Buffer<float>& written = in_place ? running : out;
      backward(dk2, dv2, written, &running);
      double worst = 0;
      written.for_each_element([&](const int* at) {
        worst = std::max(worst, std::abs(double(written(at)) - (double(sum(at)) + double(part(at)))));
      });
      EXPECT_LE(worst, 1e-5) << (bf16 ? "bf16" : "f32") << (in_place ? ", in place" : "");
      EXPECT_EQ(std::memcmp(dk2.data(), dk.data(), dk.size_in_bytes()), 0);
      EXPECT_EQ(std::memcmp(dv2.data(), dv.data(), dv.size_in_bytes()), 0);
    }
  }
}

// A bf16 kernel's staging of a slab's rows into its tiles (row-major and
// transposed, in kslot's order), as float4s where the slab allows them, is
// the pair-at-a-time staging's, bit for bit: the same rows, from a copy of
// the slab one float off 16-byte alignment (which takes the pairs' path),
// with a tail of rows past n that both fill with zeros. So is the staging
// of the slab's bf16 copy (its 16 bits, as a schedule storing values in
// bf16 passes them), in 16-byte vectors where aligned, and a pair at a
// time from a copy one element off.
template <int DP>
void expect_float4_staging_as_pairs() {
  using T = Tc<DP>;
  const int ld = 3 * DP, r0 = 3, n = T::B - 5, rows_needed = r0 + T::B;
  std::vector<float> slab(static_cast<size_t>(rows_needed) * ld + 8);
  uint32_t seed = 12345;
  for (float& x : slab) {
    seed = seed * 1664525u + 1013904223u;
    x = static_cast<float>(static_cast<int>(seed >> 9) % 2001 - 1000) / 317.f;
  }
  float* aligned = slab.data();
  while (reinterpret_cast<uintptr_t>(aligned) % 16 != 0) ++aligned;
  std::vector<float> off(slab.size() + 8);
  float* misaligned = off.data();
  while (reinterpret_cast<uintptr_t>(misaligned) % 16 != 4) ++misaligned;
  std::copy(aligned, aligned + static_cast<size_t>(rows_needed) * ld, misaligned);
  // The bf16 copies: aligned, and one element off.
  std::vector<uint16_t> bits(2 * slab.size() + 32);
  uint16_t* bits_aligned = bits.data();
  while (reinterpret_cast<uintptr_t>(bits_aligned) % 16 != 0) ++bits_aligned;
  uint16_t* bits_off = bits_aligned + static_cast<size_t>(rows_needed) * ld + 9;
  for (size_t x = 0; x < static_cast<size_t>(rows_needed) * ld; ++x)
    bits_aligned[x] = bits_off[x] = static_cast<uint16_t>(pack_bf16(aligned[x], 0) & 0xffffu);
  const Operand from[4] = {{aligned, false}, {misaligned, false}, {bits_aligned, true}, {bits_off, true}};
  std::vector<uint16_t> rows[4], cols[4];
  for (int path = 0; path < 4; ++path) {
    rows[path].assign(T::B * T::LR, 0xdead);
    cols[path].assign(DP * T::LC, 0xdead);
    cuda_emulation::launch(
        [&](Operand src) { stage_bf16<DP>(rows[path].data(), cols[path].data(), src, ld, r0, n, DP); }, 1, 1, 1, 128,
        from[path]);
  }
  for (int path = 1; path < 4; ++path) {
    const char* what[] = {"", "the pairs' path", "bf16 in vectors", "bf16 a pair at a time"};
    EXPECT_EQ(rows[0], rows[path]) << "head_dim " << DP << ", " << what[path];
    EXPECT_EQ(cols[0], cols[path]) << "head_dim " << DP << ", " << what[path];
  }
  // (and the tiles hold the slab: row 1, element 2 of the run, in kslot's place)
  EXPECT_EQ(rows[0][1 * T::LR + kslot(2)], pack_bf16(aligned[(r0 + 1) * ld + 2], 0) & 0xffffu);
  EXPECT_EQ(cols[0][2 * T::LC + kslot(1)], pack_bf16(aligned[(r0 + 1) * ld + 2], 0) & 0xffffu);
}

TEST(AttentionCudaEmulated, StagingAsFloat4sIsThePairwiseStaging) {
  expect_float4_staging_as_pairs<16>();
  expect_float4_staging_as_pairs<32>();
  expect_float4_staging_as_pairs<64>();
  expect_float4_staging_as_pairs<128>();
}

// Operands in bf16 (uint16 buffers: the copies of values a schedule stores
// in bf16, read in place) give the bits that f32 operands holding the same
// values give (tests/attention_against_cpu.h), through the launcher: the
// forward, the log-sum-exp alone and the backward (O in bf16 too; dO, a
// gradient, is f32), in the f32 kernels and the bf16 ones, at head_dims
// whole (16-byte vectors) and padded (a pair at a time), and a ring
// block's; the bf16 kernels also from any f32 q, k and v, against their
// roundings. An operand of another type is refused.
TEST(AttentionCudaEmulated, Bf16OperandsGiveTheBitsOfTheirValuesInF32) {
  struct Case {
    int D;
    bool bf16, ring;
  };
  for (const Case c : {Case{24, false, false}, Case{32, false, true}, Case{16, true, false}, Case{24, true, false},
                       Case{64, true, true}})
    for (const bool rounding : {false, true}) {
      if (rounding && !c.bf16) continue;  // (the f32 kernels take operands as they are)
      const int S = 70, H = c.D > 32 ? 2 : 4, KV = c.D > 32 ? 1 : 2, D = c.D;
      halyard::testing::RingBlock block = halyard::testing::ring_block(S, 4, 1, 2, true);
      halyard::testing::RingBlock* ring = c.ring ? &block : nullptr;
      halyard::runtime::attention_cpu::RingIndices idx;
      if (ring) idx = {ring->kidx, ring->qidx};
      halyard::testing::expect_bf16_operands_give_f32_bits(
          D, H, KV, S, 30,
          [&](halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, Buffer<int32_t>& pos, Buffer<float>& lse,
              Buffer<float>& o) {
            AsDevice on({q, k, v, pos, lse, o}, ring);
            std::vector<Launch> launches;
            ASSERT_EQ(halyard::runtime::attention_cuda::forward_launches(q, k, v, pos, lse, H, KV, D, c.bf16, o,
                                                                         &launches, idx),
                      "");
            run(launches);
          },
          [&](halide_buffer_t* q, halide_buffer_t* k, Buffer<int32_t>& pos, Buffer<float>& lse) {
            AsDevice on({q, k, pos, lse}, ring);
            std::vector<Launch> launches;
            ASSERT_EQ(
                halyard::runtime::attention_cuda::lse_launches(q, k, pos, H, KV, D, c.bf16, lse, &launches, idx), "");
            run(launches);
          },
          [&](halide_buffer_t* q, halide_buffer_t* k, halide_buffer_t* v, Buffer<int32_t>& pos, halide_buffer_t* o,
              halide_buffer_t* dO, Buffer<float>& lse, Buffer<float>& dv, Buffer<float>& dq, Buffer<float>& dk) {
            AsDevice on({q, k, v, pos, o, dO, lse, dv, dq, dk}, ring);
            std::vector<Launch> launches;
            ASSERT_EQ(halyard::runtime::attention_cuda::backward_launches(q, k, v, pos, o, dO, lse, dv, dq, H, KV,
                                                                          c.bf16, dk, &launches, idx),
                      "");
            run(launches);
          },
          c.bf16 ? "bf16 kernels" : "f32 kernels", ring, false, rounding);
    }
  std::vector<Launch> launches;
  Buffer<float> q(32, 4, 8, 1), v(32, 2, 8, 1), o(32, 4, 8, 1);
  Buffer<int32_t> pos(8, 1), k(32, 2, 8, 1);
  EXPECT_EQ(halyard::runtime::attention_cuda::forward_launches(q, k, v, pos, nullptr, 4, 2, 32, false, o, &launches),
            "q, k, v and O must be f32, or bf16 as its 16 bits (uint16)");
}

// What the launcher refuses, before anything runs.
TEST(AttentionCudaEmulated, BadBuffersAreErrorsThatSayWhat) {
  std::vector<Launch> launches;
  Buffer<float> q(256, 4, 8, 1), k(256, 2, 8, 1), v(256, 2, 8, 1), o(256, 4, 8, 1);
  Buffer<int32_t> pos(8, 1);
  EXPECT_NE(halyard::runtime::attention_cuda::forward_launches(q, k, v, pos, nullptr, 4, 2, 256, false, o, &launches)
                .find("head_dim 256 is over the 128"),
            std::string::npos);
  Buffer<float> q3(32, 3, 8, 1), o3(32, 3, 8, 1), k3(32, 2, 8, 1), v3(32, 2, 8, 1);
  EXPECT_EQ(halyard::runtime::attention_cuda::forward_launches(q3, k3, v3, pos, nullptr, 3, 2, 32, false, o3, &launches),
            "kv_heads must divide heads");
  Buffer<int32_t> short_index(4, 1);
  EXPECT_EQ(halyard::runtime::attention_cuda::forward_launches(q3, k3, v3, pos, nullptr, 2, 2, 32, false, o3, &launches,
                                                               {short_index, short_index}),
            "a ring block's key and query indices must both be int32 [seq, batch] covering the rows");
}

}  // namespace
