#include "train/cli_integers.h"

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <string>

namespace fsdp::train {
namespace {

// Why `value` does not fit, or "" when it does (or is not a number: CLI11's conversion says so).
// Converts as CLI11 does (base 0: 0x.. hexadecimal, 0.. octal) but watches for ERANGE.
std::string out_of_range(const std::string& value, bool is_signed) {
  if (value.empty()) return {};
  const char* begin = value.c_str();
  char* end = nullptr;
  errno = 0;
  if (is_signed) {
    (void)std::strtoll(begin, &end, 0);
  } else {
    if (value.find('-') != std::string::npos)
      return value + " is negative; it must be a non-negative integer";
    (void)std::strtoull(begin, &end, 0);
  }
  if (end != begin + value.size() || errno != ERANGE) return {};
  const std::string limit =
      is_signed ? std::to_string(std::numeric_limits<long long>::max()) + " and at least " +
                      std::to_string(std::numeric_limits<long long>::min())
                : std::to_string(std::numeric_limits<unsigned long long>::max());
  return value + " is out of range: the value must be at most " + limit;
}

}  // namespace

void check_integer_ranges(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    const std::string type = opt->get_type_name();
    const std::string base = type.substr(0, type.find(':'));
    if (base != "INT" && base != "UINT") continue;
    const bool is_signed = base == "INT";
    opt->check(CLI::Validator(
        [is_signed](std::string& value) { return out_of_range(value, is_signed); }, ""));
  }
}

}  // namespace fsdp::train
