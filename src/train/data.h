// Byte-level training data: the corpus as tokens (one byte = one token, vocabulary 256) and the
// window offsets of every sequence of every step, a pure function of (seed, step, row) so that any
// rank, any world size and an external reference replay the same stream (docs/trainer.md, "Data
// order"). Free of torch headers. Thread-safety: a loaded Corpus is immutable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::train {

enum class DataOrder {
  kRandom,      // offset = mix64(seed, global row index) mod (N - T)
  kSequential,  // row j of the stream takes window j mod W, starting at byte (j mod W) * T
};

DataOrder parse_data_order(const std::string& name);  // "random" | "sequential"

class Corpus {
 public:
  // Reads the whole file. Throws fsdp::Error naming the file when it is missing, unreadable, or
  // shorter than seq_len + 1 bytes (one input window plus its shifted target).
  static Corpus load(const std::string& path, int64_t seq_len);
  // For tests: a corpus from memory (same length check).
  static Corpus from_bytes(std::vector<uint8_t> bytes, int64_t seq_len,
                           std::string name = "memory");

  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  const std::vector<uint8_t>& bytes() const { return bytes_; }
  const std::string& path() const { return path_; }

 private:
  std::vector<uint8_t> bytes_;
  std::string path_;
};

// Where each sequence of the global batch starts.
class DataStream {
 public:
  // REQUIRES: corpus.size() >= seq_len + 1, batch > 0.
  DataStream(const Corpus& corpus, DataOrder order, uint64_t seed, int64_t seq_len, int64_t batch);

  // Byte offset of row `row` (0 <= row < batch) of step `step`; the row reads bytes
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
