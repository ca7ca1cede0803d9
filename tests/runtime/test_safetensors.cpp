// Tests for runtime/safetensors: round trips, exact float conversions, reading
// files laid out the way Python's safetensors writes them, one test per kind of
// malformed file (each checking the message names the file, the numbers and the
// fix), and the atomic writer leaving an old file intact when a write fails
// (file size limit, or HALYARD_TEST_FAIL_WRITE_AFTER_BYTES). Also the pieces
// checkpoints are built from: XXH64 against the reference's vectors, the
// streaming writer, and MappedSafetensors (conversion through windows, NaN and
// infinity found past the first window, validation as strict as read()).
#include "runtime/safetensors.h"

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <stdlib.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/file_io.h"

namespace halyard::runtime {
namespace {

namespace fs = std::filesystem;

using Bytes = std::vector<uint8_t>;

// A file: the 8-byte little-endian length of `header`, `header`, then
// `buffer_bytes` bytes counting up from 0.
Bytes make_file(const std::string& header, size_t buffer_bytes = 0) {
  Bytes out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(uint64_t{header.size()} >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  for (size_t i = 0; i < buffer_bytes; ++i) out.push_back(static_cast<uint8_t>(i));
  return out;
}

// A file whose length prefix says `length`, followed by `rest` verbatim.
Bytes make_file_with_length(uint64_t length, const std::string& rest) {
  Bytes out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(length >> (8 * i)));
  out.insert(out.end(), rest.begin(), rest.end());
  return out;
}

Bytes read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), {});
}

void write_bytes(const fs::path& p, const Bytes& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Runs `f`, expects a runtime::Error, and returns its message ("" if none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected halyard::runtime::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected halyard::runtime::Error, nothing was thrown";
  return "";
}

void expect_contains(const std::string& message, std::initializer_list<std::string> parts) {
  for (const std::string& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos)
        << "message lacks \"" << part << "\"; message was:\n" << message;
  }
}

Tensor make_tensor(Dtype dtype, std::vector<int64_t> shape) {
  Tensor t{dtype, std::move(shape), {}};
  t.bytes.resize(static_cast<size_t>(t.numel()) * dtype_size(dtype));
  for (size_t i = 0; i < t.bytes.size(); ++i) t.bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  return t;
}

Tensor u16_tensor(Dtype dtype, const std::vector<uint16_t>& bits) {
  Tensor t{dtype, {static_cast<int64_t>(bits.size())}, {}};
  t.bytes.resize(bits.size() * 2);
  std::memcpy(t.bytes.data(), bits.data(), t.bytes.size());
  return t;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("halyard_st_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes `bytes` to a file, reads it back expecting an error that starts
  // with the house prefix naming the file and contains every part.
  void expect_read_error(const Bytes& bytes, std::initializer_list<std::string> parts) {
    const std::string path = (dir_ / "bad.safetensors").string();
    write_bytes(path, bytes);
    std::string message = error_of([&] { Safetensors::read(path); });
    const std::string prefix = "error: safetensors file \"" + path + "\"";
    EXPECT_EQ(message.rfind(prefix, 0), 0u) << "message does not start with " << prefix << ":\n"
                                            << message;
    expect_contains(message, parts);
  }

  // Names of files in dir_ other than `keep` (leftover temp files).
  std::vector<std::string> stray_files(const std::string& keep) const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().filename() != keep) out.push_back(e.path().filename().string());
    }
    return out;
  }

  fs::path dir_;
};

// ---- round trips and layout ------------------------------------------------

TEST_F(SafetensorsTest, RoundTripsEveryDtypeScalarAndEmptyShapes) {
  Safetensors st;
  for (Dtype t : all_dtypes()) {
    std::string n(dtype_name(t));
    st.put(n + ".matrix", make_tensor(t, {2, 3}));
    st.put(n + ".scalar", make_tensor(t, {}));
    st.put(n + ".empty", make_tensor(t, {0, 4}));
  }
  st.metadata = {{"format", "pt"}, {"step", "12"}};
  const std::string path = (dir_ / "all.safetensors").string();
  st.write(path);

  Safetensors back = Safetensors::read(path);
  EXPECT_EQ(back.names(), st.names());
  EXPECT_EQ(back.size(), 3 * all_dtypes().size());
  EXPECT_EQ(back.metadata, st.metadata);
  for (const std::string& n : st.names()) {
    SCOPED_TRACE(n);
    EXPECT_EQ(back.at(n).dtype, st.at(n).dtype);
    EXPECT_EQ(back.at(n).shape, st.at(n).shape);
    EXPECT_EQ(back.at(n).bytes, st.at(n).bytes);
  }
  EXPECT_EQ(back.at("F32.scalar").numel(), 1);
  EXPECT_EQ(back.at("F32.scalar").bytes.size(), 4u);
  EXPECT_EQ(back.at("BF16.empty").numel(), 0);
  EXPECT_TRUE(back.at("BF16.empty").bytes.empty());
  EXPECT_EQ(read_bytes(path), st.serialize());
}

