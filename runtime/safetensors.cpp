// Safetensors reader and writer; the contract is in safetensors.h.
//
// Reading maps the file (runtime/file_io.h): the header is parsed through a
// mapping of the whole file, tensor data is copied or converted through
// windows of kMappedChunkBytes mapped one at a time, so that reading adds at
// most one window to resident memory beyond what the caller keeps.
//
// Validation runs in file order (prefix, header, each entry, then the layout of
// the whole buffer) so that the first problem reported is the most basic one: a
// truncated file says "truncated", not "tensor x has the wrong size".
#include "runtime/safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "runtime/bf16.h"
#include "runtime/error.h"

namespace halyard::runtime {

// Tensor bytes are little-endian on disk and are reinterpreted in place.
static_assert(std::endian::native == std::endian::little,
              "safetensors.cpp assumes a little-endian host");

namespace {

using Json = nlohmann::json;

// The reference implementation's limit is 100 MB; 100 MiB is as generous and
// stops a garbage prefix from making us parse gigabytes as JSON.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr const char* kMetadataKey = "__metadata__";

[[noreturn]] void fail_file(const std::string& what, const std::string& detail) {
  throw Error("error: safetensors file " + quote(what) + "\n" + detail);
}

// A JSON value for an error message, cut short if long.
std::string brief(const Json& j) {
  std::string s = j.dump();
  return s.size() <= 60 ? s : s.substr(0, 57) + "...";
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string legal_dtypes() {
  std::string s;
  for (Dtype t : all_dtypes()) s += (s.empty() ? "" : ", ") + std::string(dtype_name(t));
  return s;
}

// numel * dtype_size in bytes, or nullopt if it does not fit in int64. Dims must
// be non-negative. A zero dim makes the tensor empty whatever the others are, so
// [2^62, 2^62, 0] is legal and [2^62, 2^62] is not.
std::optional<uint64_t> checked_byte_size(const std::vector<int64_t>& shape, Dtype t) {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  uint64_t bytes = dtype_size(t);
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) return std::nullopt;
  }
  if (bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return bytes;
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Parses the header, remembering the first duplicate key: nlohmann keeps the
// last value silently, and two entries for one tensor mean a corrupt writer.
Json parse_header(std::string_view text, const std::string& what) {
  struct Scope {
    std::set<std::string> keys;
    std::string owner;  // the key whose value this object is; empty at top level
  };
  std::vector<Scope> scopes;
  std::string last_key, duplicate, duplicate_owner;
  bool top_level_duplicate = false;
  auto callback = [&](int, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        scopes.push_back({{}, scopes.empty() ? "" : last_key});
        break;
      case Json::parse_event_t::object_end:
        scopes.pop_back();
        break;
      case Json::parse_event_t::key:
        last_key = parsed.get<std::string>();
        if (!scopes.back().keys.insert(last_key).second && duplicate.empty()) {
          duplicate = last_key;
          duplicate_owner = scopes.back().owner;
          top_level_duplicate = scopes.size() == 1;
        }
        break;
      default:
        break;
    }
    return true;
  };
  Json header;
  try {
    header = Json::parse(text.begin(), text.end(), callback);
  } catch (const Json::exception& e) {
    fail_file(what, "header (" + std::to_string(text.size()) +
                        " bytes after the 8-byte length) is not valid JSON: " + e.what() +
                        "\nthe file is corrupt or not a safetensors file; re-export it.");
  }
  if (!duplicate.empty()) {
    std::string where = top_level_duplicate ? "at the top level of the header"
                                            : "inside the value of " + quote(duplicate_owner);
    fail_file(what, "header JSON has the key " + quote(duplicate) + " twice, " + where +
                        ".\neach key may appear once; the writer of this file is broken.");
  }
  return header;
}

void check_metadata(const Json& m, const std::string& what) {
  if (m.is_null()) return;  // the reference implementation accepts null as "none"
  if (!m.is_object()) {
    fail_file(what, std::string("\"__metadata__\" is a JSON ") + m.type_name() + " (" + brief(m) +
                        "); it must be an object mapping strings to strings.");
  }
  for (const auto& [key, value] : m.items()) {
    if (!value.is_string()) {
      fail_file(what, "\"__metadata__\" key " + quote(key) + " has the JSON " + value.type_name() +
                          " value " + brief(value) +
                          "; metadata values must be strings (write \"12\", not 12).");
    }
  }
}

struct Span {
  uint64_t begin, end;
  std::string name;
};

// Validates one entry and returns the tensor (bytes not yet copied) and its span.
Tensor check_entry(const std::string& name, const Json& e, uint64_t buffer_bytes,
                   uint64_t data_start, uint64_t file_bytes, const std::string& what, Span& span) {
  const std::string who = "tensor " + quote(name);
  const std::string layout =
      "expected {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [begin, end]}";
  if (!e.is_object()) {
    fail_file(what, who + ": entry is a JSON " + e.type_name() + " (" + brief(e) + "); " + layout +
                        ".");
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!e.contains(field)) {
      fail_file(what, who + ": entry " + brief(e) + " lacks \"" + field +
                          "\"; every entry needs \"dtype\", \"shape\" and \"data_offsets\".");
    }
  }
  Tensor t;
  const Json& dt = e["dtype"];
  std::optional<Dtype> dtype = dt.is_string() ? dtype_from_name(dt.get<std::string>()) : std::nullopt;
  if (!dtype) {
    fail_file(what, who + ": unknown dtype " + brief(dt) + ".\nlegal dtypes: " + legal_dtypes());
  }
  t.dtype = *dtype;

