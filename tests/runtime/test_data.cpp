// Tests for runtime/data: uint16 and uint32 token files round trip, text maps
// bytes to ids, one test per bad file or bad size (each checking the message),
// labels are the next tokens, batches are a pure function of (seed, step), and
// with P = 2 and 4 ranks along the sequence the ranks' slices concatenate to
// the P = 1 batch exactly, boundary labels included.
#include "runtime/data.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/temp_dir.h"

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "tests/runtime_error_of.h"

namespace halyard::runtime {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using halyard::testing::TempDir;

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Little-endian ids of the given width (2 or 4 bytes).
void write_tokens(const std::string& path, const std::vector<uint32_t>& ids, int width) {
  std::vector<uint8_t> bytes;
  for (uint32_t v : ids)
    for (int k = 0; k < width; ++k) bytes.push_back(static_cast<uint8_t>(v >> (8 * k)));
  write_bytes(path, bytes);
}

using halyard::testing::error_of;

// Token i of the file is (i * 7 + 3) % 1000: distinct neighbours, all < 1000.
std::vector<uint32_t> pattern(int n) {
  std::vector<uint32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<uint32_t>((i * 7 + 3) % 1000);
  return v;
}

TEST(TokenFile, Uint16RoundTrip) {
  TempDir d;
  const std::vector<uint32_t> ids = {0, 1, 255, 256, 4660, 65535, 7};
  write_tokens(d.file("a.bin"), ids, 2);
  const TokenFile f = TokenFile::open(d.file("a.bin"), TokenWidth::U16);
  EXPECT_EQ(f.size(), 7);
  EXPECT_EQ(f.bytes_per_token(), 2);
  std::vector<int32_t> out(ids.size());
  f.read(0, f.size(), out.data());
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(out[i], static_cast<int32_t>(ids[i])) << i;
  std::vector<int32_t> mid(3);
  f.read(2, 3, mid.data());
  EXPECT_EQ(mid, (std::vector<int32_t>{255, 256, 4660}));
}

TEST(TokenFile, Uint32RoundTrip) {
  TempDir d;
  const std::vector<uint32_t> ids = {0, 65536, 100000, 16777216, 2147483647u, 42};
  write_tokens(d.file("a.bin"), ids, 4);
  const TokenFile f = TokenFile::open(d.file("a.bin"), TokenWidth::U32);
  EXPECT_EQ(f.size(), 6);
  std::vector<int32_t> out(ids.size());
  f.read(0, f.size(), out.data());
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(out[i], static_cast<int32_t>(ids[i])) << i;
}

TEST(TokenFile, OddSizeIsAnError) {
  TempDir d;
  write_bytes(d.file("odd.bin"), {1, 0, 2, 0, 3});
  const std::string msg = error_of([&] { TokenFile::open(d.file("odd.bin"), TokenWidth::U16); });
  EXPECT_THAT(msg, HasSubstr("error: uint16 token file \"" + d.file("odd.bin") + "\""));
  EXPECT_THAT(msg, HasSubstr("has 5 bytes, not a multiple of 2"));
  EXPECT_THAT(msg, HasSubstr("--token-width 32"));
  write_bytes(d.file("six.bin"), {1, 0, 2, 0, 3, 0});
  EXPECT_THAT(error_of([&] { TokenFile::open(d.file("six.bin"), TokenWidth::U32); }),
              HasSubstr("has 6 bytes, not a multiple of 4"));
}

TEST(TokenFile, EmptyIsAnError) {
  TempDir d;
  write_bytes(d.file("empty.bin"), {});
  EXPECT_THAT(error_of([&] { TokenFile::open(d.file("empty.bin"), TokenWidth::U16); }),
              HasSubstr("is empty (0 bytes)"));
  EXPECT_THAT(error_of([&] { TokenFile::from_text(d.file("empty.bin")); }), HasSubstr("text file"));
}

TEST(TokenFile, MissingFileIsAnError) {
  EXPECT_THAT(error_of([] { TokenFile::open("/nonexistent/train.bin", TokenWidth::U16); }),
              HasSubstr("\"/nonexistent/train.bin\" cannot be opened"));
}

TEST(TokenFile, ReadOutsideTheFileIsAnError) {
  TempDir d;
  write_tokens(d.file("a.bin"), {1, 2, 3}, 2);
  const TokenFile f = TokenFile::open(d.file("a.bin"), TokenWidth::U16);
  std::vector<int32_t> out(4);
  EXPECT_THAT(error_of([&] { f.read(1, 3, out.data()); }), HasSubstr("holds 3 tokens; read(start 1, n 3)"));
}

TEST(TokenFile, Uint32IdAboveInt32IsAnError) {
  TempDir d;
  write_tokens(d.file("a.bin"), {1, 3000000000u}, 4);
  const TokenFile f = TokenFile::open(d.file("a.bin"), TokenWidth::U32);
  std::vector<int32_t> out(2);
  EXPECT_THAT(error_of([&] { f.read(0, 2, out.data()); }),
              HasSubstr("byte offset 4 (token 1): id 3000000000 does not fit int32"));
}

TEST(TokenFile, TextMapsBytesToIds) {
  TempDir d;
  write_bytes(d.file("t.txt"), {'H', 'i', '\n', 0, 200, 255});
  const TokenFile f = TokenFile::from_text(d.file("t.txt"));
  EXPECT_TRUE(f.is_text());
  EXPECT_EQ(f.size(), 6);
  std::vector<int32_t> out(6);
  f.read(0, 6, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{72, 105, 10, 0, 200, 255}));
}