TEST_F(SafetensorsTest, TypedPutsRoundTrip) {
  Safetensors st;
  st.put_f32("w", {2, 2}, {1.5f, -2.0f, 0.0f, 3.25f});
  st.put_f64("loss", {}, {2.718281828459045});
  st.put_i32("ids", {3}, {7, -1, 255});
  Safetensors back = Safetensors::parse(st.serialize(), "memory");
  EXPECT_EQ(back.to_f32("w"), (std::vector<float>{1.5f, -2.0f, 0.0f, 3.25f}));
  EXPECT_EQ(back.to_f64("loss"), std::vector<double>{2.718281828459045});
  EXPECT_EQ(back.to_i32("ids"), (std::vector<int32_t>{7, -1, 255}));
  EXPECT_EQ(back.to_f64("w")[3], 3.25);
}

TEST_F(SafetensorsTest, WriterSortsPadsAndPacksTensors) {
  Safetensors a, b;
  a.put_f32("zeta", {1}, {1.0f});
  a.put_i32("alpha", {2}, {1, 2});
  b.put_i32("alpha", {2}, {1, 2});
  b.put_f32("zeta", {1}, {1.0f});
  Bytes bytes = a.serialize();
  EXPECT_EQ(bytes, b.serialize()) << "output must not depend on insertion order";

  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  EXPECT_EQ(n % 8, 0u);
  std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(n));
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find("\"alpha\":{\"data_offsets\":[0,8]"), 1u) << header;
  EXPECT_NE(header.find("\"zeta\":{\"data_offsets\":[8,12]"), std::string::npos) << header;
  std::string tail = header.substr(header.rfind('}') + 1);
  EXPECT_EQ(tail, std::string(tail.size(), ' ')) << "padding must be spaces";
  EXPECT_EQ(bytes.size(), 8 + n + 12);
}

TEST_F(SafetensorsTest, PutReplacesTensorOfSameName) {
  Safetensors st;
  st.put_f32("w", {1}, {1.0f});
  st.put_f32("w", {2}, {2.0f, 3.0f});
  EXPECT_EQ(st.size(), 1u);
  EXPECT_EQ(st.to_f32("w"), (std::vector<float>{2.0f, 3.0f}));
}

// ---- conversions -----------------------------------------------------------

TEST_F(SafetensorsTest, F16ConvertsExactly) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(f16_to_f32(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xC000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
  EXPECT_EQ(f16_to_f32(0x7BFF), 65504.0f);                // largest finite
  EXPECT_EQ(f16_to_f32(0x0400), std::ldexp(1.0f, -14));   // smallest normal
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));   // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x03FF), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(f16_to_f32(0x7C00), inf);
  EXPECT_EQ(f16_to_f32(0xFC00), -inf);
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7E00)));
  EXPECT_EQ(std::bit_cast<uint32_t>(f16_to_f32(0x8000)), 0x80000000u);  // -0 keeps its sign

  Safetensors st;
  st.put("h", u16_tensor(Dtype::F16, {0x3C00, 0xC000, 0x0001, 0x7BFF}));
  EXPECT_EQ(st.to_f32("h"), (std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -24), 65504.0f}));
  EXPECT_EQ(st.to_f64("h")[2], std::ldexp(1.0, -24));
}

TEST_F(SafetensorsTest, BF16ConvertsExactly) {
  EXPECT_EQ(bf16_to_f32(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0x4049), 3.140625f);
  EXPECT_EQ(bf16_to_f32(0xC2F7), -123.5f);
  EXPECT_EQ(bf16_to_f32(0x7F7F), std::ldexp(255.0f, 120));  // largest finite
  EXPECT_EQ(bf16_to_f32(0x0001), std::ldexp(1.0f, -133));   // smallest subnormal
  EXPECT_EQ(bf16_to_f32(0xFF80), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7FC0)));

  Safetensors st;
  st.put("b", u16_tensor(Dtype::BF16, {0x3F80, 0x4049, 0xC2F7}));
  EXPECT_EQ(st.to_f32("b"), (std::vector<float>{1.0f, 3.140625f, -123.5f}));
  EXPECT_EQ(st.to_f64("b"), (std::vector<double>{1.0, 3.140625, -123.5}));
}

