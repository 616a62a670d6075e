// Environment variables: the one place that reads and parses them. Each parser throws fsdp::Error
// naming the variable, the value it holds and what is allowed. Torch-free.
// Thread-safety: reads the environment (std::getenv); do not call concurrently with setenv.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

namespace fsdp::detail {

// Where values come from: std::getenv unless a lookup is given (tests pass a map's).
using EnvLookup = std::function<const char*(const char*)>;

// The value of `name`; nullptr when it is unset or empty.
const char* env_value(const char* name, const EnvLookup& lookup = nullptr);
// The value of `name`; nullopt when it is unset or empty.
std::optional<std::string> env_string(const char* name, const EnvLookup& lookup = nullptr);

// Whether `name` is set, non-empty and not "0" (FSDP_DEBUG=1 and the like).
bool env_flag(const char* name, const EnvLookup& lookup = nullptr);

// `value` of variable `name` as a whole number in [lo, hi]; throws "environment variable
// NAME='value' is not an integer; set it to a number in lo..hi" or "environment variable NAME=v
// is out of range lo..hi".
int64_t parse_env_int(const char* name, const char* value, int64_t lo, int64_t hi);
// parse_env_int of `name`'s value; nullopt when it is unset or empty.
std::optional<int64_t> env_int(const char* name, int64_t lo, int64_t hi,
                               const EnvLookup& lookup = nullptr);
// A hint read leniently: `name`'s value when it is a whole number in [lo, hi], else nullopt
// (unset, empty or anything else: the caller falls back to its default).
std::optional<int64_t> env_int_hint(const char* name, int64_t lo, int64_t hi,
                                    const EnvLookup& lookup = nullptr);

// `name`'s value as a positive number (of `unit`, for the message); nullopt when unset or
// empty; throws "NAME='value' is not a positive number of <unit>".
std::optional<double> env_positive(const char* name, const char* unit,
                                   const EnvLookup& lookup = nullptr);

// `name`'s value, one of `choices`; `fallback` when it is unset or empty; throws "environment
// variable NAME='value' is not one of a, b, c" otherwise.
std::string env_choice(const char* name, std::initializer_list<std::string_view> choices,
                       const std::string& fallback, const EnvLookup& lookup = nullptr);

// FSDP_VERIFY_COLLECTIVES, read once per process: "0" turns verified collectives off, "full"
// checks every byte of every collective, "1" or unset leaves RuntimeOptions as they are; anything
// else throws naming the variable.
enum class VerifyCollectivesEnv { kAsOptions, kOff, kFull };
VerifyCollectivesEnv verify_collectives_env();

}  // namespace fsdp::detail
