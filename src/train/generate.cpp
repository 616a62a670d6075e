#include "train/generate.h"

#include <fsdp/error.h>

#include <algorithm>
#include <cmath>

#include "train/data.h"

namespace fsdp::train {

std::vector<int64_t> generate_tokens(const std::vector<int64_t>& prompt, const SampleOptions& o,
                                     const NextLogits& next_logits) {
  FSDP_CHECK(!prompt.empty(), "generate_tokens: the prompt is empty");
  std::vector<int64_t> tokens = prompt;
  std::vector<double> p;
  for (int64_t i = 0; i < o.tokens; ++i) {
    const size_t n = std::min<size_t>(tokens.size(), static_cast<size_t>(o.context));
    const std::vector<int64_t> ctx(tokens.end() - static_cast<std::ptrdiff_t>(n), tokens.end());
    const std::vector<float> logits = next_logits(ctx);
    FSDP_CHECK(!logits.empty(), "generate_text: the model returned no logits");
    // Softmax of logits / temperature, in double, shifted by the maximum.
    double max_logit = -INFINITY;
    for (float l : logits) max_logit = std::max(max_logit, static_cast<double>(l) / o.temperature);
    p.resize(logits.size());
    double total = 0;
    for (size_t k = 0; k < logits.size(); ++k) {
      p[k] = std::exp(static_cast<double>(logits[k]) / o.temperature - max_logit);
      total += p[k];
    }
    // u in [0, 1) from the top 53 bits of a splitmix64 draw.
    const double u = static_cast<double>(mix64(o.seed ^ mix64(static_cast<uint64_t>(i))) >> 11) *
                     (1.0 / 9007199254740992.0);
    double acc = 0;
    size_t pick = logits.size() - 1;
    for (size_t k = 0; k < logits.size(); ++k) {
      acc += p[k] / total;
      if (u < acc) {
        pick = k;
        break;
      }
    }
    tokens.push_back(static_cast<int64_t>(pick));
  }
  return std::vector<int64_t>(tokens.begin() + static_cast<std::ptrdiff_t>(prompt.size()),
                              tokens.end());
}

std::string generate_text(const std::string& prompt, const SampleOptions& o,
                          const NextLogits& next_logits) {
  std::vector<int64_t> tokens;
  for (unsigned char c : prompt.empty() ? std::string("\n") : prompt) tokens.push_back(c);
  std::string out;
  for (int64_t t : generate_tokens(tokens, o, next_logits)) out.push_back(static_cast<char>(t));
  return out;
}

std::string printable(const std::string& text) {
  std::string out = text;
  for (char& c : out) {
    const auto b = static_cast<unsigned char>(c);
    if ((b < 0x20 && b != '\n' && b != '\t') || b >= 0x7f) c = '?';
  }
  return out;
}

}  // namespace fsdp::train