TEST_F(SafetensorsTest, F64ToF32RoundsToNearestEven) {
  Safetensors st;
  const double ulp = std::ldexp(1.0, -23);  // f32 spacing just above 1
  st.put_f64("x", {4}, {1.0 + ulp / 2, 1.0 + 3 * ulp / 2, 1.0 + ulp / 2 + 1e-12, 1e39});
  std::vector<float> f = st.to_f32("x");
  EXPECT_EQ(f[0], 1.0f);                        // tie goes to the even 1.0
  EXPECT_EQ(f[1], static_cast<float>(1.0 + 2 * ulp));  // tie goes to the even neighbour
  EXPECT_EQ(f[2], static_cast<float>(1.0 + ulp));      // just past the tie rounds up
  EXPECT_EQ(f[3], std::numeric_limits<float>::infinity());
}

TEST_F(SafetensorsTest, ToI32ConvertsIntegersWithRangeCheck) {
  Safetensors st;
  Tensor i64{Dtype::I64, {2}, Bytes(16)};
  int64_t v64[2] = {-5, 1000000};
  std::memcpy(i64.bytes.data(), v64, 16);
  st.put("i64", i64);
  st.put("u8", Tensor{Dtype::U8, {3}, {0, 128, 255}});
  st.put("u16", u16_tensor(Dtype::U16, {65535, 1}));
  Tensor i8{Dtype::I8, {1}, {0xFF}};
  st.put("i8", i8);
  EXPECT_EQ(st.to_i32("i64"), (std::vector<int32_t>{-5, 1000000}));
  EXPECT_EQ(st.to_i32("u8"), (std::vector<int32_t>{0, 128, 255}));
  EXPECT_EQ(st.to_i32("u16"), (std::vector<int32_t>{65535, 1}));
  EXPECT_EQ(st.to_i32("i8"), std::vector<int32_t>{-1});

  Tensor big{Dtype::I64, {2}, Bytes(16)};
  int64_t vbig[2] = {1, int64_t{1} << 40};
  std::memcpy(big.bytes.data(), vbig, 16);
  st.put("big", big);
  expect_contains(error_of([&] { st.to_i32("big"); }),
                  {"tensor \"big\" I64[2]", "element 1 is 1099511627776", "int32 range"});
  Tensor u32{Dtype::U32, {1}, {0, 0, 0, 0x80}};
  st.put("u32", u32);
  expect_contains(error_of([&] { st.to_i32("u32"); }), {"element 0 is 2147483648"});
}

TEST_F(SafetensorsTest, ConversionOfWrongDtypeFails) {
  Safetensors st;
  st.put_i32("ids", {2}, {1, 2});
  st.put_f32("w", {1}, {1.0f});
  st.put("mask", Tensor{Dtype::BOOL, {0}, {}});
  expect_contains(error_of([&] { st.to_f32("ids"); }),
                  {"tensor \"ids\" is I32[2]", "to_f32 reads F32, F64, F16 or BF16", "to_i32"});
  expect_contains(error_of([&] { st.to_f64("ids"); }), {"to_f64 reads"});
  expect_contains(error_of([&] { st.to_i32("w"); }), {"tensor \"w\" is F32[1]", "to_f32"});
  // A wrong dtype is an error even when there are no elements to convert.
  expect_contains(error_of([&] { st.to_i32("mask"); }), {"is BOOL[0]"});
  expect_contains(error_of([&] { st.to_f32("mask"); }), {"is BOOL[0]"});
}

// ---- reading files from other writers --------------------------------------