  const Json& sh = e["shape"];
  if (!sh.is_array()) {
    fail_file(what, who + ": \"shape\" is " + brief(sh) +
                        "; it must be an array of non-negative integers ([] for a scalar).");
  }
  for (size_t i = 0; i < sh.size(); ++i) {
    const Json& d = sh[i];
    if (!d.is_number_unsigned() ||
        d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      // is_number_integer() also holds for unsigned values, so test those first.
      std::string why = d.is_number_unsigned()  ? "exceeds 2^63 - 1"
                        : d.is_number_integer() ? "is negative"
                                                : "is not an integer";
      fail_file(what, who + ": shape " + brief(sh) + " has dimension " + std::to_string(i) + " = " +
                          brief(d) + ", which " + why +
                          "; dimensions must be non-negative integers.");
    }
    t.shape.push_back(d.get<int64_t>());
  }

  const Json& off = e["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned()) {
    fail_file(what, who + ": \"data_offsets\" is " + brief(off) +
                        "; it must be two non-negative integers [begin, end].");
  }
  uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
  std::string offsets = "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
  if (begin > end) {
    fail_file(what, who + ": data_offsets " + offsets + " have begin " + std::to_string(begin) +
                        " > end " + std::to_string(end) + "; begin must be <= end.");
  }
  if (end > buffer_bytes) {
    std::string needed = end > std::numeric_limits<uint64_t>::max() - data_start
                             ? "more than 2^64"
                             : std::to_string(data_start + end);
    fail_file(what, who + ": data_offsets " + offsets + " end past the data buffer, which has " +
                        std::to_string(buffer_bytes) + " bytes; this tensor needs " +
                        std::to_string(end) + ".\nthe file needs at least " + needed +
                        " bytes but has " + std::to_string(file_bytes) +
                        ": it is truncated; re-copy or re-export it.");
  }
  std::optional<uint64_t> expected = checked_byte_size(t.shape, t.dtype);
  std::string type = std::string(dtype_name(t.dtype)) + shape_string(t.shape);
  if (!expected) {
    fail_file(what, who + " " + type + ": numel * " + std::to_string(dtype_size(t.dtype)) +
                        " bytes does not fit in 63 bits; the shape is corrupt.");
  }
  if (end - begin != *expected) {
    uint64_t numel = dtype_size(t.dtype) ? *expected / dtype_size(t.dtype) : 0;
    fail_file(what, who + " " + type + ": data_offsets " + offsets + " span " +
                        std::to_string(end - begin) + " bytes, but " + std::to_string(numel) +
                        " elements of " + std::string(dtype_name(t.dtype)) + " (" +
                        std::to_string(dtype_size(t.dtype)) + " bytes each) need " +
                        std::to_string(*expected) +
                        " bytes.\nthe header disagrees with itself; the writer is broken or the "
                        "file is corrupt.");
  }
  span = {begin, end, name};
  return t;
}

// The spec requires every buffer byte to belong to exactly one tensor.
void check_layout(std::vector<Span> spans, uint64_t buffer_bytes, const std::string& what) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  auto range = [](const Span& s) {
    return quote(s.name) + " [" + std::to_string(s.begin) + ", " + std::to_string(s.end) + ")";
  };
  uint64_t cursor = 0;
  const Span* prev = nullptr;
  for (const Span& s : spans) {
    if (s.begin < cursor) {
      fail_file(what, "tensors " + range(*prev) + " and " + range(s) +
                          " overlap.\nevery byte of the data buffer must belong to exactly one "
                          "tensor.");
    }
    if (s.begin > cursor) {
      std::string after = prev ? "after " + range(*prev) : "at the start of the buffer";
      fail_file(what, "bytes [" + std::to_string(cursor) + ", " + std::to_string(s.begin) +
                          ") of the data buffer belong to no tensor (a hole " + after +
                          ", before " + range(s) +
                          ").\nthe format requires the buffer to be fully indexed, tensors "
                          "back to back.");
    }
    cursor = s.end;
    prev = &s;
  }
  if (cursor < buffer_bytes) {
    std::string last = prev ? "the last tensor " + range(*prev) : "no tensor (the header is empty)";
    fail_file(what, std::to_string(buffer_bytes - cursor) +
                        " trailing bytes: the data buffer has " + std::to_string(buffer_bytes) +
                        " bytes but the tensors cover only " + std::to_string(cursor) +
                        ", ending with " + last +
                        ".\nthe file has junk appended or an entry is missing from the header.");
  }
}

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
std::vector<uint8_t> to_bytes(const std::vector<T>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// The error for a tensor a file does not hold, listing (the first ten of) those it does.
template <typename Map>
[[noreturn]] void throw_no_tensor(const std::string& origin, const std::string& name, const Map& tensors) {
  std::string msg = "error: " + origin + "\nhas no tensor " + quote(name) + ".\n";
  if (tensors.empty()) throw Error(msg + "it holds no tensors at all.");
  msg += "it has " + std::to_string(tensors.size()) + (tensors.size() == 1 ? " tensor: " : " tensors: ");
  size_t shown = 0;
  for (const auto& [n, t] : tensors) {
    if (shown == 10) break;
    msg += (shown++ ? ", " : "") + quote(n);
  }
  if (tensors.size() > shown) msg += ", ... (" + std::to_string(tensors.size() - shown) + " more)";
  throw Error(msg);
}

}  // namespace

