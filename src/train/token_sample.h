// The closing sample of fsdp-train on token data: its prompt (token ids from --prompt, or the
// first tokens of the held-out split) and the text of generated ids given the tokenizer's
// vocabulary (--tokenizer: a Hugging Face tokenizer.json, or a GPT-2-style vocab.json). Only
// decoding: encoding needs the tokenizer's merges and pre-tokenizer, which scripts/tokenize.py
// leaves to the `tokenizers` package. Torch-free. Thread-safety: a loaded vocabulary is immutable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train/config.h"
#include "train/data.h"

namespace fsdp::train {

// The sample's prompt on token data: --prompt as token ids ("464, 3290 318"), when given; else
// the first min(8, T) tokens of `held_out` (or of `train` when there is no validation split).
// Throws fsdp::Error naming --prompt when it was given and is not a list of ids below --vocab.
std::vector<int64_t> sample_prompt_tokens(const TrainConfig& cfg, const Corpus& held_out,
                                          const Corpus& train);

class TokenizerVocab {
 public:
  // `path`: tokenizer.json (model.vocab and added_tokens; the decoder ByteLevel, as GPT-2's and
  // Llama 3's, or SentencePiece's metaspace with byte fallback, as Llama 2's), a directory
  // holding one, or vocab.json (token -> id, byte-level). Throws fsdp::Error naming the file.
  static TokenizerVocab load(const std::string& path);
  // The text of the ids as the tokenizers package decodes them (skip_special_tokens=False):
  // special tokens as their content, bytes that are not valid UTF-8 as U+FFFD (one per maximal
  // invalid sequence, Python's errors="replace"); unknown ids as "<id>".
  std::string decode(const std::vector<int64_t>& ids) const;
  size_t size() const { return pieces_.size(); }

 private:
  std::vector<std::string> pieces_;  // by id: the token's bytes, decoded
  std::vector<bool> known_;
};

// "464 3290 318": ids for the summary.
std::string format_ids(const std::vector<int64_t>& ids);
// Bytes that are not valid UTF-8 replaced by U+FFFD, one per maximal invalid subsequence.
std::string utf8_lossy(const std::string& bytes);
// Text on one terminal line: newline and tab as \n and \t, other control characters as '?'.
std::string one_line(const std::string& text);

}  // namespace fsdp::train
