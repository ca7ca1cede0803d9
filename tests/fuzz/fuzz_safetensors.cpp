// Fuzz target: the safetensors readers (runtime/safetensors.h), from bytes and
// from a mapped file.
//
// Contract under test: Safetensors::parse(bytes, what) and MappedSafetensors(path)
// return a checkpoint or throw runtime::Error naming the file. Any other
// exception (nlohmann's, std::out_of_range, std::bad_alloc from a size the
// header claims but the file does not hold), a crash, a sanitizer report or a
// hang is a bug in a reader. The two readers validate "exactly as" each other,
// so they accept the same files and see the same tensors, metadata and float
// values (read_f32 through its windows equals to_f32; first_non_finite finds
// the first NaN or infinity). What loads also survives serialize() -> parse()
// with the same tensors and metadata (the writer's contract), and every
// tensor's conversions either work or throw runtime::Error.
//
// The mapped reader maps a memfd through /proc/self/fd, as it would any path.
//
// Corpus: tests/fuzz/corpus/safetensors (small valid files cut from
// tests/fixtures/llama_micro.safetensors, one per dtype family, and inputs that
// once broke a reader; tests/fuzz/make_corpus.py writes the seeds). Run it
// (clang, libFuzzer; scripts/sanitize.sh builds it in build-san/):
//   build-san/tests/fuzz/fuzz_safetensors -max_total_time=60 /tmp/new tests/fuzz/corpus/safetensors
// `ctest -L fuzz` fuzzes each target for a bounded time and replays every
// corpus; with gcc the same source is linked with replay_main.cpp and replays.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/safetensors.h"
#include "tests/fuzz/fuzz_check.h"

using halyard::runtime::Dtype;
using halyard::runtime::Error;
using halyard::runtime::MappedSafetensors;
using halyard::runtime::Safetensors;

namespace {

// The input as a file: one memfd for the whole run, rewritten per input.
std::string as_file(const uint8_t* data, size_t size) {
  static const int fd = [] {
    const int f = ::memfd_create("halyard_fuzz_safetensors", MFD_CLOEXEC);
    HALYARD_FUZZ_REQUIRE(f >= 0, "memfd_create failed");
    return f;
  }();
  HALYARD_FUZZ_REQUIRE(::ftruncate(fd, 0) == 0, "ftruncate of the memfd failed");
  for (size_t done = 0; done < size;) {
    const ssize_t k = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    HALYARD_FUZZ_REQUIRE(k > 0, "pwrite to the memfd failed");
    done += static_cast<size_t>(k);
  }
  return "/proc/self/fd/" + std::to_string(fd);
}

bool is_float(Dtype t) { return t == Dtype::F64 || t == Dtype::F32 || t == Dtype::F16 || t == Dtype::BF16; }

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Reads every element through each conversion; wrong dtypes throw Error.
void convert_all(const Safetensors& st) {
  for (const std::string& name : st.names()) {
    try {
      (void)st.to_f32(name);
    } catch (const Error&) {
    }
    try {
      (void)st.to_i32(name);
    } catch (const Error&) {
    }
  }
}

// The mapped reader agrees with the in-memory one, tensor for tensor.
void compare_mapped(const Safetensors& st, const MappedSafetensors& m) {
  HALYARD_FUZZ_REQUIRE(m.names() == st.names(), "the readers see different tensors");
  HALYARD_FUZZ_REQUIRE(m.metadata() == st.metadata, "the readers see different metadata");
  for (const std::string& name : st.names()) {
    const auto& t = st.at(name);
    const auto& v = m.at(name);
    HALYARD_FUZZ_REQUIRE(v.dtype == t.dtype && v.shape == t.shape && v.bytes.size() == t.bytes.size() &&
                             std::equal(v.bytes.begin(), v.bytes.end(), t.bytes.begin()),
                         "the readers see a tensor differently");
    if (!is_float(t.dtype)) continue;
    const std::vector<float> want = st.to_f32(name);
    const std::vector<double> wide = st.to_f64(name);  // F64's NaN/inf are its own, not f32's overflow
    std::vector<float> got(want.size());
    m.read_f32(name, got.data());
    int64_t first_bad = -1;
    for (size_t i = 0; i < want.size(); ++i) {
      HALYARD_FUZZ_REQUIRE(same_bits(got[i], want[i]), "read_f32 differs from to_f32");
      if (first_bad < 0 && !std::isfinite(wide[i]))
        first_bad = static_cast<int64_t>(i);
    }
    HALYARD_FUZZ_REQUIRE(m.first_non_finite(name) == first_bad, "first_non_finite misses or invents a NaN/inf");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  bool parsed = true, mapped = true;
  Safetensors st;
  try {
    st = Safetensors::parse(std::span<const uint8_t>(data, size), "fuzz.safetensors");
  } catch (const Error&) {
    parsed = false;  // the documented answer to a bad file
  }
  std::vector<MappedSafetensors> m;
  try {
    m.emplace_back(as_file(data, size));
  } catch (const Error&) {
    mapped = false;
  }
  HALYARD_FUZZ_REQUIRE(parsed == mapped, parsed ? "only the mapped reader rejects this file"
                                                : "only the in-memory reader rejects this file");
  if (!parsed) return 0;
  convert_all(st);
  compare_mapped(st, m.front());

  // serialize() -> parse() keeps every tensor and the metadata.
  const std::vector<uint8_t> bytes = st.serialize();
  const Safetensors again = Safetensors::parse(bytes, "fuzz.safetensors (rewritten)");
  HALYARD_FUZZ_REQUIRE(again.names() == st.names(), "tensor names changed in a round trip");
  HALYARD_FUZZ_REQUIRE(again.metadata == st.metadata, "metadata changed in a round trip");
  for (const std::string& name : st.names()) {
    const auto &a = st.at(name), &b = again.at(name);
    HALYARD_FUZZ_REQUIRE(a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes,
                         "a tensor changed in a round trip");
  }
  return 0;
}