std::string_view dtype_name(Dtype t) {
  switch (t) {
    case Dtype::F64: return "F64";
    case Dtype::F32: return "F32";
    case Dtype::F16: return "F16";
    case Dtype::BF16: return "BF16";
    case Dtype::I64: return "I64";
    case Dtype::I32: return "I32";
    case Dtype::I16: return "I16";
    case Dtype::I8: return "I8";
    case Dtype::U64: return "U64";
    case Dtype::U32: return "U32";
    case Dtype::U16: return "U16";
    case Dtype::U8: return "U8";
    case Dtype::BOOL: return "BOOL";
  }
  return "?";
}

std::size_t dtype_size(Dtype t) {
  switch (t) {
    case Dtype::F64: case Dtype::I64: case Dtype::U64: return 8;
    case Dtype::F32: case Dtype::I32: case Dtype::U32: return 4;
    case Dtype::F16: case Dtype::BF16: case Dtype::I16: case Dtype::U16: return 2;
    case Dtype::I8: case Dtype::U8: case Dtype::BOOL: return 1;
  }
  return 0;
}

const std::vector<Dtype>& all_dtypes() {
  static const std::vector<Dtype> all = {Dtype::F64, Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::I64,
                                         Dtype::I32, Dtype::I16, Dtype::I8,  Dtype::U64,  Dtype::U32,
                                         Dtype::U16, Dtype::U8,  Dtype::BOOL};
  return all;
}

