// What the safetensors layer's header parser and file I/O share: the errors, every message naming
// the file (and the tensor), quoting names from the file with a bounded length; checked sizes.
// Internal.
#pragma once

#include <fsdp/error.h>

#include <cstdint>
#include <string>

#include "util/shown.h"

namespace fsdp::safetensors::internal {

using detail::shown;

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
