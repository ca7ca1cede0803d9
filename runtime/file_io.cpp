// File plumbing of the checkpoint code; the contract is in file_io.h.
#include "runtime/file_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <vector>

namespace halyard::runtime {
namespace {

// ---- XXH64 (the reference's constants and steps, seed 0) --------------------

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full, kP3 = 0x165667B19E3779F9ull,
                   kP4 = 0x85EBCA77C2B2AE63ull, kP5 = 0x27D4EB2F165667C5ull;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian hosts only, as safetensors.cpp asserts
  return v;
}
uint32_t read32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t round64(uint64_t acc, uint64_t input) { return rotl(acc + input * kP2, 31) * kP1; }
uint64_t merge64(uint64_t h, uint64_t acc) { return (h ^ round64(0, acc)) * kP1 + kP4; }

// ---- the injected write failure --------------------------------------------

struct WriteBudget {
  int depth = 0;
  bool limited = false;
  uint64_t left = 0;
};
thread_local WriteBudget budget;

// How many of n bytes may be written now (n unless a test set a budget).
size_t allowed(size_t n) {
  if (!budget.limited) return n;
  return static_cast<size_t>(std::min<uint64_t>(n, budget.left));
}

}  // namespace

void Xxh64::update(const void* data, size_t n) {
  if (n == 0) return;  // data may be null (an empty tensor); memcpy from null is UB even for 0 bytes
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_ += n;
  if (buffered_ + n < 32) {
    std::memcpy(buf_ + buffered_, p, n);
    buffered_ += n;
    return;
  }
  auto stripe = [this](const uint8_t* s) {
    for (int i = 0; i < 4; ++i) acc_[i] = round64(acc_[i], read64(s + 8 * i));
  };
  if (buffered_ > 0) {
    const size_t fill = 32 - buffered_;
    std::memcpy(buf_ + buffered_, p, fill);
    stripe(buf_);
    p += fill;
    n -= fill;
    buffered_ = 0;
  }
  for (; n >= 32; p += 32, n -= 32) stripe(p);
  std::memcpy(buf_, p, n);
  buffered_ = n;
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(acc_[0], 1) + rotl(acc_[1], 7) + rotl(acc_[2], 12) + rotl(acc_[3], 18);
    for (uint64_t a : acc_) h = merge64(h, a);
  } else {
    h = acc_[2] + kP5;  // acc_[2] is the seed
  }
  h += total_;
  const uint8_t* p = buf_;
  size_t n = buffered_;
  for (; n >= 8; p += 8, n -= 8) h = rotl(h ^ round64(0, read64(p)), 27) * kP1 + kP4;
  if (n >= 4) {
    h = rotl(h ^ (uint64_t{read32(p)} * kP1), 23) * kP2 + kP3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; ++p, --n) h = rotl(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

std::string hex64(uint64_t v) {
  static const char digits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = digits[v & 15];
  return s;
}

FileDigest digest_file(const std::string& path, const std::string& kind) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error("error: " + kind + " " + quote(path) + "\ncannot open it: " + std::strerror(errno) + ".");
  }
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<uint8_t> chunk(size_t{1} << 20);
  Xxh64 h;
  FileDigest d;
  for (;;) {
    ssize_t k = ::read(fd, chunk.data(), chunk.size());
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) {
      const int e = errno;
      ::close(fd);
      throw Error("error: " + kind + " " + quote(path) + "\nreading it failed: " + std::strerror(e) + ".");
    }
    if (k == 0) break;
    h.update(chunk.data(), static_cast<size_t>(k));
    d.bytes += static_cast<uint64_t>(k);
  }
  ::close(fd);
  d.xxh64 = h.digest();
  return d;
}

WriteFailureScope::WriteFailureScope() : outer_(budget.depth++ == 0) {
  if (!outer_) return;
  budget.limited = false;
  const char* env = std::getenv("HALYARD_TEST_FAIL_WRITE_AFTER_BYTES");
  if (env && *env) {
    char* end = nullptr;
    const unsigned long long n = std::strtoull(env, &end, 10);
    if (*end == '\0') {
      budget.limited = true;
      budget.left = n;
    }
  }
}

WriteFailureScope::~WriteFailureScope() {
  if (--budget.depth == 0) budget.limited = false;
}