std::optional<Dtype> dtype_from_name(std::string_view name) {
  for (Dtype t : all_dtypes()) {
    if (dtype_name(t) == name) return t;
  }
  return std::nullopt;
}

int64_t Tensor::numel() const {
  // A zero dim wins over any overflow among the others ([2^40, 2^40, 0] is empty).
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) {
      throw Error("error: tensor " + type_string(*this) +
                  ": the number of elements overflows int64; the shape is corrupt.");
    }
  }
  return n;
}

std::string type_string(const Tensor& t) {
  return std::string(dtype_name(t.dtype)) + shape_string(t.shape);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in f32
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  uint32_t bits = exponent == 31 ? (sign | 0x7f800000u | (mantissa << 13))  // inf, NaN payload kept
                                 : (sign | ((exponent + 112) << 23) | (mantissa << 13));
  return std::bit_cast<float>(bits);
}

float bf16_to_f32(uint16_t bits) { return bf16_value(bits); }


namespace {

// A validated file: its metadata and each tensor's type and byte range in the
// data buffer (Tensor::bytes left empty), in header order.
struct FileIndex {
  std::map<std::string, std::string> metadata;
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<Span> spans;  // spans[i] is tensors[i]'s range, relative to data_start
  uint64_t data_start = 0;
};

FileIndex index_file(std::span<const uint8_t> file, const std::string& what) {
  const uint64_t file_bytes = file.size();
  if (file_bytes < 8) {
    fail_file(what, "the file is " + std::to_string(file_bytes) +
                        " bytes, shorter than the 8-byte header length every safetensors file "
                        "starts with.\nit is empty or truncated; re-copy or re-export it.");
  }
  const uint64_t header_bytes = read_u64_le(file.data());
  if (header_bytes > kMaxHeaderBytes) {
    fail_file(what, "header length (first 8 bytes, little-endian) is " +
                        std::to_string(header_bytes) + " bytes, above the limit of " +
                        std::to_string(kMaxHeaderBytes) +
                        " (100 MiB).\nthis is probably not a safetensors file.");
  }
  if (header_bytes > file_bytes - 8) {
    fail_file(what, "header length is " + std::to_string(header_bytes) + " bytes but only " +
                        std::to_string(file_bytes - 8) +
                        " bytes follow the 8-byte length (the file is " +
                        std::to_string(file_bytes) +
                        " bytes). truncated?\nre-copy or re-export the file.");
  }
  std::string_view text(reinterpret_cast<const char*>(file.data()) + 8, header_bytes);
  Json header = parse_header(text, what);
  if (!header.is_object()) {
    fail_file(what, std::string("header is a JSON ") + header.type_name() + " (" + brief(header) +
                        "); it must be an object mapping tensor names to entries.");
  }
  // Valid JSON is non-empty, so text.front() exists. Leading whitespace or a
  // BOM parse fine but the format (and mmap readers) want '{' at byte 8.
  if (text.front() != '{') {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", static_cast<unsigned>(file[8]));
    fail_file(what, std::string("header starts with byte ") + hex +
                        ", not '{'.\nthe JSON object must start right after the 8-byte length; "
                        "padding goes at its end.");
  }

  const uint64_t data_start = 8 + header_bytes;
  const uint64_t buffer_bytes = file_bytes - data_start;
  FileIndex index;
  index.data_start = data_start;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      check_metadata(entry, what);
      if (entry.is_object()) {
        for (const auto& [k, v] : entry.items()) index.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    Span span{};
    index.tensors.emplace_back(name, check_entry(name, entry, buffer_bytes, data_start, file_bytes, what, span));
    index.spans.push_back(span);
  }
  check_layout(index.spans, buffer_bytes, what);
  return index;
}

// Conversions, scans and copies map this many bytes of a file at a time, each
// window unmapped after: what reading a file adds to resident memory beyond
// its result stays this small, whatever the tensor's size.
constexpr size_t kMappedChunkBytes = size_t{2} << 20;

}  // namespace

