#include "train/token_sample.h"

#include <fsdp/error.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

namespace fsdp::train {
namespace {

// GPT-2's bytes_to_unicode, inverted: the code point a byte-level token uses for each byte.
const std::map<uint32_t, uint8_t>& byte_of_code_point() {
  static const std::map<uint32_t, uint8_t> m = [] {
    std::map<uint32_t, uint8_t> out;
    uint32_t extra = 0;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      out[printable ? b : 256 + extra++] = static_cast<uint8_t>(b);
    }
    return out;
  }();
  return m;
}

// The code points of UTF-8 text (invalid bytes pass as themselves).
std::vector<uint32_t> code_points(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (int k = 1; k < n && i + k < s.size(); ++k)
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += n;
  }
  return out;
}

std::string byte_level(const std::string& token) {
  std::string out;
  const auto& table = byte_of_code_point();
  for (uint32_t cp : code_points(token)) {
    const auto it = table.find(cp);
    if (it != table.end()) out.push_back(static_cast<char>(it->second));
  }
  return out;
}

// SentencePiece: "<0x0A>" is a byte, U+2581 a space.
std::string metaspace(const std::string& token) {
  if (token.size() == 6 && token.rfind("<0x", 0) == 0 && token.back() == '>')
    return std::string(1, static_cast<char>(std::stoi(token.substr(3, 2), nullptr, 16)));
  std::string out;
  const std::string space = "\xE2\x96\x81";
  for (size_t i = 0; i < token.size();) {
    if (token.compare(i, space.size(), space) == 0) {
      out.push_back(' ');
      i += space.size();
    } else {
      out.push_back(token[i++]);
    }
  }
  return out;
}

bool uses_metaspace(const nlohmann::json& j) {
  const std::string text = j.contains("decoder") ? j["decoder"].dump() : "";
  return text.find("ByteFallback") != std::string::npos ||
         text.find("Metaspace") != std::string::npos ||
         text.find("\xE2\x96\x81") != std::string::npos;
}

}  // namespace

std::vector<int64_t> sample_prompt_tokens(const TrainConfig& cfg, const Corpus& held_out,
                                          const Corpus& train) {
  std::vector<int64_t> ids;
  if (cfg.was_set("prompt")) {
    std::string text = cfg.prompt;
    std::replace(text.begin(), text.end(), ',', ' ');
    std::istringstream in(text);
    for (std::string word; in >> word;) {
      const bool digits =
          std::all_of(word.begin(), word.end(), [](unsigned char c) { return std::isdigit(c); });
      FSDP_CHECK(digits && word.size() < 12 && std::stoll(word) < cfg.vocab, "--prompt '",
                 cfg.prompt, "': the data are tokens, so the prompt is token ids below --vocab ",
                 cfg.vocab,
                 " (e.g. --prompt \"464,3290\"; scripts/tokenize.py --ids TEXT prints them)");
      ids.push_back(std::stoll(word));
    }
    FSDP_CHECK(!ids.empty(), "--prompt is empty; give token ids, e.g. --prompt \"464,3290\"");
    return ids;
  }
  const Corpus& from = held_out.size() > 0 ? held_out : train;
  for (int64_t i = 0; i < std::min<int64_t>({8, cfg.seq, from.size()}); ++i)
    ids.push_back(from.token(i));
  return ids;
}

TokenizerVocab TokenizerVocab::load(const std::string& path) {
  std::error_code ec;
  const std::string file =
      std::filesystem::is_directory(path, ec) ? path + "/tokenizer.json" : path;
  std::ifstream in(file);
  FSDP_CHECK(in.good(), "--tokenizer '", file,
             "' cannot be opened; pass the tokenizer.json of the data's tokenizer (or its model "
             "directory)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(detail::cat("--tokenizer '", file, "' is not valid JSON: ", e.what()));
  }
  // tokenizer.json: {"model": {"vocab": {...}}, "added_tokens": [...]}; vocab.json: the map.
  const nlohmann::json* vocab = &j;
  if (j.contains("model") && j["model"].contains("vocab")) vocab = &j["model"]["vocab"];
  FSDP_CHECK(vocab->is_object(), "--tokenizer '", file,
             "' has no token -> id map (model.vocab of a BPE or WordPiece tokenizer.json, or a "
             "vocab.json); fsdp-train decodes those");
  const bool sp = uses_metaspace(j);
  TokenizerVocab v;
  auto put = [&](int64_t id, const std::string& text) {
    if (id < 0) return;
    if (static_cast<size_t>(id) >= v.pieces_.size()) {
      v.pieces_.resize(id + 1);
      v.known_.resize(id + 1, false);
    }
    v.pieces_[id] = text;
    v.known_[id] = true;
  };
  for (const auto& [token, id] : vocab->items())
    if (id.is_number_integer()) put(id.get<int64_t>(), sp ? metaspace(token) : byte_level(token));
  if (j.contains("added_tokens") && j["added_tokens"].is_array())
    for (const auto& t : j["added_tokens"])
      if (t.contains("id") && t.contains("content"))
        put(t["id"].get<int64_t>(), t["content"].get<std::string>());
  return v;
}

std::string TokenizerVocab::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) {
    if (id >= 0 && static_cast<size_t>(id) < pieces_.size() && known_[id])
      out += pieces_[id];
    else
      out += "<" + std::to_string(id) + ">";
  }
  return utf8_lossy(out);
}

std::string utf8_lossy(const std::string& bytes) {
  static const std::string kReplacement = "\xEF\xBF\xBD";
  std::string out;
  const size_t n = bytes.size();
  auto at = [&](size_t i) { return static_cast<unsigned char>(bytes[i]); };
  for (size_t i = 0; i < n;) {
    const unsigned char c = at(i);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    // The length of the sequence c starts and the range of its second byte (Unicode 3.9, D92).
    int len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF)
      len = 2;
    else if (c == 0xE0)
      len = 3, lo = 0xA0;
    else if (c == 0xED)
      len = 3, hi = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF)
      len = 3;
    else if (c == 0xF0)
      len = 4, lo = 0x90;
    else if (c == 0xF4)
      len = 4, hi = 0x8F;
    else if (c >= 0xF1 && c <= 0xF3)
      len = 4;
    size_t k = 1;  // bytes of a valid prefix
    for (; len > 0 && static_cast<int>(k) < len && i + k < n; ++k) {
      const unsigned char b = at(i + k);
      const bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
      if (!ok) break;
    }
    if (len > 0 && static_cast<int>(k) == len) {
      out.append(bytes, i, k);
    } else {
      out += kReplacement;  // an invalid lead byte, or the maximal valid prefix of a sequence
    }
    i += k;
  }
  return out;
}

std::string one_line(const std::string& text) {
  std::string out;
  for (char c : text) {
    const auto b = static_cast<unsigned char>(c);
    if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else if (b < 0x20 || b == 0x7f)
      out += '?';
    else
      out += c;
  }
  return out;
}

std::string format_ids(const std::vector<int64_t>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? " " : "") + std::to_string(ids[i]);
  return out;
}

}  // namespace fsdp::train
