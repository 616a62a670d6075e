// The checkpoint code's shared helpers: the hex codec (generated round trips, every rejection),
// strict JSON (duplicate keys, depth, invalid text, by message) and atomic writes (the committed
// file, nothing left on failure, stale temporaries of dead writers removed, live ones kept).
#include <fsdp/error.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "checkpoint/atomic_file.h"
#include "checkpoint/hex.h"
#include "checkpoint/strict_json.h"
#include "harness.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;

std::string temp_dir() {
  auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path d = fs::temp_directory_path() /
               (std::string("fsdp_io_") + info->name() + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(Hex, GeneratedRoundTripsAgainstPrintf) {
  std::mt19937_64 rng(7);
  for (int n = 0; n < 200; ++n) {
    std::string bytes(n % 37, '\0');
    for (auto& c : bytes) c = static_cast<char>(rng());
    std::string want;  // independent reference: printf
    char buf[3];
    for (unsigned char c : bytes) std::snprintf(buf, sizeof buf, "%02x", c), want += buf;
    EXPECT_EQ(hex::encode(bytes), want);
    EXPECT_EQ(hex::decode(want), bytes);
    std::string upper = want;
    for (auto& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    EXPECT_EQ(hex::decode(upper), bytes);
    const uint64_t v = rng();
    char b16[17];
    std::snprintf(b16, sizeof b16, "%016llx", static_cast<unsigned long long>(v));
    EXPECT_EQ(hex::encode_u64(v), b16);
    EXPECT_EQ(hex::decode_u64(b16), v);
  }
}

TEST(Hex, RejectsOddLengthNonDigitsAndWrongWidth) {
  EXPECT_EQ(hex::decode("abc"), std::nullopt);
  EXPECT_EQ(hex::decode("0g"), std::nullopt);
  EXPECT_EQ(hex::decode(" 0"), std::nullopt);
  EXPECT_EQ(hex::decode(""), std::string());
  EXPECT_EQ(hex::decode_u64("0123456789abcde"), std::nullopt);    // 15 digits
  EXPECT_EQ(hex::decode_u64("0123456789abcdef0"), std::nullopt);  // 17 digits
  EXPECT_EQ(hex::decode_u64("0123456789abcdeX"), std::nullopt);
}

TEST(StrictJson, DuplicateKeysDepthAndInvalidTextByMessage) {
  auto parse = [](const std::string& text, int depth) {
    return detail::parse_json_strict(text, depth, "thing 'x'");
  };
  EXPECT_EQ(parse(R"({"a": {"b": [1, 2]}, "c": "d"})", 3)["a"]["b"][1], 2);
  expect_error([&] { parse(R"({"a": 1, "b": 2, "a": 3})", 8); },
               {"thing 'x': the key 'a' appears twice in one object"});
  expect_error([&] { parse(R"({"o": {"k": 1, "k": 1}})", 8); }, {"the key 'k' appears twice"});
  // The same key in sibling objects is fine.
  EXPECT_NO_THROW(parse(R"([{"k": 1}, {"k": 2}])", 8));
  for (int depth = 1; depth <= 6; ++depth) {
    const std::string nested = std::string(depth, '[') + std::string(depth, ']');
    if (depth <= 4) {
      EXPECT_NO_THROW(parse(nested, 4)) << depth;
    } else {
      expect_error([&] { parse(nested, 4); }, {"thing 'x': nests deeper than 4 levels"});
    }
  }
  expect_error([&] { parse(std::string(100000, '['), 16); }, {"nests deeper than 16 levels"});
  expect_error([&] { parse(R"({"a": )", 8); }, {"thing 'x': not valid JSON"});
  expect_error([&] { parse("{\"\xff\": 1}", 8); }, {"not valid JSON"});
}

TEST(AtomicFile, CommitsWholeFileAndLeavesNothingOnFailure) {
  const std::string dir = temp_dir(), path = dir + "/f.json";
  write_text_atomic(path, "first");
  EXPECT_EQ(slurp(path), "first");
  write_text_atomic(path, "second");
  EXPECT_EQ(slurp(path), "second");
  // A body that fails halfway: the old file stays, no temporary is left.
  EXPECT_THROW(atomic_write(path,
                            [](int fd, const std::string& tmp) {
                              write_all(fd, "partial", 7, tmp);
                              throw Error("disk on fire");
                            }),
               Error);
  EXPECT_EQ(slurp(path), "second");
  EXPECT_FALSE(fs::exists(temporary_path(path)));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  expect_error([&] { write_text_atomic(dir + "/no/such/dir/f", "x"); },
               {"no/such/dir/f.tmp.", "cannot create", "check the directory exists"});
  fs::remove_all(dir);
}

TEST(AtomicFile, StaleTemporariesOfDeadWritersOnly) {
  const std::string dir = temp_dir();
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);  // `child` is now a pid no process holds
  const std::string dead = dir + "/rank1.safetensors.tmp." + std::to_string(child);
  const std::string live = dir + "/rank0.safetensors.tmp." + std::to_string(::getpid());
  for (const auto& p : {dead, live, dir + "/notes.tmp.x1", dir + "/index.json"})
    std::ofstream(p) << "x";
  EXPECT_EQ(remove_stale_temporaries(dir), std::vector<std::string>{dead});
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(dir + "/notes.tmp.x1"));
  EXPECT_TRUE(fs::exists(dir + "/index.json"));
  EXPECT_TRUE(remove_stale_temporaries(dir + "/missing").empty());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fsdp::testing