Safetensors Safetensors::read(const std::string& path) {
  // Mapped, not read into a buffer, and copied a window at a time: the file's
  // bytes are resident once (in the tensors), not twice.
  MappedFile file(path, "safetensors file");
  FileIndex index = index_file(file.bytes(), path);
  // Parsing touched the header through the whole-file mapping (and the kernel
  // may have mapped data pages around it); the data is read through windows.
  file.release(0, file.bytes().size());
  Safetensors st;
  st.source_ = path;
  st.metadata = std::move(index.metadata);
  for (size_t i = 0; i < index.tensors.size(); ++i) {
    auto& [name, t] = index.tensors[i];
    t.bytes.resize(index.spans[i].end - index.spans[i].begin);
    size_t done = 0;
    file.for_each_window(index.data_start + index.spans[i].begin, t.bytes.size(), kMappedChunkBytes,
                         [&](const uint8_t* p, size_t k) {
                           std::memcpy(t.bytes.data() + done, p, k);
                           done += k;
                           return true;
                         });
    st.tensors_.emplace(std::move(name), std::move(t));
  }
  return st;
}

Safetensors Safetensors::parse(std::span<const uint8_t> file, const std::string& what) {
  FileIndex index = index_file(file, what);
  Safetensors st;
  st.source_ = what;
  st.metadata = std::move(index.metadata);
  for (size_t i = 0; i < index.tensors.size(); ++i) {
    auto& [name, t] = index.tensors[i];
    const uint8_t* p = file.data() + index.data_start + index.spans[i].begin;
    t.bytes.assign(p, p + (index.spans[i].end - index.spans[i].begin));
    st.tensors_.emplace(std::move(name), std::move(t));
  }
  return st;
}

std::string Safetensors::origin() const {
  return source_.empty() ? "safetensors (built in memory)" : "safetensors file " + quote(source_);
}

bool Safetensors::contains(const std::string& name) const { return tensors_.count(name) != 0; }

const Tensor& Safetensors::at(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it != tensors_.end()) return it->second;
  throw_no_tensor(origin(), name, tensors_);
}

std::vector<std::string> Safetensors::names() const {
  std::vector<std::string> out;
  for (const auto& [n, t] : tensors_) out.push_back(n);
  return out;
}

namespace {

// What put() and write_safetensors() check of a tensor; `who` opens the message.
void check_tensor(const std::string& who, const std::string& name, Dtype dtype, const std::vector<int64_t>& shape,
                  size_t nbytes) {
  if (name.empty()) throw Error(who + ": tensor names must be non-empty.");
  if (name == kMetadataKey) {
    throw Error(who + ": the name \"__metadata__\" is reserved for the metadata map; pick another.");
  }
  const std::string type = std::string(dtype_name(dtype)) + shape_string(shape);
  for (int64_t d : shape) {
    if (d < 0) {
      throw Error(who + " " + type + ": dimension " + std::to_string(d) + " is negative; dimensions must be >= 0.");
    }
  }
  std::optional<uint64_t> expected = checked_byte_size(shape, dtype);
  if (!expected) {
    throw Error(who + " " + type + ": numel * " + std::to_string(dtype_size(dtype)) +
                " bytes does not fit in 63 bits.");
  }
  if (nbytes != *expected) {
    throw Error(who + " " + type + ": got " + std::to_string(nbytes) + " bytes, but " +
                std::to_string(*expected / dtype_size(dtype)) + " elements of " + std::string(dtype_name(dtype)) +
                " need " + std::to_string(*expected) + ".");
  }
}

}  // namespace