TEST_F(SafetensorsTest, ReadsPythonStyleFile) {
  // As Python's safetensors writes: metadata first, header padded with spaces
  // to a multiple of 8, offsets relative to the buffer.
  std::string header =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("a":{"dtype":"I64","shape":[],"data_offsets":[8,16]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  Bytes file = make_file(header);
  float b[2] = {0.5f, -4.0f};
  int64_t a = 42;
  const auto* pb = reinterpret_cast<const uint8_t*>(b);
  const auto* pa = reinterpret_cast<const uint8_t*>(&a);
  file.insert(file.end(), pb, pb + 8);
  file.insert(file.end(), pa, pa + 8);
  const std::string path = (dir_ / "python.safetensors").string();
  write_bytes(path, file);

  Safetensors st = Safetensors::read(path);
  EXPECT_EQ(st.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(st.metadata.at("format"), "pt");
  EXPECT_EQ(st.to_f32("b"), (std::vector<float>{0.5f, -4.0f}));
  EXPECT_EQ(st.to_i32("a"), std::vector<int32_t>{42});
  EXPECT_TRUE(st.at("a").shape.empty());
}

TEST_F(SafetensorsTest, ReadsEmptyHeaderAndNullMetadata) {
  EXPECT_EQ(Safetensors::parse(make_file("{}      "), "empty").size(), 0u);
  EXPECT_TRUE(Safetensors::parse(make_file(R"({"__metadata__":null})"), "m").metadata.empty());
}

// ---- malformed files: one test per rule ----------------------------------

TEST_F(SafetensorsTest, RejectsFileShorterThan8Bytes) {
  expect_read_error(Bytes{1, 2, 3}, {"3 bytes", "shorter than the 8-byte header length", "truncated"});
}

TEST_F(SafetensorsTest, RejectsHeaderLengthPastEndOfFile) {
  expect_read_error(make_file_with_length(1000, "{}"),
                    {"header length is 1000 bytes", "only 2 bytes follow", "file is 10 bytes",
                     "truncated?"});
}

TEST_F(SafetensorsTest, RejectsHeaderLengthAbove100MiB) {
  expect_read_error(make_file_with_length(uint64_t{1} << 40, "{}"),
                    {"header length", "1099511627776", "104857600 (100 MiB)", "not a safetensors"});
}

TEST_F(SafetensorsTest, RejectsHeaderThatIsNotJson) {
  expect_read_error(make_file(R"({"w": {"dtype": )"), {"is not valid JSON", "parse error"});
}

TEST_F(SafetensorsTest, RejectsHeaderThatIsNotAnObject) {
  expect_read_error(make_file("[1, 2]  "), {"header is a JSON array", "must be an object"});
}

TEST_F(SafetensorsTest, RejectsHeaderNotStartingWithBrace) {
  expect_read_error(make_file("  {}    "), {"starts with byte 0x20", "not '{'", "padding goes at its end"});
}

TEST_F(SafetensorsTest, RejectsEntryThatIsNotAnObject) {
  expect_read_error(make_file(R"({"w": [1, 2]})"),
                    {"tensor \"w\"", "entry is a JSON array", "\"data_offsets\": [begin, end]"});
}

TEST_F(SafetensorsTest, RejectsEntryLackingAField) {
  expect_read_error(make_file(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", 4),
                    {"tensor \"w\"", "lacks \"dtype\"", "needs \"dtype\", \"shape\" and \"data_offsets\""});
  expect_read_error(make_file(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 4),
                    {"lacks \"shape\""});
  expect_read_error(make_file(R"({"w": {"dtype": "F32", "shape": [1]}})", 4),
                    {"lacks \"data_offsets\""});
}

TEST_F(SafetensorsTest, RejectsUnknownDtype) {
  expect_read_error(make_file(R"({"w": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}})", 1),
                    {"tensor \"w\"", "unknown dtype \"F8_E4M3\"",
                     "legal dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL"});
}

TEST_F(SafetensorsTest, RejectsShapeThatIsNotAnArray) {
  expect_read_error(make_file(R"({"w": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}})", 16),
                    {"tensor \"w\"", "\"shape\" is 4", "array of non-negative integers"});
}

TEST_F(SafetensorsTest, RejectsNegativeOrFractionalDimension) {
  expect_read_error(make_file(R"({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}})", 8),
                    {"tensor \"w\"", "shape [2,-1] has dimension 1 = -1", "is negative"});
  expect_read_error(make_file(R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", 8),
                    {"dimension 0 = 2.5", "is not an integer"});
}

TEST_F(SafetensorsTest, RejectsDataOffsetsThatAreNotTwoIntegers) {
  expect_read_error(make_file(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4),
                    {"tensor \"w\"", "\"data_offsets\" is [0]", "two non-negative integers [begin, end]"});
  expect_read_error(make_file(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]}})", 4),
                    {"two non-negative integers"});
}

TEST_F(SafetensorsTest, RejectsDataOffsetsWithBeginAfterEnd) {
  expect_read_error(make_file(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8),
                    {"tensor \"w\"", "begin 8 > end 4", "begin must be <= end"});
}

TEST_F(SafetensorsTest, RejectsTensorPastEndOfBuffer) {
  const std::string header = R"({"w": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}})";
  const std::string needed = std::to_string(8 + header.size() + 64);
  const std::string has = std::to_string(8 + header.size() + 32);
  expect_read_error(make_file(header, 32),
                    {"tensor \"w\"", "end past the data buffer, which has 32 bytes",
                     "this tensor needs 64", "needs at least " + needed + " bytes but has " + has,
                     "truncated"});
}

TEST_F(SafetensorsTest, RejectsByteLengthNotMatchingShape) {
  expect_read_error(make_file(R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}})", 10),
                    {"tensor \"w\" BF16[2, 3]", "span 10 bytes", "6 elements of BF16 (2 bytes each) need 12 bytes"});
}

TEST_F(SafetensorsTest, RejectsShapeWhoseSizeOverflows) {
  expect_read_error(
      make_file(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})"),
      {"tensor \"w\" F32[4294967296, 4294967296]", "does not fit in 63 bits"});
  expect_read_error(
      make_file(R"({"w": {"dtype": "F32", "shape": [9223372036854775808], "data_offsets": [0, 0]}})"),
      {"exceeds 2^63 - 1"});
  // A zero dimension makes the tensor empty, however large the others are.
  EXPECT_EQ(Safetensors::parse(make_file(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 0], "data_offsets": [0, 0]}})"),
                               "ok")
                .at("w")
                .numel(),
            0);
}