AtomicFile::AtomicFile(std::string path, std::string kind)
    : path_(std::move(path)), tmp_(path_ + ".tmp." + std::to_string(::getpid())), kind_(std::move(kind)) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("creating the temporary file " + quote(tmp_), errno);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void AtomicFile::fail(const std::string& step, int err) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
  tmp_.clear();
  std::string dir = std::filesystem::path(path_).parent_path().string();
  if (dir.empty()) dir = ".";
  std::string hint;
  if (err == ENOENT || err == ENOTDIR) hint = "\nthe directory " + quote(dir) + " does not exist; create it first.";
  if (err == EISDIR) hint = "\n" + quote(path_) + " is a directory; pass a file path.";
  if (err == ENOSPC || err == EDQUOT) hint = "\nthe disk (or quota) of " + quote(dir) + " is full; free space there.";
  if (err == EFBIG) hint = "\nthe file exceeds the size limit of this process (ulimit -f) or filesystem.";
  throw WriteError("error: " + kind_ + " " + quote(path_) + "\ncannot write it: " + step + ": " + std::strerror(err) +
                       "." + hint + "\nany previous file at this path is unchanged.",
                   err, path_);
}

void AtomicFile::write(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  hash_.update(p, n);
  bytes_ += n;
  while (n > 0) {
    const size_t ok = allowed(n);
    if (ok == 0) fail("writing " + quote(tmp_), ENOSPC);  // HALYARD_TEST_FAIL_WRITE_AFTER_BYTES
    ssize_t k = ::write(fd_, p, ok);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) fail("writing " + quote(tmp_), k < 0 ? errno : EIO);
    if (budget.limited) budget.left -= static_cast<uint64_t>(k);
    p += k;
    n -= static_cast<size_t>(k);
  }
}

FileDigest AtomicFile::commit() {
  if (::fsync(fd_) != 0) fail("fsync of " + quote(tmp_), errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("closing " + quote(tmp_), errno);
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("renaming " + quote(tmp_) + " over it", errno);
  tmp_.clear();
  // Without this the rename itself may not survive a crash.
  std::string dir = std::filesystem::path(path_).parent_path().string();
  if (dir.empty()) dir = ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    const int rc = ::fsync(dfd);
    const int err = errno;
    ::close(dfd);
    // Some filesystems cannot fsync a directory; the data is in place regardless.
    if (rc != 0 && err != EINVAL && err != ENOTSUP) {
      throw WriteError("error: " + kind_ + " " + quote(path_) + "\nwas written, but fsync of its directory " +
                           quote(dir) + " failed: " + std::strerror(err) + ".\nthe new file may not survive a crash.",
                       err, path_);
    }
  }
  return {bytes_, hash_.digest()};
}

MappedFile::MappedFile(const std::string& path, const std::string& kind) : what_(kind + " " + quote(path)) {
  const std::string who = "error: " + what_ + "\n";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(who + "cannot open it: " + std::strerror(errno) + ".");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(who + "cannot stat it: " + std::strerror(e) + ".");
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw Error(who + "is a directory; pass the path of a .safetensors file.");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw Error(who + "cannot map it into memory: " + std::strerror(e) + ".");
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  fd_ = fd;  // kept for for_each_window
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
}

void MappedFile::for_each_window(size_t offset, size_t n, size_t window,
                                 const std::function<bool(const uint8_t*, size_t)>& f) const {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  for (size_t done = 0; done < n;) {
    const size_t k = std::min(window, n - done);
    const size_t at = offset + done, base = at / page * page, length = at + k - base;
    void* p = ::mmap(nullptr, length, PROT_READ, MAP_PRIVATE, fd_, static_cast<off_t>(base));
    if (p == MAP_FAILED)
      throw Error("error: " + what_ + "\ncannot map bytes [" + std::to_string(at) + ", " + std::to_string(at + k) +
                  ") of it: " + std::strerror(errno) + ".");
    ::madvise(p, length, MADV_SEQUENTIAL);  // read front to back once: readahead, early reclaim
    bool more = false;
    try {
      more = f(static_cast<const uint8_t*>(p) + (at - base), k);
    } catch (...) {
      ::munmap(p, length);
      throw;
    }
    ::munmap(p, length);
    if (!more) return;
    done += k;
  }
}

void MappedFile::release(size_t offset, size_t n) const {
  if (!data_ || n == 0 || offset >= size_) return;
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t begin = offset / page * page;
  const size_t end = std::min(size_, offset + n);
  // MADV_DONTNEED on a private, never-written file mapping only unmaps the
  // pages: the next touch faults the file's data back in, unchanged.
  ::madvise(const_cast<uint8_t*>(data_) + begin, end - begin, MADV_DONTNEED);
}

}  // namespace halyard::runtime
