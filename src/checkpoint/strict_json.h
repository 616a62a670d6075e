// Strict JSON for untrusted checkpoint text (the safetensors header, index.json): nlohmann::json
// keeps the last of duplicate keys silently, and a parser that picks one of two differing entries
// is how two readers come to disagree; deep nesting is how a small file costs a deep recursion.
// Torch-free (fuzzed with the parsers). Thread-safety: reentrant.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace fsdp::detail {

// Parses `text`, rejecting a key repeated within one object and objects/arrays nested deeper than
// `max_depth`. Throws fsdp::Error "<context>: <reason>", the reason being one of
//   "not valid JSON: <parser message>",
//   "the key '<k>' appears twice in one object; duplicate keys are forbidden ...",
//   "nests deeper than <max_depth> levels ...".
nlohmann::json parse_json_strict(std::string_view text, int max_depth, const std::string& context);

}  // namespace fsdp::detail
