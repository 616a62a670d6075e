// The safetensors format layer and the index parser: round trips, XXH64 vectors, and every
// hostile-input case by its message. Single process; needs no FSDP core.
#include <ATen/ATen.h>
#include <fsdp/checkpoint_index.h>
#include <fsdp/error.h>
#include <fsdp/safetensors.h>
#include <fsdp/safetensors_torch.h>
#include <gtest/gtest.h>
#include <harness.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <vector>

namespace fs = std::filesystem;
namespace st = fsdp::safetensors;
namespace ck = fsdp::checkpoint;
using fsdp::testing::expect_error;

namespace {

// The directories temp_dir made, removed when the test program exits.
struct MadeDirs {
  std::vector<fs::path> dirs;
  ~MadeDirs() {
    std::error_code ignored;
    for (const auto& d : dirs) fs::remove_all(d, ignored);
  }
};

std::string temp_dir() {
  static MadeDirs made;
  auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path d = fs::temp_directory_path() /
               (std::string("fsdp_st_") + info->name() + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  made.dirs.push_back(d);
  return d.string();
}

// A file made of an 8-byte length, `header` and `data_bytes` zero bytes; `len_override` replaces
// the length word.
std::string craft(const std::string& dir, const std::string& header, size_t data_bytes,
                  std::optional<uint64_t> len_override = std::nullopt) {
  std::string path = dir + "/crafted.safetensors";
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  uint64_t n = len_override.value_or(header.size());
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>(n >> (8 * i)));
  f << header;
  f << std::string(data_bytes, '\0');
  return path;
}

void open_file(const std::string& path) { st::File::open(path); }

}  // namespace

