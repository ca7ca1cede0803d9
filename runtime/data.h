// Training data: token files and the batches a step trains on.
//
// A token file is what common tokenizer pipelines write: a flat array of
// little-endian uint16 or uint32 token ids with no header (nanoGPT's train.bin
// is uint16). A plain text file loads through the same interface with a
// byte-level tokenizer: each byte is one token, 0..255. Files are mapped
// read-only (mmap); nothing is copied until read() asks for a range.
//
//   auto f = TokenFile::open("train.bin", TokenWidth::U16);
//   Batcher b(f, /*batch=*/8, /*seq=*/1024, /*vocab=*/50304, /*seed=*/0, Shard{rank, ranks});
//   b.fill(step, ids, labels, positions);  // each [batch, seq / ranks] int32
//
// The batch of a step is a pure function of (seed, step): row b is the window
// of seq + 1 tokens starting at the b-th draw of mt19937_64(seed * 1000003 +
// step) from [0, size - seq - 1]. Labels are the next tokens, taken BEFORE the
// sequence is split, so the last label of a rank's slice is the first id of
// the next rank's slice: no target is lost at a shard boundary. With P ranks
// along the sequence, each holds L = ceil(seq/P) tokens per row: rank r gets
// the slice [r*L, (r+1)*L) of every row, with global position ids, and reads
// only its tokens plus one. When P does not divide seq, the slices reach past
// seq: those tokens are padding (id 0, label kIgnoreIndex, positions that
// continue past the last real token, so causal attention never lets a real
// token see one). The concatenation of the P slices, padding dropped, equals
// the P=1 batch.
//
// Packed rows (Packing: a separator id, or document starts): position ids
// restart at 0 at each document and a document's last token has no label;
// a rank then reads its row from the row's start, to count positions.
//
// Errors are runtime::Error in the house shape: the file, the rule broken with
// its numbers, and the fix (a file whose size is not a multiple of the id
// width, an empty file, an id >= vocab with its byte offset, a sequence the
// ranks do not divide).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace halyard::runtime {

enum class TokenWidth { U16, U32 };

// The label of a token that has no target (padding); the models' ignore_index.
inline constexpr int64_t kIgnoreIndex = -100;

class TokenFile {
 public:
  // A headerless little-endian array of uint16 or uint32 ids.
  static TokenFile open(const std::string& path, TokenWidth width);
  // A plain text file, one token per byte (ids 0..255).
  static TokenFile from_text(const std::string& path);

  const std::string& path() const;
  // Bytes per token: 2 or 4 (1 for text).
  int bytes_per_token() const;
  bool is_text() const;
  // Number of tokens (of this view).
  int64_t size() const;
  // A view of tokens [begin, end) of this one, sharing its mapping: a held-out
  // validation split is the file's tail, the training split the rest.
  // Positions in errors stay those of the whole file.
  TokenFile slice(int64_t begin, int64_t end) const;
  // Where this view starts in the file, in tokens (0 unless sliced).
  int64_t first_token() const { return first_; }
  // Copies tokens [start, start + n) to out. A range outside [0, size()), or
  // an id that does not fit int32 (a uint32 id >= 2^31), throws naming the
  // file and the numbers.
  void read(int64_t start, int64_t n, int32_t* out) const;

 private:
  struct Mapping;
  static TokenFile map(const std::string& path, int bytes_per_token);
  explicit TokenFile(std::shared_ptr<const Mapping> m) : m_(std::move(m)) {}
  std::shared_ptr<const Mapping> m_;  // shared: copies of a TokenFile share one mapping
  int64_t first_ = 0, count_ = -1;     // the view; count_ -1: the whole file
};

// This rank's place in a dp x sp mesh: rank r of the P ranks along the
// sequence ("sp"), in data-parallel replica d of D ("dp"). Replica d trains
// on its own rows: the batch of a step is D * batch windows, replica d takes
// rows [d * batch, (d + 1) * batch).
// With zigzag, the row is cut in 2 * ranks chunks and rank r holds chunks r
// and 2 * ranks - 1 - r (the placement that balances causal ring attention).
struct Shard {
  int rank = 0;
  int ranks = 1;
  int replica = 0;
  int replicas = 1;
  bool zigzag = false;

  // This rank's pieces of a row, as [first token, length) in the whole row,
  // back to back in its local_seq tokens (one piece, or two zigzag chunks).
  std::vector<std::pair<int64_t, int64_t>> pieces(int64_t local_seq) const;
  // Each local token's index in the whole row (local_seq of them).
  std::vector<int32_t> row_index(int64_t local_seq) const;
};

// Packed documents (HF's packed position_ids): a row may hold several
// documents; position ids restart at 0 at each document's first token, and
// the last token of a document gets no label (its next token belongs to
// another document). Documents end at a separator id (which stays the last
// token of its document), or start at the given token offsets of the file.
// A row's window may begin inside a document: that one counts from 0 there.
struct Packing {
  int64_t separator = -1;            // >= 0: a document ends with each such id
  std::vector<int64_t> doc_starts;   // sorted token offsets in the file where documents start
  bool on() const { return separator >= 0 || !doc_starts.empty(); }
};
// Reads document starts from a text file of token offsets (whitespace
// separated, ascending, each inside the file's tokens); errors name the line.
std::vector<int64_t> read_doc_starts(const std::string& path, int64_t file_tokens);

class Batcher {
 public:
  // Keeps a copy of `file` (which shares its mapping). Checks that the file
  // holds at least seq + 1 tokens, that batch, seq, vocab are positive, that
  // 0 <= rank < ranks.
  Batcher(const TokenFile& file, int64_t batch, int64_t seq, int64_t vocab, uint64_t seed, Shard shard = {},
          Packing packing = {});

  int64_t batch() const { return batch_; }
  int64_t seq() const { return seq_; }  // the global sequence length
  // Tokens per row on this rank: seq / ranks, rounded up (to an even number
  // with zigzag: two equal chunks).
  int64_t local_seq() const {
    const int64_t p = shard_.ranks;
    return shard_.zigzag && p > 1 ? 2 * ((seq_ + 2 * p - 1) / (2 * p)) : (seq_ + p - 1) / p;
  }
  // Elements of each output array: batch * local_seq.
  int64_t local_tokens() const { return batch_ * local_seq(); }
  const Shard& shard() const { return shard_; }

  // Where row b's window starts in the file, for each row of `step` (all
  // replicas' rows: batch * replicas).
  std::vector<int64_t> window_starts(int64_t step) const;

  // Writes this rank's ids, labels and position ids for `step`, each
  // [batch, local_seq] row-major: global positions, or restarting at each
  // document when packing. Throws if a token read is >= vocab, naming
  // the file, its byte offset, the id and the vocab.
  void fill(int64_t step, int32_t* input_ids, int32_t* labels, int32_t* position_ids) const;

  struct Batch {
    std::vector<int32_t> input_ids, labels, position_ids;  // [batch, local_seq]
  };
  Batch get(int64_t step) const;

 private:
  TokenFile file_;
  int64_t batch_, seq_, vocab_;
  uint64_t seed_;
  Shard shard_;
  Packing packing_;
};

}  // namespace halyard::runtime
