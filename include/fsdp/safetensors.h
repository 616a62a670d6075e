// safetensors: the file format of fsdp-cpp checkpoints, torch-free (tensor glue in
// safetensors_torch.h), so that the parser can be fuzzed on its own.
//
// Layout (huggingface/safetensors): u64 little-endian N, then N bytes of JSON
//   {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<string>", ...}}
// padded with spaces so that 8 + N is a multiple of 8, then the data section: raw little-endian
// C-order bytes; offsets are relative to the data section.
//
// Every header is treated as untrusted: parse_header() rejects (fsdp::Error naming the file and the
// tensor) a header length beyond the file or over kMaxHeaderBytes, invalid JSON or UTF-8, duplicate
// names, unknown dtypes, shape products that overflow, byte sizes that disagree with dtype * numel,
// offsets that overlap, leave gaps or run past the data section. After a successful parse every
// offset of the header lies inside the file, so reads derived from it cannot go out of bounds.
//
// Checksums: XXH64 (seed 0, the xxHash 64-bit spec, from libxxhash) of the whole file, and of
// each block of block_bytes bytes (the last block may be short), so that a reader can verify the
// byte ranges it reads without reading the whole file.
//
// Thread-safety: functions are reentrant; a File may be read from several threads (pread) but its
// checksum verification state is not synchronised: verify from one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

struct XXH64_state_s;  // <xxhash.h>

namespace fsdp::safetensors {

inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;    // the reference implementation's cap
inline constexpr uint64_t kDefaultBlockBytes = 1ull << 20;  // checksum granularity
inline constexpr int kMaxJsonDepth = 8;                     // the format needs 3

// Size in bytes of a dtype ("F32" -> 4), or nullopt when unknown.
std::optional<uint64_t> dtype_size(const std::string& dtype);

// One tensor of a header. Offsets are relative to the data section and validated.
struct TensorMeta {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;  // [] for a 0-d tensor
  uint64_t numel = 0;
  uint64_t begin = 0;  // data_offsets[0]
  uint64_t end = 0;    // data_offsets[1]
  uint64_t bytes() const { return end - begin; }
  // Rows along dim 0; a 0-d tensor counts as one row.
  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  uint64_t row_bytes() const;  // bytes() / rows(), 0 when rows() == 0
};

struct Header {
  uint64_t header_bytes = 0;        // N
  uint64_t data_start = 0;          // 8 + N: file offset of the data section
  uint64_t data_bytes = 0;          // file size - data_start
  std::vector<TensorMeta> tensors;  // in data-offset order
  std::map<std::string, std::string> metadata;
  const TensorMeta* find(const std::string& name) const;  // nullptr when absent
};

// Parses a header from untrusted bytes. `prefix` holds the first `prefix_len` bytes of a file of
// `file_size` bytes; it must contain at least 8 + N bytes (else an error says how many are needed).
// `source` names the file in messages.
Header parse_header(const uint8_t* prefix, size_t prefix_len, uint64_t file_size,
                    const std::string& source);
// Reads the 8-byte length word and validates it against the file size and the cap; returns N.
uint64_t parse_header_length(const uint8_t* first8, uint64_t file_size, const std::string& source);

// File-relative byte range [begin, end) of rows [row_begin, row_end) of `t`; throws naming the
// file and tensor when the range is outside [0, rows()].
struct ByteRange {
  uint64_t begin = 0;
  uint64_t end = 0;
};
ByteRange row_range(const Header& h, const TensorMeta& t, int64_t row_begin, int64_t row_end,
                    const std::string& source);

// ---- checksums ----
// Streaming XXH64 (Debian's libxxhash).
class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t len);
  uint64_t digest() const;

 private:
  struct FreeState {
    void operator()(XXH64_state_s* s) const;
  };
  std::unique_ptr<XXH64_state_s, FreeState> state_;
};
uint64_t xxh64(const void* data, size_t len, uint64_t seed = 0);

struct Checksums {
  uint64_t file_bytes = 0;
  uint64_t xxh64 = 0;  // of the whole file
  uint64_t block_bytes = kDefaultBlockBytes;
  std::vector<uint64_t> blocks;  // xxh64 of each block, ceil(file_bytes / block_bytes) of them
};

// ---- reading ----
// An open safetensors file with a validated header. Reads use pread on the byte ranges asked for.
// With expect() set, every byte read is first checked against the block checksums (each block is
// read whole once, then remembered as verified) and the file size against the expected size.
class File {
 public:
  // Opens and validates; throws fsdp::Error naming the file (missing, unreadable, bad header).
  static std::unique_ptr<File> open(const std::string& path);
  // As open(), but verifies the file's size and every byte it reads (header included) against
  // `sums`; a mismatch is an error naming the file, the block and the tensor being read.
  static std::unique_ptr<File> open_verified(const std::string& path, const Checksums& sums);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  const Header& header() const { return header_; }
  uint64_t size() const { return size_; }
  // Looks a tensor up; throws naming the file and the tensor when absent.
  const TensorMeta& tensor(const std::string& name) const;

  // Copies rows [row_begin, row_end) of tensor `name` to dst (dst_len must equal the range's
  // bytes).
  void read_rows(const std::string& name, int64_t row_begin, int64_t row_end, void* dst,
                 uint64_t dst_len);
  void read_all(const std::string& name, void* dst, uint64_t dst_len);
  // Raw bytes [offset, offset + len) of the file, bounds-checked and verified; `what` names the
  // tensor for messages.
  void read_bytes(uint64_t offset, void* dst, uint64_t len, const std::string& what);
  // Reads the whole file and checks the whole-file checksum (for offline tools).
  void verify_all();

 private:
  File() = default;
  static std::unique_ptr<File> open_impl(const std::string& path, const Checksums* sums);
  void verify_block(uint64_t block, const std::string& what);

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  Header header_;
  std::optional<Checksums> sums_;
  std::vector<bool> verified_;
};

// ---- writing ----
// A tensor to write: `data` points at bytes() little-endian C-order bytes (the caller keeps them
// alive until write() returns).
struct TensorView {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  uint64_t bytes = 0;
};

// Writes `tensors` (in the given order) and `metadata` to `path` atomically (atomic_write: a
// temporary file in the same directory, fsync, rename over `path`, fsync of the directory).
// Validates names (unique, non-empty, not "__metadata__"), dtypes and sizes first. Returns the
// checksums of what it wrote.
Checksums write(const std::string& path, const std::vector<TensorView>& tensors,
                const std::map<std::string, std::string>& metadata = {},
                uint64_t block_bytes = kDefaultBlockBytes);

// Reads a whole small file (at most max_bytes, else an error naming it).
std::string read_text(const std::string& path, uint64_t max_bytes);

}  // namespace fsdp::safetensors
