// Token files (mmap, read-only) and the Batcher. Contract in runtime/data.h.
#include "runtime/data.h"

#include <algorithm>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include "runtime/error.h"

namespace halyard::runtime {

namespace {

std::string num(int64_t v) { return std::to_string(v); }

std::string kind(int width) {
  return width == 1 ? "text file" : width == 2 ? "uint16 token file" : "uint32 token file";
}

}  // namespace

struct TokenFile::Mapping {
  std::string path;
  int width = 2;  // bytes per token; 1 for text
  const uint8_t* data = nullptr;
  int64_t bytes = 0;
  ~Mapping() {
    if (data) ::munmap(const_cast<uint8_t*>(data), static_cast<size_t>(bytes));
  }
};

TokenFile TokenFile::map(const std::string& path, int w) {
  auto m = std::make_shared<Mapping>();
  m->path = path;
  m->width = w;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw Error("error: " + kind(w) + " " + quote(path) + " cannot be opened: " + std::strerror(errno) +
                ".\nfix: pass the path of an existing, readable file.");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error("error: " + kind(w) + " " + quote(path) + " is not a regular file.\nfix: pass the path of a file.");
  }
  m->bytes = static_cast<int64_t>(st.st_size);
  if (m->bytes == 0) {
    ::close(fd);
    throw Error("error: " + kind(w) + " " + quote(path) +
                " is empty (0 bytes): it holds no tokens.\nfix: pass a file with at least seq + 1 tokens.");
  }
  if (m->bytes % w != 0) {
    ::close(fd);
    throw Error("error: " + kind(w) + " " + quote(path) + " has " + num(m->bytes) + " bytes, not a multiple of " +
                num(w) + " (bytes per token id): " + num(m->bytes) + " % " + num(w) + " = " + num(m->bytes % w) +
                ".\nfix: check the token width (" +
                (w == 2 ? "--token-width 32 reads 4-byte ids" : "--token-width 16 reads 2-byte ids") +
                ") or whether the file was truncated.");
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(m->bytes), PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    throw Error("error: " + kind(w) + " " + quote(path) + " (" + num(m->bytes) + " bytes) cannot be mapped: " +
                std::strerror(err) + ".\nfix: check that the file is readable and fits the address space.");
  m->data = static_cast<const uint8_t*>(p);
  return TokenFile(std::move(m));
}

TokenFile TokenFile::open(const std::string& path, TokenWidth width) {
  return map(path, width == TokenWidth::U16 ? 2 : 4);
}

TokenFile TokenFile::from_text(const std::string& path) { return map(path, 1); }

const std::string& TokenFile::path() const { return m_->path; }
int TokenFile::bytes_per_token() const { return m_->width; }
bool TokenFile::is_text() const { return m_->width == 1; }
int64_t TokenFile::size() const { return count_ >= 0 ? count_ : m_->bytes / m_->width; }

TokenFile TokenFile::slice(int64_t begin, int64_t end) const {
  if (begin < 0 || end < begin || end > size())
    throw Error("error: " + kind(m_->width) + " " + quote(m_->path) + " holds " + num(size()) +
                " tokens; a slice [" + num(begin) + ", " + num(end) + ") is not inside it.\nfix: slice within [0, " +
                num(size()) + "].");
  TokenFile view = *this;
  view.first_ = first_ + begin;
  view.count_ = end - begin;
  return view;
}

void TokenFile::read(int64_t start, int64_t n, int32_t* out) const {
  const int64_t size = this->size();
  int64_t end = 0;  // start + n, which a bad range may overflow
  if (start < 0 || n < 0 || start > size || n > size - start)
    throw Error("error: " + kind(m_->width) + " " + quote(m_->path) + " holds " + num(size) +
                " tokens; read(start " + num(start) + ", n " + num(n) + ") asks for tokens [" + num(start) + ", " +
                (__builtin_add_overflow(start, n, &end) ? std::string("beyond int64") : num(end)) +
                ").\nfix: read a range inside [0, " + num(size) + ").");
  const uint8_t* p = m_->data + (first_ + start) * m_->width;
  switch (m_->width) {
    case 1:
      for (int64_t i = 0; i < n; ++i) out[i] = p[i];
      break;
    case 2:
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(p[2 * i] | (p[2 * i + 1] << 8));
      break;
    default:
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t* q = p + 4 * i;
        const uint32_t v = static_cast<uint32_t>(q[0]) | (static_cast<uint32_t>(q[1]) << 8) |
                           (static_cast<uint32_t>(q[2]) << 16) | (static_cast<uint32_t>(q[3]) << 24);
        if (v > static_cast<uint32_t>(std::numeric_limits<int32_t>::max()))
          throw Error("error: uint32 token file " + quote(m_->path) + " byte offset " + num((first_ + start + i) * 4) +
                      " (token " + num(first_ + start + i) + "): id " + std::to_string(v) +
                      " does not fit int32 (max 2147483647).\nfix: check the token width and the file's tokenizer.");
        out[i] = static_cast<int32_t>(v);
      }
  }
}

