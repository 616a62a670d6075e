// Corpus loading and the data order. The formulas here are the specification in docs/trainer.md
// ("Data order"); change both together.
#include "train/data.h"

#include <fsdp/error.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

namespace fsdp::train {

uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

DataOrder parse_data_order(const std::string& name) {
  if (name == "random") return DataOrder::kRandom;
  if (name == "sequential") return DataOrder::kSequential;
  throw Error(detail::cat("--data-order is '", name, "'; expected 'random' or 'sequential'"));
}

Corpus Corpus::load(const std::string& path, int64_t seq_len) {
  std::ifstream in(path, std::ios::binary);
  FSDP_CHECK(in.good(), "data file '", path, "' cannot be opened (", std::strerror(errno),
             "); pass an existing text file with --data FILE, or omit --data for the shipped "
             "corpus");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  FSDP_CHECK(!in.bad(), "data file '", path, "' could not be read completely");
  return from_bytes(std::move(bytes), seq_len, path);
}

Corpus Corpus::from_bytes(std::vector<uint8_t> bytes, int64_t seq_len, std::string name) {
  FSDP_CHECK(static_cast<int64_t>(bytes.size()) >= seq_len + 1, "data file '", name, "' has ",
             bytes.size(), " bytes, shorter than one sequence: --seq ", seq_len, " needs at least ",
             seq_len + 1,
             " bytes (inputs plus the shifted targets); use a longer text or a "
             "smaller --seq");
  Corpus c;
  c.bytes_ = std::move(bytes);
  c.path_ = std::move(name);
  return c;
}

DataStream::DataStream(const Corpus& corpus, DataOrder order, uint64_t seed, int64_t seq_len,
                       int64_t batch)
    : corpus_(&corpus),
      order_(order),
      seed_(seed),
      seq_len_(seq_len),
      batch_(batch),
      windows_((corpus.size() - 1) / seq_len) {
  FSDP_CHECK(corpus.size() >= seq_len + 1 && batch > 0, "DataStream: corpus of ", corpus.size(),
             " bytes, seq ", seq_len, ", batch ", batch);
}

int64_t DataStream::offset(int64_t step, int64_t row) const {
  const uint64_t j = static_cast<uint64_t>(step) * static_cast<uint64_t>(batch_) +
                     static_cast<uint64_t>(row);  // row index in the whole stream
  if (order_ == DataOrder::kSequential) return static_cast<int64_t>(j % windows_) * seq_len_;
  // Random: N - T possible starts [0, N - T - 1], each reading T + 1 bytes.
  const uint64_t starts = static_cast<uint64_t>(corpus_->size() - seq_len_);
  const uint64_t h = mix64(seed_ ^ mix64(j));
  return static_cast<int64_t>(h % starts);
}

void DataStream::fill(int64_t step, int64_t row_begin, int64_t row_end,
                      std::vector<int64_t>& inputs, std::vector<int64_t>& targets) const {
  const auto rows = static_cast<size_t>(row_end - row_begin);
  const auto t = static_cast<size_t>(seq_len_);
  inputs.resize(rows * t);
  targets.resize(rows * t);
  const uint8_t* bytes = corpus_->bytes().data();
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* src = bytes + offset(step, row_begin + static_cast<int64_t>(r));
    for (size_t i = 0; i < t; ++i) {
      inputs[r * t + i] = src[i];
      targets[r * t + i] = src[i + 1];
    }
  }
}

}  // namespace fsdp::train