TEST(Xxh64, KnownVectorsAndStreaming) {
  EXPECT_EQ(st::xxh64("", 0), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(st::xxh64("a", 1), 0xD24EC4F1A98C6E5Bull);
  EXPECT_EQ(st::xxh64("abc", 3), 0x44BC2CF5AD770999ull);
  std::string data;
  for (int i = 0; i < 1000; ++i) data.push_back(static_cast<char>(i * 131 + 7));
  uint64_t whole = st::xxh64(data.data(), data.size());
  for (size_t split : {0, 1, 5, 31, 32, 33, 100, 999}) {
    st::Xxh64 h;
    h.update(data.data(), split);
    for (size_t i = split; i < data.size(); i += 7)
      h.update(data.data() + i, std::min<size_t>(7, data.size() - i));
    EXPECT_EQ(h.digest(), whole) << "split " << split;
  }
}

TEST(Safetensors, RoundTripDtypesShapesMetadata) {
  auto dir = temp_dir();
  std::vector<std::pair<std::string, at::Tensor>> ts = {
      {"w", at::randn({5, 3})},
      {"b", at::arange(7, at::kLong)},
      {"h", at::randn({4, 2}).to(at::kHalf)},
      {"bf", at::randn({3}).to(at::kBFloat16)},
      {"scalar", at::scalar_tensor(3.5, at::kDouble)},
      {"empty", at::empty({0, 4})},
      {"flag", at::arange(3, at::kLong).remainder(2).to(at::kBool)},
  };
  std::vector<st::TensorView> views;
  for (auto& [n, t] : ts) views.push_back(st::view_of(n, t));
  auto sums = st::write(dir + "/a.safetensors", views, {{"format", "pt"}}, 4096);
  EXPECT_EQ(sums.file_bytes, fs::file_size(dir + "/a.safetensors"));
  auto f = st::File::open_verified(dir + "/a.safetensors", sums);
  EXPECT_EQ(f->header().data_start % 8, 0u);
  EXPECT_EQ(f->header().metadata.at("format"), "pt");
  for (auto& [n, t] : ts) {
    auto r = st::read_tensor(*f, n);
    EXPECT_EQ(r.sizes(), t.sizes()) << n;
    EXPECT_EQ(r.scalar_type(), t.scalar_type()) << n;
    EXPECT_TRUE(at::equal(r, t)) << n;
  }
  auto rows = st::read_rows(*f, "w", 1, 4);
  EXPECT_TRUE(at::equal(rows, ts[0].second.slice(0, 1, 4)));
  EXPECT_EQ(st::read_rows(*f, "w", 2, 2).sizes(), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(st::read_rows(*f, "scalar", 0, 1).sizes(), (std::vector<int64_t>{1}));
  expect_error([&] { st::read_rows(*f, "w", 3, 6); },
               {"a.safetensors", "'w'", "rows [3, 6)", "5 rows"});
  expect_error([&] { st::read_tensor(*f, "nope"); },
               {"a.safetensors", "'nope'", "not in this file"});
  f->verify_all();
  // No temporary file is left behind.
  int n = 0;
  for (auto& e : fs::directory_iterator(dir))
    n += e.path().string().find(".tmp") != std::string::npos;
  EXPECT_EQ(n, 0);
}

TEST(Safetensors, WriterRejectsBadInput) {
  auto dir = temp_dir();
  float x[2] = {1, 2};
  expect_error(
      [&] {
        st::write(dir + "/x", {{"a", "F32", {2}, x, 8}, {"a", "F32", {2}, x, 8}});
      },
      {"'a'", "twice"});
  expect_error([&] { st::write(dir + "/x", {{"a", "F32", {3}, x, 8}}); }, {"'a'", "need"});
  expect_error(
      [&] {
        st::write(dir + "/x", {{"__metadata__", "F32", {2}, x, 8}});
      },
      {"invalid name"});
  expect_error(
      [&] {
        st::write(dir + "/nodir/x", {{"a", "F32", {2}, x, 8}});
      },
      {"nodir", "cannot create"});
}

TEST(SafetensorsHostile, HeaderLengthBeyondFile) {
  auto dir = temp_dir();
  auto p = craft(dir, "{}", 0, 1000);
  expect_error([&] { open_file(p); },
               {"crafted.safetensors", "header length 1000 is beyond the file"});
}

TEST(SafetensorsHostile, HeaderLengthOverCap) {
  auto dir = temp_dir();
  auto p = craft(dir, "{}", 0, 200'000'000ull);
  expect_error([&] { open_file(p); }, {"crafted.safetensors", "exceeds the cap of 100000000"});
  auto q = craft(dir, "{}", 0, ~0ull);
  expect_error([&] { open_file(q); }, {"exceeds the cap"});
}

TEST(SafetensorsHostile, ShorterThanLengthWord) {
  auto dir = temp_dir();
  std::string p = dir + "/short.safetensors";
  std::ofstream(p) << "abc";
  expect_error([&] { open_file(p); }, {"short.safetensors", "3 bytes, shorter than the 8-byte"});
}

TEST(SafetensorsHostile, InvalidJson) {
  auto dir = temp_dir();
  expect_error([&] { open_file(craft(dir, "{\"a\": {\"dtype\": ", 0)); },
               {"crafted", "not valid JSON"});
  expect_error([&] { open_file(craft(dir, "[1, 2]  ", 0)); }, {"does not start with '{'"});
  expect_error([&] { open_file(craft(dir, std::string("{\"\xff\": 1}"), 0)); }, {"not valid JSON"});
  std::string deep = "{\"a\":" + std::string(50, '[') + std::string(50, ']') + "}";
  expect_error([&] { open_file(craft(dir, deep, 0)); }, {"nests deeper"});
}

TEST(SafetensorsHostile, UnknownDtype) {
  auto dir = temp_dir();
  auto p = craft(dir, R"({"w":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", 16);
  expect_error([&] { open_file(p); }, {"crafted", "tensor 'w'", "unknown dtype 'F128'"});
}

TEST(SafetensorsHostile, OverflowingShapeProduct) {
  auto dir = temp_dir();
  // 2^32 * 2^32 wraps to 0 in unchecked 64-bit arithmetic: an "empty" tensor that is not.
  auto p = craft(
      dir, R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0);
  expect_error([&] { open_file(p); }, {"tensor 'w'", "overflows 64 bits"});
  auto q =
      craft(dir, R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}})", 0);
  expect_error([&] { open_file(q); }, {"tensor 'w'", "overflows 64 bits"});
  auto r = craft(dir, R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", 0);
  expect_error([&] { open_file(r); }, {"tensor 'w'", "non-negative"});
}

TEST(SafetensorsHostile, ByteSizeMismatch) {
  auto dir = temp_dir();
  auto p = craft(dir, R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8);
  expect_error([&] { open_file(p); }, {"tensor 'w'", "span 8 bytes", "needs 12 bytes"});
}

TEST(SafetensorsHostile, OffsetsOutOfRange) {
  auto dir = temp_dir();
  auto p = craft(dir, R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8);
  expect_error([&] { open_file(p); }, {"tensor 'w'", "run past the data section of 8 bytes"});
  auto q = craft(dir, R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 8);
  expect_error([&] { open_file(q); }, {"tensor 'w'", "end before they begin"});
  auto r =
      craft(dir, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,0]}})", 8);
  expect_error([&] { open_file(r); }, {"tensor 'w'"});
}

