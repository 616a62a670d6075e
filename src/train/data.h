// Training data of fsdp-train: the corpus as tokens, memory-mapped, and the window offsets of every
// sequence of every step, a pure function of (seed, step, row) so that any rank, any world size
// and an external reference replay the same stream (docs/trainer.md, "Data").
//
// Three formats, chosen by the file's extension: text (any other extension; every byte is one
// token, vocabulary 256), `.bin` or `.u16` (nanoGPT's format: little-endian uint16 tokens, no
// header) and `.u32` (little-endian uint32 tokens, for vocabularies above 65,536 such as Llama
// 3's; scripts/tokenize.py writes all three).
// The last `val_fraction` of the tokens are held out for evaluation (split_validation).
// Free of torch headers. Thread-safety: a loaded Corpus is immutable; copies share the mapping.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::train {

enum class DataOrder {
  kRandom,      // offset = mix64(seed, global row index) mod (N - T)
  kSequential,  // row j of the stream takes window j mod W, starting at token (j mod W) * T
};

DataOrder parse_data_order(const std::string& name);  // "random" | "sequential"

enum class TokenFormat {
  kBytes,   // text: one byte per token
  kUint16,  // .bin, .u16: little-endian uint16 per token
  kUint32,  // .u32: little-endian uint32 per token
};

class Corpus {
 public:
  // Memory-maps the file (text, or tokens by extension) and checks it: a missing file, a
  // directory, a special file (FIFO, device, socket), a token file whose length is not a whole
  // number of tokens, fewer than
  // seq_len + 1 tokens, or a token >= vocab are errors naming the file and the fix.
  static Corpus load(const std::string& path, int64_t seq_len, int64_t vocab = 256);
  // For tests: a corpus from memory (same length check).
  static Corpus from_bytes(std::vector<uint8_t> bytes, int64_t seq_len,
                           std::string name = "memory");
  static Corpus from_tokens(const std::vector<uint16_t>& tokens, int64_t seq_len,
                            std::string name = "memory");

  int64_t size() const { return size_; }  // tokens
  int64_t token(int64_t i) const {
    switch (format_) {
      case TokenFormat::kBytes:
        return data_[i];
      case TokenFormat::kUint16:
        return static_cast<int64_t>(data_[2 * i] | data_[2 * i + 1] << 8);
      default: {
        const uint8_t* b = data_ + 4 * i;
        return static_cast<int64_t>(static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 |
                                    static_cast<uint32_t>(b[2]) << 16 |
                                    static_cast<uint32_t>(b[3]) << 24);
      }
    }
  }
  // Bytes per token of a format: 1, 2 or 4.
  static int64_t token_bytes(TokenFormat f) {
    return f == TokenFormat::kBytes ? 1 : f == TokenFormat::kUint16 ? 2 : 4;
  }
  // The format of a file name: .bin and .u16 uint16, .u32 uint32, anything else text.
  static TokenFormat format_of(const std::string& path);
  TokenFormat format() const { return format_; }
  const std::string& path() const { return path_; }
  // Tokens [begin, end) of this corpus, sharing its storage.
  Corpus slice(int64_t begin, int64_t end) const;
  // The largest token (a full pass; load() uses it for the --vocab check).
  int64_t max_token() const;

 private:
  std::shared_ptr<const void> storage_;  // the mapping or the vector that data_ points into
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
  TokenFormat format_ = TokenFormat::kBytes;
  std::string path_;
};

// The training and validation splits: the last floor(size * val_fraction) tokens are the
// validation split (empty when val_fraction is 0). Throws fsdp::Error naming --val-fraction when a
// non-empty split is shorter than one sequence, or the training split would be.
std::pair<Corpus, Corpus> split_validation(const Corpus& corpus, double val_fraction,
                                           int64_t seq_len);

// Where each sequence of the global batch starts.
class DataStream {
 public:
  // REQUIRES: corpus.size() >= seq_len + 1, batch > 0.
  DataStream(const Corpus& corpus, DataOrder order, uint64_t seed, int64_t seq_len, int64_t batch);

  // Token offset of row `row` (0 <= row < batch) of step `step`; the row reads tokens
  // [offset, offset + seq_len] (inputs are the first seq_len, targets the last seq_len).
  int64_t offset(int64_t step, int64_t row) const;

  // Fills inputs and targets (row-major (rows, seq_len), int64) for the global rows
  // [row_begin, row_end) of `step`: a rank's contiguous slice of the global batch.
  void fill(int64_t step, int64_t row_begin, int64_t row_end, std::vector<int64_t>& inputs,
            std::vector<int64_t>& targets) const;

  int64_t windows() const { return windows_; }  // W, sequential order only

 private:
  const Corpus* corpus_;
  DataOrder order_;
  uint64_t seed_;
  int64_t seq_len_;
  int64_t batch_;
  int64_t windows_;
};

// splitmix64's output function (Steele, Lea, Flood 2014): the documented hash of the data order.
uint64_t mix64(uint64_t x);

}  // namespace fsdp::train
