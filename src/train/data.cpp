// Corpus loading (memory-mapped text or uint16 tokens), the validation split and the data order.
// The formulas here are the specification in docs/trainer.md ("Data"); change both together.
#include "train/data.h"

#include <fcntl.h>
#include <fsdp/error.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

namespace fsdp::train {
namespace {

// A read-only private mapping of a whole file, unmapped when the last Corpus sharing it goes.
std::shared_ptr<const void> map_file(const std::string& path, size_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FSDP_CHECK(fd >= 0, "data file '", path, "' cannot be opened (", std::strerror(errno),
             "); pass an existing file with --data FILE, or omit --data for the shipped corpus");
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  FSDP_CHECK(p != MAP_FAILED, "data file '", path, "' cannot be memory-mapped (",
             std::strerror(err), "); pass a regular file on a local file system");
  return std::shared_ptr<const void>(
      p, [bytes](const void* q) { ::munmap(const_cast<void*>(q), bytes); });
}

const char* file_kind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

std::string lower_extension(const std::string& path) {
  const auto dot = path.find_last_of("./");
  if (dot == std::string::npos || path[dot] != '.') return "";
  std::string ext = path.substr(dot);
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  return ext;
}

void check_length(int64_t tokens, int64_t seq_len, const std::string& name, const char* unit) {
  FSDP_CHECK(tokens >= seq_len + 1, "data file '", name, "' has ", tokens, " ", unit,
             ", shorter than one sequence: --seq ", seq_len, " needs at least ", seq_len + 1, " ",
             unit, " (inputs plus the shifted targets); use a longer file or a smaller --seq");
}

}  // namespace

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

Corpus Corpus::load(const std::string& path, int64_t seq_len, int64_t vocab) {
  struct stat st {};
  FSDP_CHECK(::stat(path.c_str(), &st) == 0, "data file '", path, "' cannot be opened (",
             std::strerror(errno),
             "); pass an existing file with --data FILE, or omit --data for the shipped corpus");
  FSDP_CHECK(!S_ISDIR(st.st_mode), "data file '", path,
             "' is a directory; --data takes one file: a text file (one byte per token), or "
             "tokens (.bin/.u16: uint16, .u32: uint32)");
  FSDP_CHECK(S_ISREG(st.st_mode), "data file '", path, "' is ", file_kind(st.st_mode),
             "; --data takes a regular file (it is memory-mapped): copy the stream to a file "
             "first");
  Corpus c;
  c.path_ = path;
  const auto bytes = static_cast<uint64_t>(st.st_size);
  c.format_ = format_of(path);
  if (c.format_ != TokenFormat::kBytes) {
    const auto width = static_cast<uint64_t>(token_bytes(c.format_));
    FSDP_CHECK(bytes % width == 0, "data file '", path, "' has ", bytes,
               " bytes, not a whole number of uint", 8 * width, " tokens; a ",
               lower_extension(path), " file holds little-endian uint", 8 * width,
               " tokens (.bin and .u16: uint16, nanoGPT's format; .u32: uint32)");
    c.size_ = static_cast<int64_t>(bytes / width);
    check_length(c.size_, seq_len, path, "tokens");
  } else {
    c.size_ = static_cast<int64_t>(bytes);
    check_length(c.size_, seq_len, path, "bytes");
  }
  c.storage_ = map_file(path, bytes);
  c.data_ = static_cast<const uint8_t*>(c.storage_.get());
  const int64_t top = c.max_token();
  FSDP_CHECK(top < vocab, "data file '", path, "' holds token ", top, ", outside --vocab ", vocab,
             c.format_ != TokenFormat::kBytes
                 ? "; pass the tokenizer's vocabulary size, e.g. --vocab 50257 for GPT-2's (a "
                   "--init-from model directory sets it from its config.json)"
                 : "; a text file needs --vocab 256 (one byte per token)");
  return c;
}

Corpus Corpus::from_bytes(std::vector<uint8_t> bytes, int64_t seq_len, std::string name) {
  check_length(static_cast<int64_t>(bytes.size()), seq_len, name, "bytes");
  Corpus c;
  auto v = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  c.data_ = v->data();
  c.size_ = static_cast<int64_t>(v->size());
  c.storage_ = std::move(v);
  c.path_ = std::move(name);
  return c;
}

Corpus Corpus::from_tokens(const std::vector<uint16_t>& tokens, int64_t seq_len, std::string name) {
  check_length(static_cast<int64_t>(tokens.size()), seq_len, name, "tokens");
  auto v = std::make_shared<std::vector<uint8_t>>(tokens.size() * 2);
  for (size_t i = 0; i < tokens.size(); ++i) {
    (*v)[2 * i] = static_cast<uint8_t>(tokens[i] & 0xff);
    (*v)[2 * i + 1] = static_cast<uint8_t>(tokens[i] >> 8);
  }
  Corpus c;
  c.data_ = v->data();
  c.size_ = static_cast<int64_t>(tokens.size());
  c.format_ = TokenFormat::kUint16;
  c.storage_ = std::move(v);
  c.path_ = std::move(name);
  return c;
}

TokenFormat Corpus::format_of(const std::string& path) {
  const std::string ext = lower_extension(path);
  if (ext == ".bin" || ext == ".u16") return TokenFormat::kUint16;
  if (ext == ".u32") return TokenFormat::kUint32;
  return TokenFormat::kBytes;
}

Corpus Corpus::slice(int64_t begin, int64_t end) const {
  FSDP_CHECK(0 <= begin && begin <= end && end <= size_, "Corpus::slice [", begin, ", ", end,
             ") of ", size_, " tokens");
  Corpus c = *this;
  c.data_ = data_ + begin * token_bytes(format_);
  c.size_ = end - begin;
  return c;
}

int64_t Corpus::max_token() const {
  int64_t top = 0;
  for (int64_t i = 0; i < size_; ++i) top = std::max(top, token(i));
  return top;
}

std::pair<Corpus, Corpus> split_validation(const Corpus& corpus, double val_fraction,
                                           int64_t seq_len) {
  const int64_t n = corpus.size();
  const auto nv = static_cast<int64_t>(std::floor(static_cast<double>(n) * val_fraction));
  FSDP_CHECK(nv == 0 || nv >= seq_len + 1, "--val-fraction ", val_fraction, " of the ", n,
             " tokens of '", corpus.path(), "' holds out ", nv,
             " tokens, fewer than one sequence (--seq ", seq_len, " needs ", seq_len + 1,
             "); raise --val-fraction, or pass --val-fraction 0 to train on everything");
  FSDP_CHECK(n - nv >= seq_len + 1, "--val-fraction ", val_fraction, " leaves ", n - nv,
             " training tokens of '", corpus.path(), "', fewer than one sequence (--seq ", seq_len,
             "); lower --val-fraction");
  return {corpus.slice(0, n - nv), corpus.slice(n - nv, n)};
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
             " tokens, seq ", seq_len, ", batch ", batch);
}

int64_t DataStream::offset(int64_t step, int64_t row) const {
  const uint64_t j = static_cast<uint64_t>(step) * static_cast<uint64_t>(batch_) +
                     static_cast<uint64_t>(row);  // row index in the whole stream
  if (order_ == DataOrder::kSequential) return static_cast<int64_t>(j % windows_) * seq_len_;
  // Random: N - T possible starts [0, N - T - 1], each reading T + 1 tokens.
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
  for (size_t r = 0; r < rows; ++r) {
    const int64_t o = offset(step, row_begin + static_cast<int64_t>(r));
    for (size_t i = 0; i < t; ++i) {
      inputs[r * t + i] = corpus_->token(o + static_cast<int64_t>(i));
      targets[r * t + i] = corpus_->token(o + static_cast<int64_t>(i) + 1);
    }
  }
}

}  // namespace fsdp::train