TEST(Batcher, IdAboveVocabIsAnError) {
  TempDir d;
  std::vector<uint32_t> ids(40, 5);
  ids[17] = 300;
  write_tokens(d.file("a.bin"), ids, 2);
  const TokenFile f = TokenFile::open(d.file("a.bin"), TokenWidth::U16);
  // One row covering the whole file, so token 17 is always read.
  Batcher b(f, 1, 39, 256, 0);
  const std::string msg = error_of([&] { b.get(1); });
  EXPECT_THAT(msg, HasSubstr("uint16 token file \"" + d.file("a.bin") + "\""));
  EXPECT_THAT(msg, HasSubstr("byte offset 34 (token 17): id 300 is not below the model's vocab 256"));
  EXPECT_THAT(msg, HasSubstr("legal ids 0..255"));
}

TEST(Batcher, LabelsAreTheNextTokens) {
  TempDir d;
  const std::vector<uint32_t> ids = pattern(500);
  write_tokens(d.file("a.bin"), ids, 2);
  Batcher b(TokenFile::open(d.file("a.bin"), TokenWidth::U16), 3, 16, 1000, 7);
  for (int64_t step = 1; step <= 4; ++step) {
    const auto batch = b.get(step);
    const auto starts = b.window_starts(step);
    for (int64_t r = 0; r < 3; ++r)
      for (int64_t t = 0; t < 16; ++t) {
        const size_t k = static_cast<size_t>(r * 16 + t), s = static_cast<size_t>(starts[static_cast<size_t>(r)] + t);
        EXPECT_EQ(batch.input_ids[k], static_cast<int32_t>(ids[s]));
        EXPECT_EQ(batch.labels[k], static_cast<int32_t>(ids[s + 1]));
        EXPECT_EQ(batch.position_ids[k], t);
      }
  }
}

TEST(Batcher, PureFunctionOfSeedAndStep) {
  TempDir d;
  write_tokens(d.file("a.bin"), pattern(5000), 4);
  const TokenFile f = TokenFile::open(d.file("a.bin"), TokenWidth::U32);
  Batcher a(f, 4, 32, 1000, 3), b(f, 4, 32, 1000, 3), other_seed(f, 4, 32, 1000, 4);
  const auto a5 = a.get(5);
  const auto a3 = a.get(3);
  const auto b3 = b.get(3);  // the other order, on another object
  const auto b5 = b.get(5);
  EXPECT_EQ(a5.input_ids, b5.input_ids);
  EXPECT_EQ(a5.labels, b5.labels);
  EXPECT_EQ(a3.input_ids, b3.input_ids);
  EXPECT_NE(a3.input_ids, a5.input_ids);
  EXPECT_NE(other_seed.get(5).input_ids, a5.input_ids);
}