void Safetensors::put(const std::string& name, Tensor t) {
  check_tensor("error: " + origin() + "\nput(" + quote(name) + ")", name, t.dtype, t.shape, t.bytes.size());
  tensors_.insert_or_assign(name, std::move(t));
}

namespace {

// The 8-byte length and the padded JSON header: keys sorted (std::map order),
// tensors back to back in that order.
std::string encode_header(const std::map<std::string, TensorView>& tensors,
                          const std::map<std::string, std::string>& metadata,
                          const std::string& origin) {
  Json header = Json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    uint64_t end = offset + t.bytes.size();
    header[name] = {{"dtype", dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", Json::array({offset, end})}};
    offset = end;
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {
    throw Error("error: " + origin + "\ncannot serialize it: " + e.what() +
                "\ntensor names and metadata must be valid UTF-8.");
  }
  // Padding to a multiple of 8 keeps the buffer 8-byte aligned for mmap readers.
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kMaxHeaderBytes) {
    throw Error("error: " + origin + "\nits header would be " + std::to_string(text.size()) +
                " bytes, above the " + std::to_string(kMaxHeaderBytes) +
                "-byte limit readers enforce; shorten names or metadata.");
  }
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(uint64_t{text.size()} >> (8 * i));
  return out + text;
}

template <typename T>
void put_values(Safetensors& st, const std::string& origin, const std::string& name, Dtype dtype,
                std::vector<int64_t> shape, const std::vector<T>& values) {
  Tensor t{dtype, std::move(shape), {}};
  std::optional<uint64_t> bytes = checked_byte_size(t.shape, dtype);
  bool negative = std::any_of(t.shape.begin(), t.shape.end(), [](int64_t d) { return d < 0; });
  if (!negative && bytes && *bytes / sizeof(T) != values.size()) {
    throw Error("error: " + origin + "\nput(" + quote(name) + ") " + type_string(t) + ": got " +
                std::to_string(values.size()) + " values, but the shape holds " +
                std::to_string(*bytes / sizeof(T)) + ".");
  }
  t.bytes = to_bytes(values);
  st.put(name, std::move(t));  // reports negative dims and overflow
}

}  // namespace

void Safetensors::put_f32(const std::string& name, std::vector<int64_t> shape,
                          const std::vector<float>& values) {
  put_values(*this, origin(), name, Dtype::F32, std::move(shape), values);
}

void Safetensors::put_f64(const std::string& name, std::vector<int64_t> shape,
                          const std::vector<double>& values) {
  put_values(*this, origin(), name, Dtype::F64, std::move(shape), values);
}

void Safetensors::put_i32(const std::string& name, std::vector<int64_t> shape,
                          const std::vector<int32_t>& values) {
  put_values(*this, origin(), name, Dtype::I32, std::move(shape), values);
}

namespace {

bool is_float_dtype(Dtype t) {
  return t == Dtype::F64 || t == Dtype::F32 || t == Dtype::F16 || t == Dtype::BF16;
}

bool is_int_dtype(Dtype t) { return !is_float_dtype(t) && t != Dtype::BOOL; }

}  // namespace

void convert_to_f32(Dtype t, const uint8_t* p, size_t n, float* out) {
  switch (t) {
    case Dtype::F32:
      if (n) std::memcpy(out, p, n * sizeof(float));
      break;
    case Dtype::F64:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(load<double>(p + 8 * i));
      break;
    case Dtype::F16:
      for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(load<uint16_t>(p + 2 * i));
      break;
    default:  // BF16
      for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(load<uint16_t>(p + 2 * i));
      break;
  }
}

namespace {

// The index of the first NaN or infinity among n elements of dtype t at p, or
// -1: an exponent of all ones, tested on the bits (no conversion).
int64_t find_non_finite(Dtype t, const uint8_t* p, size_t n) {
  auto scan = [&](auto bits_type, auto mask) -> int64_t {
    using Bits = decltype(bits_type);
    for (size_t i = 0; i < n; ++i) {
      if ((load<Bits>(p + sizeof(Bits) * i) & mask) == mask) return static_cast<int64_t>(i);
    }
    return -1;
  };
  switch (t) {
    case Dtype::F64: return scan(uint64_t{}, uint64_t{0x7ff0000000000000});
    case Dtype::F32: return scan(uint32_t{}, uint32_t{0x7f800000});
    case Dtype::F16: return scan(uint16_t{}, uint16_t{0x7c00});
    case Dtype::BF16: return scan(uint16_t{}, uint16_t{0x7f80});
    default: return -1;
  }
}

}  // namespace

std::vector<double> Safetensors::to_f64(const std::string& name) const {
  const Tensor& t = at(name);
  if (!is_float_dtype(t.dtype)) {
    throw Error("error: " + origin() + "\ntensor " + quote(name) + " is " + type_string(t) +
                "; to_f64 reads F64, F32, F16 or BF16 tensors (use to_i32 for integers).");
  }
  const size_t n = static_cast<size_t>(t.numel());
  const uint8_t* p = t.bytes.data();
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case Dtype::F64: out[i] = load<double>(p + 8 * i); break;
      case Dtype::F32: out[i] = load<float>(p + 4 * i); break;
      case Dtype::F16: out[i] = f16_to_f32(load<uint16_t>(p + 2 * i)); break;
      default: out[i] = bf16_to_f32(load<uint16_t>(p + 2 * i)); break;
    }
  }
  return out;
}

