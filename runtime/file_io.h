// File plumbing of the checkpoint code (safetensors.cpp, checkpoint.cpp): an
// atomic writer, a read-only mapping, a checksum, and a test hook that makes
// writes fail. Not an API for programs; they use safetensors.h and checkpoint.h.
//
// Contract:
// - AtomicFile writes `path` through `path.tmp.<pid>` in the same directory:
//   commit() fsyncs the file, renames it over `path` and fsyncs the directory;
//   destroying it uncommitted removes the temporary file. A failure throws
//   WriteError (an Error that also carries the errno and `path`) and leaves any
//   old file at `path` untouched.
// - MappedFile maps a whole file read-only. Pages it touches count as this
//   process's resident memory until release() hands them back (the kernel's
//   page cache keeps the data; touching them again reads it back). Bulk reads
//   go through for_each_window instead, which maps one window of the file at a
//   time and unmaps it after: the kernel maps large page-cache folios whole,
//   beyond the page touched, so only the bounds of a mapping bound what a read
//   makes resident. If the file is truncated while mapped, touching the lost
//   pages raises SIGBUS: files are opened only for as long as one load takes.
// - Xxh64 is XXH64 with seed 0 (Yann Collet's xxHash, 64-bit): checksums of
//   checkpoint files. Not cryptographic: it detects corruption (bit flips,
//   truncation, a file from another save), not tampering. It runs at memory
//   speed, so verifying a checkpoint adds seconds where SHA-256 adds minutes.
// - HALYARD_TEST_FAIL_WRITE_AFTER_BYTES=N (tests only): within one outermost
//   WriteFailureScope (one save_checkpoint, or one Safetensors::write), the
//   bytes past the first N written fail with ENOSPC, as on a full disk.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "runtime/error.h"

namespace halyard::runtime {

class Xxh64 {
 public:
  void update(const void* data, size_t n);
  uint64_t digest() const;  // of everything given so far; update may continue after
 private:
  uint64_t acc_[4] = {0x9E3779B185EBCA87ull + 0xC2B2AE3D27D4EB4Full, 0xC2B2AE3D27D4EB4Full, 0,
                      0 - 0x9E3779B185EBCA87ull};
  uint8_t buf_[32] = {};
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

// 16 lowercase hex digits.
std::string hex64(uint64_t v);

struct FileDigest {
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;
};

// Size and XXH64 of a file, read through a 1 MiB buffer. Errors open with
// `error: <kind> "<path>"`.
FileDigest digest_file(const std::string& path, const std::string& kind);

class WriteError : public Error {
 public:
  WriteError(const std::string& message, int err, std::string path)
      : Error(message), err(err), path(std::move(path)) {}
  int err;           // the errno of the failed call
  std::string path;  // the file being written (its final name, not the temporary)
};

// See the contract above. While one is alive on this thread, writes count
// against HALYARD_TEST_FAIL_WRITE_AFTER_BYTES; nested scopes share the outer one's count.
class WriteFailureScope {
 public:
  WriteFailureScope();
  ~WriteFailureScope();
  WriteFailureScope(const WriteFailureScope&) = delete;
  WriteFailureScope& operator=(const WriteFailureScope&) = delete;

 private:
  bool outer_;
};

class AtomicFile {
 public:
  // `kind` opens messages: `error: <kind> "<path>"` ("safetensors file", "checkpoint file").
  AtomicFile(std::string path, std::string kind);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t n);
  // Makes the file durable under its name; returns the size and XXH64 of what was written.
  FileDigest commit();

 private:
  [[noreturn]] void fail(const std::string& step, int err);

  std::string path_, tmp_, kind_;
  int fd_ = -1;
  Xxh64 hash_;
  uint64_t bytes_ = 0;
};

class MappedFile {
 public:
  // Errors open with `error: <kind> "<path>"`: missing, unreadable, a directory.
  MappedFile(const std::string& path, const std::string& kind);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  // Drops the pages overlapping [offset, offset + n) from resident memory.
  void release(size_t offset, size_t n) const;
  // Calls f(p, k) for consecutive pieces [p, p + k) covering [offset, offset + n)
  // of the file, each at most `window` bytes (a multiple of what the caller
  // needs whole, e.g. an element), each mapped on its own for the call; stops
  // early when f returns false.
  void for_each_window(size_t offset, size_t n, size_t window,
                       const std::function<bool(const uint8_t*, size_t)>& f) const;

 private:
  std::string what_;  // `<kind> "<path>"`, for errors
  int fd_ = -1;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace halyard::runtime
