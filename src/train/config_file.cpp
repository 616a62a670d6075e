// fsdp-train's config files: JSON or TOML, each setting a scalar (config_file.h).
#include "train/config_file.h"

#include <fsdp/error.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace fsdp::train {
namespace {

std::string format_double(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string file_extension(const std::string& path) {
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return "";
  std::string ext = path.substr(dot + 1);
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  return ext;
}

std::string read_text_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  FSDP_CHECK(in.good(), what, " '", path, "' cannot be opened (", std::strerror(errno),
             "); check the path");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string json_setting_text(const nlohmann::json& value, const std::string& where,
                              const std::string& key) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "true" : "false";
  if (value.is_number_integer() || value.is_number_unsigned()) return value.dump();
  if (value.is_number_float()) return format_double(value.get<double>());
  throw Error(detail::cat(where, ": key '", key, "' has a ", value.type_name(),
                          " value; every setting is a string, number or boolean"));
}

std::vector<std::pair<std::string, std::string>> load_config_file(const std::string& path) {
  const std::string text = read_text_file(path, "config file");
  const std::string ext = file_extension(path);
  std::vector<std::pair<std::string, std::string>> out;
  if (ext == "json") {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      throw Error(detail::cat("config file '", path, "' is not valid JSON: ", e.what()));
    }
    FSDP_CHECK(j.is_object(), "config file '", path,
               "' must hold one JSON object of settings, got ", j.type_name());
    for (const auto& [key, value] : j.items())
      out.emplace_back(key, json_setting_text(value, "config file '" + path + "'", key));
  } else if (ext == "toml") {
    toml::table tbl;
    try {
      tbl = toml::parse(text, path);
    } catch (const toml::parse_error& e) {
      std::ostringstream os;
      os << e.description() << " at line " << e.source().begin.line << ", column "
         << e.source().begin.column;
      throw Error(detail::cat("config file '", path, "' is not valid TOML: ", os.str()));
    }
    for (const auto& [k, node] : tbl) {
      const std::string key(k.str());
      std::string v;
      if (auto s = node.value_exact<std::string>()) {
        v = *s;
      } else if (auto b = node.value_exact<bool>()) {
        v = *b ? "true" : "false";
      } else if (auto i = node.value_exact<int64_t>()) {
        v = std::to_string(*i);
      } else if (auto d = node.value_exact<double>()) {
        v = format_double(*d);
      } else {
        throw Error(detail::cat("config file '", path, "': key '", key,
                                "' is a table, array or date; every setting is a string, number or "
                                "boolean"));
      }
      out.emplace_back(key, v);
    }
  } else {
    throw Error(detail::cat("config file '", path, "' has extension '.", ext,
                            "'; expected .json or .toml (the format is chosen by extension)"));
  }
  return out;
}

}  // namespace fsdp::train
