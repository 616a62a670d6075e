#include "util/env.h"

#include <fsdp/error.h>

#include <cerrno>
#include <cstdlib>

namespace fsdp::detail {

const char* env_value(const char* name, const EnvLookup& lookup) {
  const char* v = lookup ? lookup(name) : std::getenv(name);
  return (v && *v) ? v : nullptr;
}

std::optional<std::string> env_string(const char* name, const EnvLookup& lookup) {
  const char* v = env_value(name, lookup);
  if (!v) return std::nullopt;
  return std::string(v);
}

bool env_flag(const char* name, const EnvLookup& lookup) {
  const char* v = env_value(name, lookup);
  return v && std::string_view(v) != "0";
}

namespace {

// The whole number `value` spells, or nullopt.
std::optional<long long> whole_number(const char* value) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value, &end, 10);
  if (end == value || *end != '\0' || errno != 0) return std::nullopt;
  return v;
}

}  // namespace

int64_t parse_env_int(const char* name, const char* value, int64_t lo, int64_t hi) {
  const auto v = whole_number(value);
  FSDP_CHECK(v.has_value(), "environment variable ", name, "='", value,
             "' is not an integer; set it to a number in ", lo, "..", hi);
  FSDP_CHECK(*v >= lo && *v <= hi, "environment variable ", name, "=", *v, " is out of range ", lo,
             "..", hi);
  return static_cast<int64_t>(*v);
}

std::optional<int64_t> env_int(const char* name, int64_t lo, int64_t hi, const EnvLookup& lookup) {
  const char* v = env_value(name, lookup);
  if (!v) return std::nullopt;
  return parse_env_int(name, v, lo, hi);
}

std::optional<int64_t> env_int_hint(const char* name, int64_t lo, int64_t hi,
                                    const EnvLookup& lookup) {
  const char* v = env_value(name, lookup);
  if (!v) return std::nullopt;
  const auto n = whole_number(v);
  if (!n || *n < lo || *n > hi) return std::nullopt;
  return static_cast<int64_t>(*n);
}

std::optional<double> env_positive(const char* name, const char* unit, const EnvLookup& lookup) {
  const char* v = env_value(name, lookup);
  if (!v) return std::nullopt;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  FSDP_CHECK(end != v && *end == '\0' && x > 0, name, "='", v, "' is not a positive number of ",
             unit);
  return x;
}

std::string env_choice(const char* name, std::initializer_list<std::string_view> choices,
                       const std::string& fallback, const EnvLookup& lookup) {
  const char* v = env_value(name, lookup);
  if (!v) return fallback;
  std::string allowed;
  for (std::string_view c : choices) {
    if (c == v) return std::string(c);
    allowed += (allowed.empty() ? "" : ", ") + std::string(c);
  }
  throw Error(cat("environment variable ", name, "='", v, "' is not one of ", allowed));
}

VerifyCollectivesEnv verify_collectives_env() {
  static const VerifyCollectivesEnv value = [] {
    const std::string v = env_choice("FSDP_VERIFY_COLLECTIVES", {"0", "1", "full"}, "1");
    return v == "0"      ? VerifyCollectivesEnv::kOff
           : v == "full" ? VerifyCollectivesEnv::kFull
                         : VerifyCollectivesEnv::kAsOptions;
  }();
  return value;
}

}  // namespace fsdp::detail