std::vector<float> Safetensors::to_f32(const std::string& name) const {
  const Tensor& t = at(name);
  if (!is_float_dtype(t.dtype)) {
    throw Error("error: " + origin() + "\ntensor " + quote(name) + " is " + type_string(t) +
                "; to_f32 reads F32, F64, F16 or BF16 tensors (use to_i32 for integers).");
  }
  std::vector<float> out(static_cast<size_t>(t.numel()));
  convert_to_f32(t.dtype, t.bytes.data(), out.size(), out.data());
  return out;
}

std::vector<int32_t> Safetensors::to_i32(const std::string& name) const {
  const Tensor& t = at(name);
  if (!is_int_dtype(t.dtype)) {
    throw Error("error: " + origin() + "\ntensor " + quote(name) + " is " + type_string(t) +
                "; to_i32 reads integer tensors (I64, I32, I16, I8, U64, U32, U16, U8); use "
                "to_f32 for floats.");
  }
  const size_t n = static_cast<size_t>(t.numel());
  const uint8_t* p = t.bytes.data();
  std::vector<int32_t> out(n);
  auto fits = [&](auto v, size_t i) {
    if (std::in_range<int32_t>(v)) return static_cast<int32_t>(v);
    throw Error("error: " + origin() + "\ntensor " + quote(name) + " " + type_string(t) +
                ": element " + std::to_string(i) + " is " + std::to_string(v) +
                ", outside the int32 range [-2147483648, 2147483647].");
  };
  for (size_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case Dtype::I64: out[i] = fits(load<int64_t>(p + 8 * i), i); break;
      case Dtype::I32: out[i] = load<int32_t>(p + 4 * i); break;
      case Dtype::I16: out[i] = load<int16_t>(p + 2 * i); break;
      case Dtype::I8: out[i] = load<int8_t>(p + i); break;
      case Dtype::U64: out[i] = fits(load<uint64_t>(p + 8 * i), i); break;
      case Dtype::U32: out[i] = fits(load<uint32_t>(p + 4 * i), i); break;
      case Dtype::U16: out[i] = load<uint16_t>(p + 2 * i); break;
      default: out[i] = p[i]; break;  // U8
    }
  }
  return out;
}

namespace {

std::map<std::string, TensorView> views_of(const std::map<std::string, Tensor>& tensors) {
  std::map<std::string, TensorView> out;
  for (const auto& [name, t] : tensors) out.emplace(name, TensorView{t.dtype, t.shape, t.bytes});
  return out;
}

}  // namespace

std::vector<uint8_t> Safetensors::serialize() const {
  std::string header = encode_header(views_of(tensors_), metadata, origin());
  std::vector<uint8_t> out(header.begin(), header.end());
  for (const auto& [name, t] : tensors_) out.insert(out.end(), t.bytes.begin(), t.bytes.end());
  return out;
}

