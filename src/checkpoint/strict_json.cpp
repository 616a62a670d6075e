#include "strict_json.h"

#include <fsdp/error.h>

#include <set>
#include <vector>

namespace fsdp::detail {
namespace {

std::string shown(const std::string& s) {
  // Keys come from untrusted bytes: show at most 200 characters of them.
  if (s.size() <= 200) return "'" + s + "'";
  return "'" + s.substr(0, 200) + "...' (" + std::to_string(s.size()) + " bytes)";
}

}  // namespace

nlohmann::json parse_json_strict(std::string_view text, int max_depth, const std::string& context) {
  using json = nlohmann::json;
  std::vector<std::set<std::string>> keys;  // one set per open object or array
  auto cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) {
    using E = json::parse_event_t;
    switch (ev) {
      case E::object_start:
      case E::array_start:
        keys.emplace_back();
        if (static_cast<int>(keys.size()) > max_depth) {
          throw Error(cat(context, ": nests deeper than ", max_depth,
                          " levels; the file is corrupt or crafted"));
        }
        break;
      case E::object_end:
      case E::array_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case E::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second) {
          throw Error(cat(context, ": the key ", shown(parsed.get<std::string>()),
                          " appears twice in one object; duplicate keys are forbidden (the file "
                          "is corrupt or crafted)"));
        }
        break;
      case E::value:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const json::exception& e) {
    throw Error(cat(context, ": not valid JSON: ", e.what()));
  }
}

}  // namespace fsdp::detail