void expect_shards_concatenate(int ranks) {
  TempDir d;
  write_tokens(d.file("a.bin"), pattern(3000), 2);
  const TokenFile f = TokenFile::open(d.file("a.bin"), TokenWidth::U16);
  const int64_t batch = 3, seq = 64, local = seq / ranks;
  const Batcher whole(f, batch, seq, 1000, 11);
  for (int64_t step = 1; step <= 3; ++step) {
    const auto full = whole.get(step);
    std::vector<int32_t> ids(full.input_ids.size()), labels(ids.size()), pos(ids.size());
    for (int r = 0; r < ranks; ++r) {
      const Batcher part(f, batch, seq, 1000, 11, Shard{r, ranks});
      ASSERT_EQ(part.local_seq(), local);
      const auto s = part.get(step);
      ASSERT_EQ(static_cast<int64_t>(s.input_ids.size()), batch * local);
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t t = 0; t < local; ++t) {
          const size_t from = static_cast<size_t>(b * local + t), to = static_cast<size_t>(b * seq + r * local + t);
          ids[to] = s.input_ids[from];
          labels[to] = s.labels[from];
          pos[to] = s.position_ids[from];
        }
    }
    EXPECT_EQ(ids, full.input_ids) << "ranks " << ranks << " step " << step;
    EXPECT_EQ(labels, full.labels) << "ranks " << ranks << " step " << step;
    EXPECT_EQ(pos, full.position_ids) << "ranks " << ranks << " step " << step;
    // The boundary: a rank's last label is the next rank's first id.
    for (int64_t b = 0; b < batch; ++b)
      for (int r = 0; r + 1 < ranks; ++r) {
        const size_t last = static_cast<size_t>(b * seq + (r + 1) * local - 1);
        EXPECT_EQ(labels[last], ids[last + 1]);
      }
  }
}

TEST(Batcher, TwoRanksConcatenateToTheWholeBatch) { expect_shards_concatenate(2); }
TEST(Batcher, FourRanksConcatenateToTheWholeBatch) { expect_shards_concatenate(4); }

TEST(Batcher, RanksThatDoNotDivideSeqPadTheLastSlices) {
  TempDir d;
  write_tokens(d.file("a.bin"), pattern(100), 2);
  const TokenFile f = TokenFile::open(d.file("a.bin"), TokenWidth::U16);
  const int64_t seq = 13, ranks = 4, batch = 2, local = 4;  // 16 slots: 3 of padding
  const Batcher whole(f, batch, seq, 1000, 3);
  const auto full = whole.get(7);
  for (int r = 0; r < ranks; ++r) {
    const Batcher part(f, batch, seq, 1000, 3, Shard{r, static_cast<int>(ranks)});
    ASSERT_EQ(part.local_seq(), local);
    const auto s = part.get(7);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < local; ++t) {
        const int64_t g = r * local + t;
        const size_t at = static_cast<size_t>(b * local + t);
        EXPECT_EQ(s.position_ids[at], g);
        if (g < seq) {
          EXPECT_EQ(s.input_ids[at], full.input_ids[static_cast<size_t>(b * seq + g)]) << r << " " << t;
          EXPECT_EQ(s.labels[at], full.labels[static_cast<size_t>(b * seq + g)]) << r << " " << t;
        } else {
          EXPECT_EQ(s.input_ids[at], 0);
          EXPECT_EQ(s.labels[at], kIgnoreIndex);
        }
      }
  }
  EXPECT_THAT(error_of([&] { Batcher(f, 1, 12, 1000, 0, Shard{4, 4}); }), HasSubstr("shard rank 4 of 4 ranks"));
}

TEST(Batcher, FileShorterThanARowIsAnError) {
  TempDir d;
  write_bytes(d.file("t.txt"), {'a', 'b', 'c', 'd'});
  const std::string msg = error_of([&] { Batcher(TokenFile::from_text(d.file("t.txt")), 1, 4, 256, 0); });
  EXPECT_THAT(msg, HasSubstr("holds 4 tokens; a row of seq 4 needs seq + 1 = 5"));
}

TEST(Batcher, TextFileBatches) {
  TempDir d;
  std::string text;
  for (int i = 0; i < 300; ++i) text += static_cast<char>('a' + i % 26);
  write_bytes(d.file("t.txt"), std::vector<uint8_t>(text.begin(), text.end()));
  const Batcher b(TokenFile::from_text(d.file("t.txt")), 2, 10, 256, 0);
  const auto batch = b.get(1);
  const auto starts = b.window_starts(1);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t t = 0; t < 10; ++t) {
      const size_t k = static_cast<size_t>(r * 10 + t), s = static_cast<size_t>(starts[static_cast<size_t>(r)] + t);
      EXPECT_EQ(batch.input_ids[k], static_cast<unsigned char>(text[s]));
      EXPECT_EQ(batch.labels[k], static_cast<unsigned char>(text[s + 1]));
    }
}

// Packed documents: a text "ab.cde.f.gh" with separator '.' holds the
// documents "ab.", "cde.", "f.", "gh"; positions restart after each '.',
// and a '.' (a document's last token) has no label.
TEST(Batcher, PacksDocumentsBySeparator) {
  TempDir d;
  const std::string text = "ab.cde.f.ghij";
  write_bytes(d.file("t.txt"), std::vector<uint8_t>(text.begin(), text.end()));
  // One row of the whole file but its last token: the window starts at 0.
  const Batcher b(TokenFile::from_text(d.file("t.txt")), 1, 12, 256, 0, {}, Packing{'.', {}});
  const auto batch = b.get(1);
  EXPECT_EQ(batch.position_ids, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2}));
  const int32_t x = static_cast<int32_t>(kIgnoreIndex);
  EXPECT_EQ(batch.labels, (std::vector<int32_t>{'b', '.', x, 'd', 'e', '.', x, '.', x, 'h', 'i', 'j'}));
}