TEST(SafetensorsHostile, OverlappingGapsAndTrailingBytes) {
  auto dir = temp_dir();
  auto p = craft(
      dir,
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      12);
  expect_error([&] { open_file(p); }, {"tensor 'b'", "overlap tensor 'a'"});
  auto q = craft(
      dir,
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
      12);
  expect_error([&] { open_file(q); }, {"tensor 'b'", "gap of 4 bytes"});
  auto r = craft(dir, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 12);
  expect_error([&] { open_file(r); }, {"cover 4 bytes", "12 bytes", "trailing"});
}

TEST(SafetensorsHostile, DuplicateNamesAndFields) {
  auto dir = temp_dir();
  auto p = craft(
      dir,
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
      8);
  expect_error([&] { open_file(p); }, {"crafted", "'a' appears twice"});
  auto q = craft(dir, R"({"a":{"dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4]}})", 4);
  expect_error([&] { open_file(q); }, {"'dtype' appears twice"});
  auto r = craft(dir, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", 4);
  expect_error([&] { open_file(r); }, {"tensor 'a'", "unknown field 'x'"});
  auto s = craft(dir, R"({"__metadata__":{"k":1}})", 0);
  expect_error([&] { open_file(s); }, {"__metadata__ value of 'k'"});
}

TEST(SafetensorsHostile, TruncatedFile) {
  auto dir = temp_dir();
  auto t = at::randn({64, 16});
  std::string path = dir + "/t.safetensors";
  st::write(path, {st::view_of("w", t)});
  fs::resize_file(path, fs::file_size(path) - 100);
  expect_error([&] { open_file(path); }, {"t.safetensors", "tensor 'w'", "truncated"});
  fs::resize_file(path, 20);
  expect_error([&] { open_file(path); }, {"t.safetensors", "beyond the file"});
}

TEST(SafetensorsHostile, ChecksumMismatch) {
  auto dir = temp_dir();
  auto a = at::randn({2048});
  auto b = at::randn({2048});
  std::string path = dir + "/c.safetensors";
  auto sums = st::write(path, {st::view_of("a", a), st::view_of("b", b)}, {}, 4096);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(sums.file_bytes - 10));
    f.put('\x55');
  }
  auto f = st::File::open_verified(path, sums);
  // Tensor 'a' lies in blocks that are intact; 'b' ends in the damaged block.
  EXPECT_TRUE(at::equal(st::read_tensor(*f, "a"), a));
  expect_error([&] { st::read_tensor(*f, "b"); },
               {"c.safetensors", "checksum mismatch in block", "tensor 'b'"});
  expect_error([&] { f->verify_all(); }, {"checksum mismatch"});
  auto wrong = sums;
  wrong.file_bytes += 1;
  expect_error([&] { st::File::open_verified(path, wrong); },
               {"c.safetensors", "the index says", "truncated or replaced"});
}

// ---- the index ----
namespace {
ck::Index sample_index() {
  ck::Index idx;
  idx.world_size = 2;
  idx.optimizer = "adamw";
  idx.state.step = 7;
  idx.state.data_position = 1234;
  idx.state.rng_state = std::string("\x00\x01\xff", 3);
  idx.state.extra = {{"lr", 0.1}};
  for (int r = 0; r < 2; ++r) {
    ck::FileEntry f;
    f.name = ck::rank_file_name(r);
    f.sums.file_bytes = 5000;
    f.sums.block_bytes = 4096;
    f.sums.xxh64 = 42 + r;
    f.sums.blocks = {1, 2};
    idx.files.push_back(f);
  }
  ck::IndexEntry w{"w", "F32", {3, 4}, false, {{0, 0, 2}, {1, 2, 3}}};
  ck::IndexEntry s{"w::step", "I64", {}, true, {{0, 0, 1}}};
  // Split on dim 1 (ShardOptions::shard_placement_fn): 5 columns as 3 + 2.
  ck::IndexEntry e{"x", "F32", {2, 5}, false, {{0, 0, 3}, {1, 3, 5}}, 1};
  idx.tensors = {w, s, e};
  return idx;
}
}  // namespace

