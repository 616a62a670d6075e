// fsdp-train's config files (JSON or TOML, by extension), flattened to the text of each setting
// for the CLI11 options to parse (config.cpp). Internal to src/train. Free of torch headers.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::train {

// The text CLI11 parses for one JSON setting; throws naming `where` for arrays and objects.
std::string json_setting_text(const nlohmann::json& value, const std::string& where,
                              const std::string& key);

// A config file flattened to key -> value text, in file order. Nested tables and arrays are errors:
// every setting is a scalar.
std::vector<std::pair<std::string, std::string>> load_config_file(const std::string& path);

}  // namespace fsdp::train
