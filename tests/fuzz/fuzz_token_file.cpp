// Fuzz target: token files and the batches cut from them (runtime/data.h).
//
// Contract under test: TokenFile::open / from_text on any file, slice() and
// read() on any range, and a Batcher over the file (or the slice) return data or throw
// runtime::Error naming the file and the numbers. Any other exception, a
// crash, a sanitizer report (a read outside the mapping, an int64 overflow in
// a range check or in an error message) or a hang is a bug. What is read keeps
// its promises: ids are below the vocab, a label is the next id or
// kIgnoreIndex, and the P ranks' slices of a step, padding dropped, are the
// one-rank batch (or all of them fail where it fails).
//
// Input: 31 bytes of parameters, then the file's bytes (written to a memfd,
// which TokenFile maps through /proc/self/fd like any path):
//   [0] width: %3 = uint16, uint32, text   [1] batch %4   [2] seq %40
//   [3..4] vocab (u16 LE)   [5] ranks %5   [6] rank (int8) %5
//   [7] replicas %3   [8] replica %3   [9] step
//   [10..17] read() start, [18..25] read() n (int64 LE; any value)
//   [26] odd: work on slice([27..28], [29..30]) (int16 LE each) of the file
// Short inputs are zero-padded.
//
// Corpus: tests/fuzz/corpus/token_file (windows of nanoGPT-style uint16 and
// uint32 files and of text, odd sizes, ids past the vocab, and inputs that once
// broke the reader). Run: see fuzz_safetensors.cpp.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/data.h"
#include "runtime/error.h"
#include "tests/fuzz/fuzz_check.h"

using halyard::runtime::Batcher;
using halyard::runtime::Error;
using halyard::runtime::kIgnoreIndex;
using halyard::runtime::Shard;
using halyard::runtime::TokenFile;
using halyard::runtime::TokenWidth;

namespace {

constexpr size_t kParams = 31;

// One memfd for the whole run, rewritten per input.
int file_fd() {
  static const int fd = [] {
    const int f = ::memfd_create("halyard_fuzz_tokens", MFD_CLOEXEC);
    HALYARD_FUZZ_REQUIRE(f >= 0, "memfd_create failed");
    return f;
  }();
  return fd;
}

void write_file(const uint8_t* data, size_t size) {
  const int fd = file_fd();
  HALYARD_FUZZ_REQUIRE(::ftruncate(fd, 0) == 0, "ftruncate of the memfd failed");
  for (size_t done = 0; done < size;) {
    const ssize_t k = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    HALYARD_FUZZ_REQUIRE(k > 0, "pwrite to the memfd failed");
    done += static_cast<size_t>(k);
  }
}

int64_t i64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return static_cast<int64_t>(v);
}

// The batch of `step` for `shard`, or false where it throws Error.
bool batch_of(const TokenFile& f, int64_t batch, int64_t seq, int64_t vocab, int64_t step, Shard shard,
              Batcher::Batch& out) {
  try {
    out = Batcher(f, batch, seq, vocab, /*seed=*/7, shard).get(step);
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  uint8_t p[kParams] = {};
  std::memcpy(p, data, size < kParams ? size : kParams);
  const uint8_t* body = data + (size < kParams ? size : kParams);
  const size_t body_size = size - (size < kParams ? size : kParams);
  write_file(body, body_size);
  const std::string path = "/proc/self/fd/" + std::to_string(file_fd());

  const int kind = p[0] % 3;
  const int64_t batch = p[1] % 4, seq = p[2] % 40, vocab = p[3] | (p[4] << 8), step = p[9];
  const Shard shard{static_cast<int8_t>(p[6]) % 5, p[5] % 5, p[8] % 3, p[7] % 3};

  std::vector<TokenFile> files;
  try {
    files.push_back(kind == 2 ? TokenFile::from_text(path)
                              : TokenFile::open(path, kind == 0 ? TokenWidth::U16 : TokenWidth::U32));
  } catch (const Error&) {
    return 0;  // empty, or a size that is not a multiple of the id width
  }
  HALYARD_FUZZ_REQUIRE(files[0].size() > 0 &&
                           files[0].size() * files[0].bytes_per_token() == static_cast<int64_t>(body_size),
                       "the token count does not match the file's size");
  if (p[26] % 2) {
    const int64_t begin = static_cast<int16_t>(p[27] | (p[28] << 8)), end = static_cast<int16_t>(p[29] | (p[30] << 8));
    try {
      files.push_back(files[0].slice(begin, end));
    } catch (const Error&) {
      return 0;
    }
    HALYARD_FUZZ_REQUIRE(files[1].size() == end - begin && files[1].first_token() == begin,
                         "a slice's size or start is not the range asked for");
  }
  const TokenFile& f = files.back();

  // read() on any range: inside, it fills exactly n ids; outside, it throws.
  std::vector<int32_t> ids(static_cast<size_t>(f.size()));
  try {
    f.read(i64_le(p + 10), i64_le(p + 18), ids.data());
  } catch (const Error&) {
  }

  // This rank's batch and, for the slices' promise, every rank's and one rank's.
  Batcher::Batch mine;
  if (!batch_of(f, batch, seq, vocab, step, shard, mine)) return 0;
  for (size_t i = 0; i < mine.input_ids.size(); ++i) {
    HALYARD_FUZZ_REQUIRE(mine.input_ids[i] >= 0 && mine.input_ids[i] < vocab, "an id outside [0, vocab)");
    HALYARD_FUZZ_REQUIRE(mine.labels[i] == kIgnoreIndex || (mine.labels[i] >= 0 && mine.labels[i] < vocab),
                         "a label that is neither an id nor kIgnoreIndex");
  }
  Batcher::Batch whole;
  const bool whole_ok = batch_of(f, batch, seq, vocab, step, {0, 1, shard.replica, shard.replicas}, whole);
  const int64_t local = (seq + shard.ranks - 1) / shard.ranks;
  bool all_ok = true;
  for (int r = 0; r < shard.ranks; ++r) {
    Batcher::Batch slice;
    if (!batch_of(f, batch, seq, vocab, step, {r, shard.ranks, shard.replica, shard.replicas}, slice)) {
      all_ok = false;
      continue;
    }
    if (!whole_ok) continue;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < local && r * local + t < seq; ++t) {
        const size_t at = static_cast<size_t>(b * local + t), in_whole = static_cast<size_t>(b * seq + r * local + t);
        HALYARD_FUZZ_REQUIRE(slice.input_ids[at] == whole.input_ids[in_whole] &&
                                 slice.labels[at] == whole.labels[in_whole] &&
                                 slice.position_ids[at] == whole.position_ids[in_whole],
                             "a rank's slice differs from the one-rank batch");
      }
  }
  HALYARD_FUZZ_REQUIRE(all_ok == whole_ok, "the ranks' slices and the one-rank batch disagree on failing");
  return 0;
}