TEST(CheckpointIndex, RoundTrip) {
  auto idx = sample_index();
  auto back = ck::parse_index(ck::index_to_json(idx), "mem");
  EXPECT_EQ(back.world_size, 2);
  EXPECT_EQ(back.state.step, 7);
  EXPECT_EQ(back.state.data_position, 1234);
  EXPECT_EQ(back.state.rng_state, idx.state.rng_state);
  EXPECT_EQ(back.state.extra["lr"].get<double>(), 0.1);
  ASSERT_NE(back.find("w"), nullptr);
  EXPECT_EQ(back.find("w")->pieces.size(), 2u);
  EXPECT_EQ(back.find("w")->pieces[1].row_end, 3);
  EXPECT_TRUE(back.find("w::step")->replicated);
  EXPECT_EQ(back.find("w")->dim, 0);
  EXPECT_EQ(back.find("x")->dim, 1);
  EXPECT_EQ(back.find("x")->rows(), 5);
  EXPECT_EQ(back.find("x")->pieces[1].row_end, 5);
  EXPECT_EQ(back.files[1].sums.xxh64, 43u);
  auto j = nlohmann::json::parse(ck::index_to_json(idx));
  EXPECT_EQ(j["tensors"]["x"]["kind"], "slices");
  EXPECT_EQ(j["tensors"]["w"]["kind"], "rows");
  EXPECT_FALSE(j["tensors"]["w"].contains("dim"));
}

// The index records a checksum of its own content: an edit that leaves it valid (another data
// position, RNG state or trainer setting, a tensor's entry or a file's checksum changed) is
// refused, naming how to mean it; without the field (an older index, or an edit meant) it is read
// as it stands. Its whitespace and the trainer's floating-point settings do not disturb it.
TEST(CheckpointIndexHostile, AnIndexChangedAfterItWasWrittenFailsItsChecksum) {
  auto idx = sample_index();
  idx.state.extra["x"] = 0.30000000000000004;
  idx.state.extra["tiny"] = 1e-300;
  idx.state.extra["neg"] = -0.0;
  const std::string text = ck::index_to_json(idx);
  const auto base = nlohmann::json::parse(text);
  ASSERT_TRUE(base.contains("index_xxh64"));
  EXPECT_EQ(ck::parse_index(text, "idx.json").state.extra["x"].get<double>(), 0.30000000000000004);
  EXPECT_EQ(ck::parse_index(base.dump(), "compact").state.step, 7);
  EXPECT_EQ(ck::parse_index(base.dump(4), "wide").state.step, 7);
  const std::vector<std::function<void(nlohmann::json&)>> edits = {
      [](auto& j) { j["data_position"] = 1235; },
      [](auto& j) { j["rng_state_hex"] = "00"; },
      [](auto& j) { j["extra"]["lr"] = 0.2; },
      [](auto& j) { j["tensors"].erase("w::step"); },
      [](auto& j) { j["files"][1]["xxh64"] = "0000000000000000"; },
  };
  for (size_t k = 0; k < edits.size(); ++k) {
    auto j = base;
    edits[k](j);
    expect_error([&] { ck::parse_index(j.dump(1), "idx.json"); },
                 {"checkpoint index 'idx.json'", "does not match its checksum",
                  "changed after it was written", "remove the field 'index_xxh64'"});
    j.erase("index_xxh64");
    EXPECT_NO_THROW(ck::parse_index(j.dump(1), "idx.json")) << "edit " << k;
  }
  auto j = base;
  j["index_xxh64"] = "xyz";
  expect_error([&] { ck::parse_index(j.dump(), "idx.json"); }, {"index_xxh64 is not 16 hex"});
}

