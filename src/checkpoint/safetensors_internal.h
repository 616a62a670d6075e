// What the safetensors layer's header parser and file I/O share: the errors, every message naming
// the file (and the tensor), quoting names from the file with a bounded length; checked sizes.
// Internal.
#pragma once

#include <fsdp/error.h>

#include <cstdint>
#include <string>

namespace fsdp::safetensors::internal {

// A name from untrusted bytes, quoted: at most 200 characters of it.
inline std::string shown(const std::string& s) {
  if (s.size() <= 200) return "'" + s + "'";
  return "'" + s.substr(0, 200) + "...' (" + std::to_string(s.size()) + " bytes)";
}

[[noreturn]] inline void fail(const std::string& source, const std::string& what) {
  throw Error(detail::cat("safetensors file '", source, "': ", what));
}

[[noreturn]] inline void fail_tensor(const std::string& source, const std::string& name,
                                     const std::string& what) {
  throw Error(detail::cat("safetensors file '", source, "': tensor ", shown(name), ": ", what));
}

// a * b into *out; false when it overflows 64 bits.
inline bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

}  // namespace fsdp::safetensors::internal
