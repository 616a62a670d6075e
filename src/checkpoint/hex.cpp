#include "checkpoint/hex.h"

namespace fsdp::hex {
namespace {

constexpr char kDigits[] = "0123456789abcdef";

int digit_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string encode(std::string_view bytes) {
  std::string s;
  s.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    s.push_back(kDigits[c >> 4]);
    s.push_back(kDigits[c & 15]);
  }
  return s;
}

std::optional<std::string> decode(std::string_view text) {
  if (text.size() % 2 != 0) return std::nullopt;
  std::string out(text.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = digit_value(text[2 * i]), lo = digit_value(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out[i] = static_cast<char>(hi * 16 + lo);
  }
  return out;
}

std::string encode_u64(uint64_t v) {
  std::string be(8, '\0');
  for (int i = 7; i >= 0; --i, v >>= 8) be[i] = static_cast<char>(v & 0xff);
  return encode(be);
}

std::optional<uint64_t> decode_u64(std::string_view text) {
  if (text.size() != 16) return std::nullopt;
  auto bytes = decode(text);
  if (!bytes) return std::nullopt;
  uint64_t v = 0;
  for (unsigned char c : *bytes) v = (v << 8) | c;
  return v;
}

}  // namespace fsdp::hex