void Safetensors::write(const std::string& path) const {
  // put() has checked every tensor; only the header can still fail (names
  // that are not UTF-8), and encode_header reports that with our origin.
  encode_header(views_of(tensors_), metadata, origin());
  write_safetensors(path, views_of(tensors_), metadata);
}

FileDigest write_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                             const std::map<std::string, std::string>& metadata) {
  const std::string origin = "safetensors file " + quote(path);
  for (const auto& [name, v] : tensors) {
    check_tensor("error: " + origin + "\ntensor " + quote(name), name, v.dtype, v.shape, v.bytes.size());
  }
  // Encoding the header first means a bad object fails before any file is
  // touched; tensor bytes are then streamed, never copied into one buffer.
  const std::string header = encode_header(tensors, metadata, origin);
  WriteFailureScope injected_failures;  // HALYARD_TEST_FAIL_WRITE_AFTER_BYTES, see file_io.h
  AtomicFile out(path, "safetensors file");
  out.write(header.data(), header.size());
  for (const auto& [name, v] : tensors) out.write(v.bytes.data(), v.bytes.size());
  return out.commit();
}

// ---- MappedSafetensors -------------------------------------------------------

MappedSafetensors::MappedSafetensors(const std::string& path)
    : path_(path), file_(std::make_shared<const MappedFile>(path, "safetensors file")) {
  FileIndex index = index_file(file_->bytes(), path);
  metadata_ = std::move(index.metadata);
  for (size_t i = 0; i < index.tensors.size(); ++i) {
    auto& [name, t] = index.tensors[i];
    const Span& s = index.spans[i];
    tensors_.emplace(std::move(name), TensorView{t.dtype, std::move(t.shape),
                                                 file_->bytes().subspan(index.data_start + s.begin, s.end - s.begin)});
  }
  // The header has been parsed into our own objects; its pages (and any data
  // pages the kernel mapped around them) are not needed: data is read through windows.
  file_->release(0, file_->bytes().size());
}

const TensorView& MappedSafetensors::at(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it != tensors_.end()) return it->second;
  throw_no_tensor("safetensors file " + quote(path_), name, tensors_);
}

std::vector<std::string> MappedSafetensors::names() const {
  std::vector<std::string> out;
  for (const auto& [n, t] : tensors_) out.push_back(n);
  return out;
}

void MappedSafetensors::read_f32(const std::string& name, float* out) const {
  const TensorView& v = at(name);
  if (!is_float_dtype(v.dtype)) {
    throw Error("error: safetensors file " + quote(path_) + "\ntensor " + quote(name) + " is " +
                std::string(dtype_name(v.dtype)) + shape_string(v.shape) +
                "; read_f32 reads F32, F64, F16 or BF16 tensors.");
  }
  const size_t size = dtype_size(v.dtype);
  size_t done = 0;  // elements
  file_->for_each_window(static_cast<size_t>(v.bytes.data() - file_->bytes().data()), v.bytes.size(),
                         kMappedChunkBytes / size * size, [&](const uint8_t* p, size_t k) {
                           convert_to_f32(v.dtype, p, k / size, out + done);
                           done += k / size;
                           return true;
                         });
}

int64_t MappedSafetensors::first_non_finite(const std::string& name) const {
  const TensorView& v = at(name);
  if (!is_float_dtype(v.dtype)) return -1;
  const size_t size = dtype_size(v.dtype);
  int64_t done = 0, found = -1;  // elements
  file_->for_each_window(static_cast<size_t>(v.bytes.data() - file_->bytes().data()), v.bytes.size(),
                         kMappedChunkBytes / size * size, [&](const uint8_t* p, size_t k) {
                           const int64_t at = find_non_finite(v.dtype, p, k / size);
                           if (at >= 0) found = done + at;
                           done += static_cast<int64_t>(k / size);
                           return at < 0;
                         });
  return found;
}

}  // namespace halyard::runtime
