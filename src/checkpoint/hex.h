// Hex codec: the one encoder/decoder of hex text in fsdp-cpp (checkpoint checksums, RNG state).
// Lowercase out, either case in. Torch-free. Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fsdp::hex {

// Two lowercase digits per byte, in byte order.
std::string encode(std::string_view bytes);
// The bytes of an even-length string of hex digits; nullopt for odd length or a non-hex digit.
std::optional<std::string> decode(std::string_view text);

// Exactly 16 lowercase digits, most significant first (how XXH64 digests are written).
std::string encode_u64(uint64_t v);
// The value of exactly 16 hex digits; nullopt otherwise.
std::optional<uint64_t> decode_u64(std::string_view text);

}  // namespace fsdp::hex
