// A name read from untrusted bytes (a checkpoint's index, a safetensors header), quoted for an
// error message: at most 200 characters of it, and its length when cut. Torch-free.
#pragma once

#include <string>

namespace fsdp::detail {

inline std::string shown(const std::string& s) {
  if (s.size() <= 200) return "'" + s + "'";
  return "'" + s.substr(0, 200) + "...' (" + std::to_string(s.size()) + " bytes)";
}

}  // namespace fsdp::detail