TEST_F(SafetensorsTest, RejectsOverlappingTensors) {
  expect_read_error(make_file(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
                              R"( "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}})",
                              12),
                    {"tensors \"a\" [0, 8) and \"b\" [4, 12) overlap", "exactly one tensor"});
}

TEST_F(SafetensorsTest, RejectsHoleBetweenTensors) {
  expect_read_error(make_file(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                              R"( "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}})",
                              12),
                    {"bytes [4, 8) of the data buffer belong to no tensor", "after \"a\" [0, 4)",
                     "before \"b\" [8, 12)", "fully indexed"});
  expect_read_error(make_file(R"({"b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}})", 8),
                    {"bytes [0, 4)", "at the start of the buffer"});
}

TEST_F(SafetensorsTest, RejectsTrailingBytes) {
  expect_read_error(make_file(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})", 7),
                    {"3 trailing bytes", "buffer has 7 bytes", "cover only 4", "last tensor \"a\" [0, 4)"});
  expect_read_error(make_file("{}", 2), {"2 trailing bytes", "the header is empty"});
}

TEST_F(SafetensorsTest, RejectsMetadataThatIsNotAnObjectOfStrings) {
  expect_read_error(make_file(R"({"__metadata__": ["pt"]})"),
                    {"\"__metadata__\" is a JSON array", "object mapping strings to strings"});
  expect_read_error(make_file(R"({"__metadata__": {"format": "pt", "step": 12}})"),
                    {"\"__metadata__\" key \"step\"", "number value 12", "must be strings"});
}

TEST_F(SafetensorsTest, RejectsDuplicateKeys) {
  expect_read_error(make_file(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                              R"( "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})",
                              4),
                    {"has the key \"a\" twice", "at the top level", "may appear once"});
  expect_read_error(
      make_file(R"({"a": {"dtype": "U8", "dtype": "I8", "shape": [4], "data_offsets": [0, 4]}})", 4),
      {"has the key \"dtype\" twice", "inside the value of \"a\""});
}

TEST_F(SafetensorsTest, RejectsMissingFileAndDirectory) {
  const std::string missing = (dir_ / "nope.safetensors").string();
  expect_contains(error_of([&] { Safetensors::read(missing); }),
                  {"error: safetensors file \"" + missing + "\"", "cannot open it", "No such file"});
  expect_contains(error_of([&] { Safetensors::read(dir_.string()); }), {"is a directory"});
}

// ---- lookups and puts ------------------------------------------------------

TEST_F(SafetensorsTest, AtWithMissingNameListsAvailableNames) {
  Safetensors st;
  for (int i = 0; i < 12; ++i) st.put_f32("layer" + std::to_string(10 + i), {1}, {0.0f});
  std::string message = error_of([&] { st.at("layer99"); });
  expect_contains(message, {"has no tensor \"layer99\"", "it has 12 tensors", "\"layer10\"",
                            "\"layer19\"", "... (2 more)"});
  EXPECT_EQ(message.find("\"layer20\""), std::string::npos) << "only the first 10 are listed";

  const std::string path = (dir_ / "small.safetensors").string();
  Safetensors two;
  two.put_f32("a", {1}, {0.0f});
  two.put_f32("b", {1}, {0.0f});
  two.write(path);
  message = error_of([&] { Safetensors::read(path).at("c"); });
  expect_contains(message, {"error: safetensors file \"" + path + "\"", "has no tensor \"c\"",
                            "it has 2 tensors: \"a\", \"b\""});
  EXPECT_FALSE(two.contains("c"));
  EXPECT_TRUE(two.contains("a"));
}

TEST_F(SafetensorsTest, PutValidatesTensor) {
  Safetensors st;
  Tensor t = make_tensor(Dtype::F32, {2, 3});
  t.bytes.pop_back();
  expect_contains(error_of([&] { st.put("w", t); }),
                  {"put(\"w\") F32[2, 3]", "got 23 bytes", "6 elements of F32 need 24"});
  expect_contains(error_of([&] { st.put("w", Tensor{Dtype::F32, {-1}, {}}); }),
                  {"dimension -1 is negative"});
  expect_contains(error_of([&] { st.put("__metadata__", make_tensor(Dtype::U8, {1})); }),
                  {"reserved"});
  expect_contains(error_of([&] { st.put("", make_tensor(Dtype::U8, {1})); }), {"non-empty"});
  expect_contains(error_of([&] { st.put_f32("v", {2, 2}, {1.0f}); }),
                  {"put(\"v\") F32[2, 2]", "got 1 values, but the shape holds 4"});
  expect_contains(error_of([&] { st.put("big", Tensor{Dtype::F64, {int64_t{1} << 62, 4}, {}}); }),
                  {"does not fit in 63 bits"});
  EXPECT_EQ(st.size(), 0u);
}

