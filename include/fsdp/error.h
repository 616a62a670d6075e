// fsdp::Error: the one exception type of fsdp-cpp, and FSDP_CHECK to raise it.
// A message names the thing, the value seen, the value expected and the fix.
// Thread-safety: stateless.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace fsdp {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error("fsdp: " + what) {}
};

// A collective did not complete in time, or failed in the transport.
class CommError : public Error {
 public:
  using Error::Error;
};

// The post-backward audit found a broken invariant (Final, Once, Agreed, Complete).
class AuditError : public Error {
 public:
  using Error::Error;
};

namespace detail {
inline void stream_all(std::ostringstream&) {}
template <class T, class... R>
void stream_all(std::ostringstream& os, const T& t, const R&... rest) {
  os << t;
  stream_all(os, rest...);
}
template <class... A>
std::string cat(const A&... a) {
  std::ostringstream os;
  stream_all(os, a...);
  return os.str();
}
}  // namespace detail

}  // namespace fsdp

// FSDP_CHECK(cond, parts...): throws fsdp::Error with the parts streamed together.
#define FSDP_CHECK(cond, ...)                                           \
  do {                                                                  \
    if (!(cond)) throw ::fsdp::Error(::fsdp::detail::cat(__VA_ARGS__)); \
  } while (0)