// The same packing from a list of document starts (token offsets of the file).
TEST(Batcher, PacksDocumentsByStarts) {
  TempDir d;
  const std::string text = "abcdefghijklm";
  write_bytes(d.file("t.txt"), std::vector<uint8_t>(text.begin(), text.end()));
  std::ofstream(d.file("starts.txt")) << "0 3\n7\n9\n";
  const auto starts = read_doc_starts(d.file("starts.txt"), 13);
  EXPECT_EQ(starts, (std::vector<int64_t>{0, 3, 7, 9}));
  const Batcher b(TokenFile::from_text(d.file("t.txt")), 1, 12, 256, 0, {}, Packing{-1, starts});
  const auto batch = b.get(1);
  EXPECT_EQ(batch.position_ids, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2}));
  const int32_t x = static_cast<int32_t>(kIgnoreIndex);
  EXPECT_EQ(batch.labels, (std::vector<int32_t>{'b', 'c', x, 'e', 'f', 'g', x, 'i', x, 'k', 'l', 'm'}));
  std::ofstream(d.file("bad.txt")) << "0 5\n4\n";
  EXPECT_THAT(error_of([&] { read_doc_starts(d.file("bad.txt"), 13); }),
              HasSubstr("line 2: 4 follows 5; document starts must increase"));
  std::ofstream(d.file("far.txt")) << "0 13\n";
  EXPECT_THAT(error_of([&] { read_doc_starts(d.file("far.txt"), 13); }),
              HasSubstr("\"13\" is not a token offset of the data (0 .. 12)"));
  EXPECT_THAT(error_of([&] { Batcher(TokenFile::from_text(d.file("t.txt")), 1, 12, 256, 0, {}, Packing{300, {}}); }),
              HasSubstr("the document separator id 300 is not below the vocab 256"));
}

// Each rank's slice of a packed row, contiguous or zigzag, padded or not,
// equals that part of the row packed on one rank: positions count from
// documents that began on other ranks.
void expect_packed_shards_match(int ranks, bool zigzag, int64_t seq) {
  TempDir d;
  std::string text;
  for (int i = 0; i < 400; ++i) text += i % 7 == 3 || i % 11 == 0 ? ' ' : static_cast<char>('a' + i % 26);
  write_bytes(d.file("t.txt"), std::vector<uint8_t>(text.begin(), text.end()));
  const TokenFile f = TokenFile::from_text(d.file("t.txt"));
  const Packing words{' ', {}};
  const auto whole = Batcher(f, 2, seq, 256, 3, {}, words).get(5);
  for (int r = 0; r < ranks; ++r) {
    const Shard shard{r, ranks, 0, 1, zigzag};
    const Batcher b(f, 2, seq, 256, 3, shard, words);
    const auto part = b.get(5);
    const auto index = shard.row_index(b.local_seq());
    for (int64_t row = 0; row < 2; ++row)
      for (int64_t t = 0; t < b.local_seq(); ++t) {
        const size_t k = static_cast<size_t>(row * b.local_seq() + t);
        const int64_t g = index[static_cast<size_t>(t)];
        if (g >= seq) {  // padding: positions continue the row's last document
          const size_t last = static_cast<size_t>(row * seq + seq - 1);
          EXPECT_EQ(part.position_ids[k], whole.position_ids[last] + (g - seq + 1)) << "rank " << r << " token " << t;
          EXPECT_EQ(part.labels[k], kIgnoreIndex);
          continue;
        }
        const size_t w = static_cast<size_t>(row * seq + g);
        EXPECT_EQ(part.input_ids[k], whole.input_ids[w]);
        EXPECT_EQ(part.labels[k], whole.labels[w]) << "rank " << r << " token " << t;
        EXPECT_EQ(part.position_ids[k], whole.position_ids[w]) << "rank " << r << " token " << t;
      }
  }
}
TEST(Batcher, PackedShardsAreSlicesOfThePackedRow) {
  expect_packed_shards_match(4, false, 64);
  expect_packed_shards_match(4, true, 64);
  expect_packed_shards_match(4, false, 62);
  expect_packed_shards_match(4, true, 61);
}

}  // namespace
}  // namespace halyard::runtime