// ---- atomic writes ---------------------------------------------------------

TEST_F(SafetensorsTest, WriteIntoMissingDirectoryFails) {
  Safetensors st;
  st.put_f32("w", {1}, {1.0f});
  const std::string path = (dir_ / "no_such_dir" / "ckpt.safetensors").string();
  expect_contains(error_of([&] { st.write(path); }),
                  {"error: safetensors file \"" + path + "\"", "cannot write it",
                   "No such file or directory", "does not exist; create it first"});
  EXPECT_FALSE(fs::exists(dir_ / "no_such_dir"));
}

TEST_F(SafetensorsTest, WriteReplacesExistingFileAndLeavesNoTempFile) {
  const std::string path = (dir_ / "ckpt.safetensors").string();
  Safetensors first, second;
  first.put_f32("w", {1}, {1.0f});
  second.put_f32("w", {2}, {2.0f, 3.0f});
  second.metadata["step"] = "2";
  first.write(path);
  second.write(path);
  EXPECT_EQ(read_bytes(path), second.serialize());
  EXPECT_EQ(Safetensors::read(path).to_f32("w"), (std::vector<float>{2.0f, 3.0f}));
  EXPECT_TRUE(stray_files("ckpt.safetensors").empty());
}

TEST_F(SafetensorsTest, RejectedPutLeavesOldFileIntact) {
  const std::string path = (dir_ / "ckpt.safetensors").string();
  Safetensors st;
  st.put_f32("w", {2}, {1.0f, 2.0f});
  st.write(path);
  const Bytes before = read_bytes(path);
  Tensor tampered = make_tensor(Dtype::F32, {4});
  tampered.bytes.resize(12);
  EXPECT_THROW(st.put("w", tampered), Error);
  st.write(path);  // the object still holds the old tensor
  EXPECT_EQ(read_bytes(path), before);
}

// RLIMIT_FSIZE makes write() fail with EFBIG even for root, deterministically.
TEST_F(SafetensorsTest, FailedWriteLeavesOldFileIntact) {
  const std::string path = (dir_ / "ckpt.safetensors").string();
  Safetensors old_st, new_st;
  old_st.put_f32("w", {2}, {1.0f, 2.0f});
  old_st.write(path);
  const Bytes before = read_bytes(path);
  new_st.put("w", make_tensor(Dtype::F32, {4096}));

  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto saved_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = saved;
  small.rlim_cur = 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string message = error_of([&] { new_st.write(path); });
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, saved_handler);

  expect_contains(message, {"error: safetensors file \"" + path + "\"", "cannot write it",
                            "File too large", "previous file at this path is unchanged"});
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_TRUE(stray_files("ckpt.safetensors").empty()) << "the temp file must be removed";
}

TEST_F(SafetensorsTest, WriteOverDirectoryFailsAndKeepsIt) {
  const fs::path target = dir_ / "ckpt.safetensors";
  fs::create_directories(target / "inner");
  Safetensors st;
  st.put_f32("w", {1}, {1.0f});
  expect_contains(error_of([&] { st.write(target.string()); }),
                  {"cannot write it: renaming", "is a directory"});
  EXPECT_TRUE(fs::is_directory(target / "inner"));
  EXPECT_TRUE(stray_files("ckpt.safetensors").empty()) << "the temp file must be removed";
}

// ---- checksums, streaming writes, injected write failures -----------------

TEST_F(SafetensorsTest, Xxh64MatchesReferenceVectors) {
  // Vectors of the reference implementation (xxhsum), seed 0; lengths cover
  // < 4, 4..7, 8..31, exactly one 32-byte stripe, and beyond.
  const std::vector<std::pair<std::string, uint64_t>> vectors = {
      {"", 0xef46db3751d8e999ull},
      {"a", 0xd24ec4f1a98c6e5bull},
      {"abc", 0x44bc2cf5ad770999ull},
      {"1234", 0xd8316e61d84f6ba4ull},
      {"12345678", 0xd2d02f08cf7cfd4aull},
      {"123456789012345", 0xc377d78ade001a3cull},
      {"1234567890123456", 0xb61c33dc6c59f270ull},
      {"1234567890123456789012345678901", 0x8f367cb873a5376eull},
      {"12345678901234567890123456789012", 0x40fd1aa52d98274cull},
      {"The quick brown fox jumps over the lazy dog", 0x0b242d361fda71bcull},
  };
  for (const auto& [text, want] : vectors) {
    Xxh64 whole;
    whole.update(text.data(), text.size());
    EXPECT_EQ(whole.digest(), want) << '"' << text << '"';
    Xxh64 bytewise;  // the same bytes in pieces of 1 byte
    for (char c : text) bytewise.update(&c, 1);
    EXPECT_EQ(bytewise.digest(), want) << '"' << text << "\" byte by byte";
  }
  EXPECT_EQ(hex64(0x0b242d361fda71bcull), "0b242d361fda71bc");
  // Long input in uneven pieces equals one pass.
  Bytes data(100003);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
  Xxh64 one, pieces;
  one.update(data.data(), data.size());
  for (size_t at = 0, k = 1; at < data.size(); at += k, k = k * 3 % 97 + 1)
    pieces.update(data.data() + at, std::min(k, data.size() - at));
  EXPECT_EQ(pieces.digest(), one.digest());
}