TEST(CheckpointIndexHostile, RejectsBadIndexes) {
  auto base = nlohmann::json::parse(ck::index_to_json(sample_index()));
  auto bad = [&](auto mutate, std::initializer_list<std::string> parts) {
    auto j = base;
    mutate(j);
    expect_error([&] { ck::parse_index(j.dump(), "idx.json"); }, parts);
  };
  bad([](auto& j) { j["files"][0]["name"] = "../../etc/passwd"; },
      {"idx.json", "files[0]", "is not 'rank0.safetensors'"});
  bad([](auto& j) { j["world_size"] = 0; }, {"world_size = 0"});
  bad(
      [](auto& j) {
        j["tensors"]["w"]["pieces"][1]["rows"] = {3, 3};
      },
      {"tensor 'w'", "do not continue"});
  bad(
      [](auto& j) {
        j["tensors"]["w"]["pieces"][1]["rows"] = {1, 3};
      },
      {"tensor 'w'", "do not continue at row 2"});
  bad([](auto& j) { j["tensors"]["w"]["pieces"].erase(1); }, {"tensor 'w'", "rows are missing"});
  bad([](auto& j) { j["tensors"]["w"]["pieces"][1]["rank"] = 5; }, {"piece rank = 5"});
  bad(
      [](auto& j) {
        j["tensors"]["w"]["shape"] = {4294967296, 4294967296};
      },
      {"tensor 'w'", "overflows"});
  bad([](auto& j) { j["tensors"]["w"]["dtype"] = "Q4"; }, {"tensor 'w'", "unknown dtype"});
  bad([](auto& j) { j["tensors"]["x"]["dim"] = 2; }, {"tensor 'x' dim = 2"});
  bad([](auto& j) { j["tensors"]["x"].erase("dim"); }, {"tensor 'x'", "dim"});
  bad(
      [](auto& j) {
        j["tensors"]["x"]["pieces"][1]["rows"] = {3, 4};
      },
      {"tensor 'x'", "rows are missing"});
  bad(
      [](auto& j) {
        j["tensors"]["w::step"]["kind"] = "slices";
        j["tensors"]["w::step"]["dim"] = 1;
      },
      {"tensor 'w::step'", "kind 'slices' needs at least 2 dims"});
  bad([](auto& j) { j["tensors"]["x"]["kind"] = "cols"; },
      {"tensor 'x'", "kind 'cols' is not 'rows', 'slices' or 'replicated'"});
  bad([](auto& j) { j["files"][1]["xxh64"] = "xyz"; }, {"files[1] xxh64", "16 hex"});
  bad([](auto& j) { j["files"][1]["block_xxh64"].erase(0); }, {"files[1] block_xxh64 must list 2"});
  bad([](auto& j) { j["rng_state_hex"] = "abc"; }, {"rng_state_hex (3 characters) is not hex"});
  bad([](auto& j) { j["rng_state_hex"] = "zz"; }, {"rng_state_hex (2 characters) is not hex"});
  bad([](auto& j) { j.erase("step"); }, {"missing the field 'step'"});
  bad([](auto& j) { j["format_version"] = 2; }, {"format_version 2 is not supported"});
  expect_error([] { ck::parse_index("{\"a\":1,\"a\":2}", "dup.json"); },
               {"dup.json", "'a' appears twice"});
  expect_error([] { ck::parse_index("{\"format\":", "cut.json"); }, {"cut.json", "not valid JSON"});
  expect_error([] { ck::parse_index(std::string(40, '[') + std::string(40, ']'), "deep.json"); },
               {"deeper"});
}

// ---- independent reader ----
TEST(Safetensors, PythonReaderAgrees) {
  const char* py = "/usr/bin/python3";
  if (::access(py, X_OK) != 0) GTEST_SKIP() << py << " not found; the independent reader needs it";
  auto dir = temp_dir();
  auto w = at::arange(12, at::kFloat).reshape({3, 4});
  auto b = at::arange(5, at::kLong);
  auto s = at::scalar_tensor(2.5, at::kDouble);
  auto h = at::full({2, 2}, 0.5).to(at::kHalf);
  std::string path = dir + "/p.safetensors";
  st::write(path,
            {st::view_of("w", w), st::view_of("b", b), st::view_of("s", s), st::view_of("h", h)},
            {{"step", "3"}});
  auto r = fsdp::testing::run_process({py, FSDP_SOURCE_DIR "/tests/read_safetensors.py", path},
                                      std::chrono::seconds(30));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("w F32 [3, 4] sum=66"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("b I64 [5] sum=10"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("s F64 [] sum=2.5"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("h F16 [2, 2] sum=2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("metadata step=3"), std::string::npos) << r.output;
}
