// Reading and writing checkpoints in the safetensors format.
//
// A file is: an 8-byte little-endian u64 N; N bytes of UTF-8 JSON, an object
// mapping each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// plus an optional "__metadata__" object of strings; then the data buffer, with
// offsets relative to its start. Tensor data is row-major and little-endian.
//
// Reading is strict: any file the reference implementation would reject, and a
// few it tolerates (duplicate JSON keys), fail with a runtime::Error whose
// message opens with `error: safetensors file "<path>"`, then states the
// problem, its numbers and the fix. A checkpoint that loads is therefore fully
// indexed: every byte of the buffer belongs to exactly one tensor.
//
// Writing is deterministic (keys sorted, tensors laid out contiguously in name
// order, header padded with spaces to a multiple of 8) and atomic: the bytes go
// to a temporary file in the target's directory, which is fsync'ed and renamed
// over the target; a failed write leaves any old file untouched and throws
// WriteError (runtime/file_io.h), which also carries the errno and the path.
//
// Memory: Safetensors holds every tensor's bytes (read() maps the file and
// copies each tensor once, never holding the file twice). For checkpoints of
// any size, MappedSafetensors keeps the file mapped and converts one tensor at
// a time straight into the caller's f32 buffer through 2 MiB windows of the
// file, each unmapped after use, and write_safetensors streams tensors from
// the caller's memory: neither holds a second copy of the data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/file_io.h"

namespace halyard::runtime {

enum class Dtype { F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL };

// The name as spelled in safetensors headers ("F32", "BF16", "BOOL", ...).
std::string_view dtype_name(Dtype t);
// Bytes per element.
std::size_t dtype_size(Dtype t);
// Inverse of dtype_name; nullopt for names this reader does not support.
std::optional<Dtype> dtype_from_name(std::string_view name);
// All supported dtypes, in the order error messages list them.
const std::vector<Dtype>& all_dtypes();

struct Tensor {
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;  // [] is a scalar (one element)
  std::vector<uint8_t> bytes;  // numel() * dtype_size(dtype) bytes, little-endian
  // Product of the dims (1 for a scalar); throws Error if it overflows int64.
  int64_t numel() const;
};

// Prints a tensor's type as `F32[2, 3]` (a scalar is `F32[]`).
std::string type_string(const Tensor& t);

// A tensor whose bytes live elsewhere (the caller's memory, or a mapped file).
struct TensorView {
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;  // numel * dtype_size(dtype) bytes, little-endian
};

class Safetensors {
 public:
  // Reads and validates a file. Errors name the file.
  static Safetensors read(const std::string& path);
  // Same validation on bytes already in memory; `what` names them in errors
  // (normally the path they came from).
  static Safetensors parse(std::span<const uint8_t> file, const std::string& what);

  // Atomically writes the file at `path` (see the contract above).
  void write(const std::string& path) const;
  // The exact bytes write() puts on disk.
  std::vector<uint8_t> serialize() const;

  bool contains(const std::string& name) const;
  // A missing name raises an error that lists the available names.
  const Tensor& at(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted
  std::size_t size() const { return tensors_.size(); }

  // Adds or replaces a tensor. Checks the name (non-empty, not "__metadata__"),
  // the shape (non-negative dims, no overflow) and that bytes.size() equals
  // numel * dtype_size.
  void put(const std::string& name, Tensor t);
  void put_f32(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& values);
  void put_f64(const std::string& name, std::vector<int64_t> shape, const std::vector<double>& values);
  void put_i32(const std::string& name, std::vector<int64_t> shape, const std::vector<int32_t>& values);

  // Element values converted to the requested type. Float reads accept F32,
  // F64, F16 and BF16 (F64 -> f32 rounds to nearest even; the rest are exact);
  // to_i32 accepts any integer dtype and checks each value fits in int32.
  // Other dtypes raise an error naming the tensor and the accepted dtypes.
  std::vector<float> to_f32(const std::string& name) const;
  std::vector<double> to_f64(const std::string& name) const;
  std::vector<int32_t> to_i32(const std::string& name) const;

  // Free-form string metadata ("__metadata__" in the header).
  std::map<std::string, std::string> metadata;

 private:
  // `safetensors file "<path>"`, or a note that the object was built in memory.
  std::string origin() const;

  std::string source_;  // path or `what` this was read from; empty if built in memory
  std::map<std::string, Tensor> tensors_;
};

// Writes a file of these tensors and metadata with exactly the bytes and the
// atomicity of Safetensors::write, streaming each tensor from where it lives.
// Checks what put() checks first, so a bad tensor fails before any file is
// touched. Returns the size and XXH64 of the bytes written.
FileDigest write_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                             const std::map<std::string, std::string>& metadata);

// A safetensors file mapped read-only, validated exactly as Safetensors::read
// validates (errors open with `error: safetensors file "<path>"`); tensor
// bytes are read from the mapping only when asked for.
class MappedSafetensors {
 public:
  explicit MappedSafetensors(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // A missing name raises an error that lists the available names.
  const TensorView& at(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted

  // Converts the float tensor `name` (F32, F64, F16 or BF16, as to_f32 does)
  // into out[0, numel) through 2 MiB windows of the file, each unmapped once
  // converted: the resident memory this adds stays one window whatever the
  // tensor's size. Other dtypes raise an error naming the tensor.
  void read_f32(const std::string& name, float* out) const;
  // The index of the first NaN or infinity of the float tensor `name`, or -1
  // (also -1 for integer and BOOL tensors, which hold neither).
  int64_t first_non_finite(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<const MappedFile> file_;  // shared: the object stays movable
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// n elements of a float dtype (F32, F64, F16 or BF16) at p, converted to f32
// as to_f32 converts them: F32, F16 and BF16 exactly, F64 rounded to nearest
// even. `t` must be a float dtype (callers check; others convert as BF16).
void convert_to_f32(Dtype t, const uint8_t* p, size_t n, float* out);

// Conversions of single 16-bit floats, exact (every F16 and BF16 value is an f32).
float f16_to_f32(uint16_t bits);
float bf16_to_f32(uint16_t bits);

}  // namespace halyard::runtime