std::vector<std::pair<int64_t, int64_t>> Shard::pieces(int64_t local) const {
  if (zigzag && ranks > 1) {
    const int64_t c = local / 2;
    return {{rank * c, c}, {(2 * static_cast<int64_t>(ranks) - 1 - rank) * c, c}};
  }
  return {{rank * local, local}};
}

std::vector<int32_t> Shard::row_index(int64_t local) const {
  std::vector<int32_t> out;
  for (auto [first, len] : pieces(local))
    for (int64_t t = 0; t < len; ++t) out.push_back(static_cast<int32_t>(first + t));
  return out;
}

std::vector<int64_t> read_doc_starts(const std::string& path, int64_t file_tokens) {
  std::ifstream in(path);
  if (!in) throw Error("error: cannot open the document starts file " + quote(path) + ": " + std::strerror(errno) +
                       ".\nfix: pass a text file of token offsets, one or more per line.");
  std::vector<int64_t> out;
  std::string word;
  for (int64_t line = 1; in.peek() != EOF; ++line) {
    std::string text;
    std::getline(in, text);
    std::istringstream words(text);
    while (words >> word) {
      size_t used = 0;
      int64_t v = -1;
      try {
        v = std::stoll(word, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      const std::string at = "document starts file " + quote(path) + " line " + num(line) + ": ";
      if (used != word.size() || v < 0 || v >= file_tokens)
        throw Error("error: " + at + "\"" + word + "\" is not a token offset of the data (0 .. " +
                    num(file_tokens - 1) + ").\nfix: list where each document starts, in tokens from the file's start.");
      if (!out.empty() && v <= out.back())
        throw Error("error: " + at + num(v) + " follows " + num(out.back()) +
                    "; document starts must increase.\nfix: sort the offsets and drop repeats.");
      out.push_back(v);
    }
  }
  if (out.empty())
    throw Error("error: the document starts file " + quote(path) + " lists no offsets.\nfix: list where each "
                "document starts, in tokens from the file's start.");
  return out;
}

Batcher::Batcher(const TokenFile& file, int64_t batch, int64_t seq, int64_t vocab, uint64_t seed, Shard shard,
                 Packing packing)
    : file_(file), batch_(batch), seq_(seq), vocab_(vocab), seed_(seed), shard_(shard), packing_(std::move(packing)) {
  const std::string what = "error: batches of " + kind(file.bytes_per_token()) + " " + quote(file.path());
  if (batch < 1 || seq < 1 || vocab < 1)
    throw Error(what + ": batch " + num(batch) + ", seq " + num(seq) + ", vocab " + num(vocab) +
                " must all be >= 1.\nfix: pass the sizes the model was built for.");
  if (shard.ranks < 1 || shard.rank < 0 || shard.rank >= shard.ranks)
    throw Error(what + ": shard rank " + num(shard.rank) + " of " + num(shard.ranks) +
                " ranks is not a rank: need ranks >= 1 and 0 <= rank < ranks.\nfix: pass this process's rank and the "
                "size of the sp axis.");
  if (shard.replicas < 1 || shard.replica < 0 || shard.replica >= shard.replicas)
    throw Error(what + ": replica " + num(shard.replica) + " of " + num(shard.replicas) +
                " is not a replica: need replicas >= 1 and 0 <= replica < replicas.\nfix: pass this rank's index "
                "along dp and the size of the dp axis.");
  if (file.size() < seq + 1)
    throw Error(what + " holds " + num(file.size()) + " tokens; a row of seq " + num(seq) + " needs seq + 1 = " +
                num(seq + 1) + " (ids plus the next token as label).\nfix: use a larger file or a shorter seq.");
  if (packing_.separator >= vocab)
    throw Error(what + ": the document separator id " + num(packing_.separator) + " is not below the vocab " +
                num(vocab) + ".\nfix: pass the id your tokenizer ends documents with (e.g. its EOS id).");
  if (packing_.separator >= 0 && !packing_.doc_starts.empty())
    throw Error(what + ": documents are given both by a separator id and by a list of starts.\nfix: pass one of them.");
  for (size_t i = 0; i < packing_.doc_starts.size(); ++i)
    if (packing_.doc_starts[i] < 0 || (i > 0 && packing_.doc_starts[i] <= packing_.doc_starts[i - 1]))
      throw Error(what + ": document start " + num(packing_.doc_starts[i]) + " (entry " + num(static_cast<int64_t>(i)) +
                  ") is negative or does not follow the one before.\nfix: list ascending token offsets of the file.");
}

std::vector<int64_t> Batcher::window_starts(int64_t step) const {
  // The same stream the trainer has always used, so old runs resume exactly.
  std::mt19937_64 rng(seed_ * 1000003u + static_cast<uint64_t>(step));
  std::uniform_int_distribution<uint64_t> start(0, static_cast<uint64_t>(file_.size() - seq_ - 1));
  std::vector<int64_t> out(static_cast<size_t>(batch_ * shard_.replicas));
  for (auto& s : out) s = static_cast<int64_t>(start(rng));
  return out;
}

void Batcher::fill(int64_t step, int32_t* input_ids, int32_t* labels, int32_t* position_ids) const {
  const int64_t local = local_seq();
  const auto pieces = shard_.pieces(local);
  const std::vector<int64_t> starts = window_starts(step);
  // Packed rows: a token's position counts from its document's start, which
  // may lie before this rank's pieces; so the rank reads the row from its
  // start up to its last piece (up to the row's end when it holds padding,
  // whose positions continue the row's last document).
  int64_t prefix = 0;
  if (packing_.on())
    for (auto [first, len] : pieces) prefix = std::max(prefix, std::min(first + len, seq_) + 1);
  std::vector<int32_t> row(static_cast<size_t>(std::max(local, prefix) + 1), 0);
  std::vector<int64_t> doc(static_cast<size_t>(prefix), 0);  // packed: where each token's document starts
  auto check = [&](int64_t at, int64_t n) {
    for (int64_t t = 0; t < n; ++t) {
      const int32_t id = row[static_cast<size_t>(t)];
      if (id >= vocab_)
        throw Error("error: " + kind(file_.bytes_per_token()) + " " + quote(file_.path()) + " byte offset " +
                    num((file_.first_token() + at + t) * file_.bytes_per_token()) + " (token " +
                    num(file_.first_token() + at + t) + "): id " + num(id) + " is not below the model's vocab " +
                    num(vocab_) + " (legal ids 0.." + num(vocab_ - 1) +
                    ").\nfix: tokenize with the model's tokenizer, or check the token width.");
    }
  };
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t window = starts[static_cast<size_t>(shard_.replica * batch_ + b)];
    auto starts_doc = [&](int64_t t) {  // packed: whether token t of the row begins a document
      if (t == 0) return true;
      if (packing_.separator >= 0) return row[static_cast<size_t>(t - 1)] == packing_.separator;
      const int64_t at = file_.first_token() + window + t;
      return std::binary_search(packing_.doc_starts.begin(), packing_.doc_starts.end(), at);
    };
    if (prefix > 0) {
      file_.read(window, prefix, row.data());
      check(window, prefix);
      for (int64_t t = 0; t < prefix; ++t) doc[static_cast<size_t>(t)] = starts_doc(t) ? t : doc[static_cast<size_t>(t - 1)];
    }
    int64_t k = b * local;
    for (auto [first, len] : pieces) {
      // Tokens of this piece that exist; the rest (past seq) are padding.
      const int64_t real = std::clamp<int64_t>(seq_ - first, 0, len);
      // Unpacked: the piece of the window, plus one token (the label of its last position).
      const int64_t off = prefix > 0 ? first : 0;
      if (prefix == 0 && real > 0) {
        file_.read(window + first, real + 1, row.data());
        check(window + first, real + 1);
      }
      for (int64_t t = 0; t < len; ++t, ++k) {
        const int64_t g = first + t;  // the token's index in the row
        const bool pad = t >= real;
        input_ids[k] = pad ? 0 : row[static_cast<size_t>(off + t)];
        if (prefix == 0) {
          labels[k] = pad ? static_cast<int32_t>(kIgnoreIndex) : row[static_cast<size_t>(t + 1)];
          position_ids[k] = static_cast<int32_t>(g);  // padding continues the positions: it follows every real token
          continue;
        }
        // Packed: a document's last token predicts nothing (the next token
        // starts another document); padding continues the last document.
        const int64_t at = std::min(g, seq_ - 1);
        labels[k] = pad || starts_doc(g + 1) ? static_cast<int32_t>(kIgnoreIndex) : row[static_cast<size_t>(g + 1)];
        position_ids[k] = static_cast<int32_t>(g - doc[static_cast<size_t>(at)]);
      }
    }
  }
}

Batcher::Batch Batcher::get(int64_t step) const {
  Batch out;
  const auto n = static_cast<size_t>(local_tokens());
  out.input_ids.resize(n);
  out.labels.resize(n);
  out.position_ids.resize(n);
  fill(step, out.input_ids.data(), out.labels.data(), out.position_ids.data());
  return out;
}

}  // namespace halyard::runtime