TEST_F(SafetensorsTest, WriteSafetensorsStreamsTheSameBytesAndDigestsThem) {
  Safetensors st;
  st.put("b", make_tensor(Dtype::BF16, {3, 5}));
  st.put("a", make_tensor(Dtype::F32, {1000}));
  st.metadata["format"] = "pt";
  std::map<std::string, TensorView> views;
  for (const std::string& n : st.names()) views[n] = TensorView{st.at(n).dtype, st.at(n).shape, st.at(n).bytes};
  const std::string path = (dir_ / "streamed.safetensors").string();
  const FileDigest d = write_safetensors(path, views, st.metadata);
  EXPECT_EQ(read_bytes(path), st.serialize());
  const FileDigest again = digest_file(path, "safetensors file");
  EXPECT_EQ(d.bytes, again.bytes);
  EXPECT_EQ(d.xxh64, again.xxh64);

  views["a"].bytes = views["a"].bytes.subspan(4);  // one element short
  expect_contains(error_of([&] { write_safetensors(path, views, {}); }),
                  {"error: safetensors file \"" + path + "\"", "tensor \"a\" F32[1000]: got 3996 bytes",
                   "1000 elements of F32 need 4000"});
  EXPECT_EQ(read_bytes(path), st.serialize()) << "a rejected tensor touches no file";
}

TEST_F(SafetensorsTest, InjectedWriteFailureLeavesOldFileIntact) {
  const std::string path = (dir_ / "ckpt.safetensors").string();
  Safetensors old_st, new_st;
  old_st.put_f32("w", {2}, {1.0f, 2.0f});
  old_st.write(path);
  const Bytes before = read_bytes(path);
  new_st.put("w", make_tensor(Dtype::F32, {4096}));
  ::setenv("HALYARD_TEST_FAIL_WRITE_AFTER_BYTES", "1000", 1);
  const std::string message = error_of([&] { new_st.write(path); });
  ::unsetenv("HALYARD_TEST_FAIL_WRITE_AFTER_BYTES");
  expect_contains(message, {"error: safetensors file \"" + path + "\"", "cannot write it: writing",
                            "No space left on device", "is full; free space there",
                            "any previous file at this path is unchanged"});
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_TRUE(stray_files("ckpt.safetensors").empty()) << "the temp file must be removed";
  new_st.write(path);  // the budget ends with the write it was set for
  EXPECT_EQ(read_bytes(path), new_st.serialize());
}

// ---- mapped reading ----------------------------------------------------------

// A file whose tensors cross the 2 MiB windows of MappedSafetensors at odd offsets.
Safetensors float_tensors() {
  Safetensors st;
  std::vector<float> f(700001);
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(i % 1000) / 8.0f - 60.0f;
  st.put_f32("f32", {static_cast<int64_t>(f.size())}, f);
  std::vector<double> d(300001);
  for (size_t i = 0; i < d.size(); ++i) d[i] = 1.0 / static_cast<double>(i + 1);
  st.put_f64("f64", {static_cast<int64_t>(d.size())}, d);
  std::vector<uint16_t> h(1500001);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>((i * 2654435761u) & 0x7bff);  // finite F16
  st.put("f16", u16_tensor(Dtype::F16, h));
  for (uint16_t& b : h) b = static_cast<uint16_t>(b & 0xbf7f);  // finite BF16
  st.put("bf16", u16_tensor(Dtype::BF16, h));
  st.put("small", make_tensor(Dtype::I32, {3}));
  return st;
}

TEST_F(SafetensorsTest, MappedReadF32EqualsToF32ForEveryFloatDtype) {
  const std::string path = (dir_ / "floats.safetensors").string();
  const Safetensors st = float_tensors();
  st.write(path);
  const MappedSafetensors mapped(path);
  EXPECT_EQ(mapped.names(), st.names());
  for (const char* name : {"f32", "f64", "f16", "bf16"}) {
    const std::vector<float> want = st.to_f32(name);
    std::vector<float> got(want.size(), -1.0f);
    mapped.read_f32(name, got.data());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0) << name;
    EXPECT_EQ(mapped.first_non_finite(name), -1) << name;
    EXPECT_EQ(type_string(Tensor{mapped.at(name).dtype, mapped.at(name).shape, {}}), type_string(st.at(name)));
  }
  EXPECT_EQ(mapped.first_non_finite("small"), -1) << "integers hold no NaN";
  expect_contains(error_of([&] { std::vector<float> out(3); mapped.read_f32("small", out.data()); }),
                  {"error: safetensors file \"" + path + "\"", "tensor \"small\" is I32[3]",
                   "reads F32, F64, F16 or BF16"});
  expect_contains(error_of([&] { mapped.at("nope"); }),
                  {"has no tensor \"nope\"", "it has 5 tensors: \"bf16\", \"f16\", \"f32\", \"f64\", \"small\""});
}

TEST_F(SafetensorsTest, MappedFirstNonFiniteFindsNaNAndInfinityPastTheFirstWindow) {
  const std::string path = (dir_ / "bad.safetensors").string();
  Safetensors st = float_tensors();
  auto poke = [&](const std::string& name, size_t i, const void* bits, size_t n) {
    Tensor t = st.at(name);
    std::memcpy(t.bytes.data() + i * n, bits, n);
    st.put(name, t);
  };
  const uint32_t f32_nan = 0x7fc00001;
  const uint64_t f64_ninf = 0xfff0000000000000ull;
  const uint16_t f16_inf = 0x7c00, bf16_nan = 0xffc1;
  poke("f32", 600000, &f32_nan, 4);     // past 2 MiB of F32
  poke("f64", 299999, &f64_ninf, 8);
  poke("f16", 1234567, &f16_inf, 2);
  poke("bf16", 5, &bf16_nan, 2);
  st.write(path);
  const MappedSafetensors mapped(path);
  EXPECT_EQ(mapped.first_non_finite("f32"), 600000);
  EXPECT_EQ(mapped.first_non_finite("f64"), 299999);
  EXPECT_EQ(mapped.first_non_finite("f16"), 1234567);
  EXPECT_EQ(mapped.first_non_finite("bf16"), 5);
}

TEST_F(SafetensorsTest, MappedValidatesLikeRead) {
  const Bytes truncated = make_file(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 10);
  const std::string path = (dir_ / "bad.safetensors").string();
  write_bytes(path, truncated);
  const std::string mapped = error_of([&] { MappedSafetensors m(path); });
  EXPECT_EQ(mapped, error_of([&] { Safetensors::read(path); }));
  expect_contains(mapped, {"error: safetensors file \"" + path + "\"", "truncated"});
  expect_contains(error_of([&] { MappedSafetensors m((dir_ / "missing").string()); }),
                  {"cannot open it", "No such file"});
  write_bytes(path, {});
  expect_contains(error_of([&] { MappedSafetensors m(path); }), {"the file is 0 bytes"});
}

// ---- the committed fixture -------------------------------------------------

TEST_F(SafetensorsTest, ReadsLlamaMicroFixture) {
  const fs::path path = fs::path(HALYARD_SOURCE_DIR) / "tests/fixtures/llama_micro.safetensors";
  if (!fs::exists(path)) {
    GTEST_SKIP() << "[SKIP] " << path << " not present (produced by tests/fixtures/make_llama_fixture.py)";
  }
  Safetensors st = Safetensors::read(path.string());
  ASSERT_TRUE(st.contains("loss"));
  ASSERT_TRUE(st.contains("input_ids"));
  ASSERT_TRUE(st.contains("model.embed_tokens.weight"));
  std::vector<double> loss = st.to_f64("loss");
  ASSERT_EQ(loss.size(), 1u);
  EXPECT_TRUE(std::isfinite(loss[0]) && loss[0] > 0) << loss[0];
  EXPECT_EQ(st.at("input_ids").shape.size(), 2u);
  EXPECT_EQ(st.to_i32("input_ids").size(), static_cast<size_t>(st.at("input_ids").numel()));
  const Tensor& embed = st.at("model.embed_tokens.weight");
  EXPECT_EQ(embed.shape.size(), 2u);
  EXPECT_EQ(st.to_f32("model.embed_tokens.weight").size(), static_cast<size_t>(embed.numel()));
  // Our writer reproduces a file it read, byte for byte, only if the layout
  // conventions agree; at least every tensor must survive a round trip.
  Safetensors back = Safetensors::parse(st.serialize(), "reserialized");
  EXPECT_EQ(back.names(), st.names());
  EXPECT_EQ(back.metadata, st.metadata);
}

}  // namespace
}  // namespace halyard::runtime
