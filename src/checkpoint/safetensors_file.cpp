// safetensors format, the files: the verified range reader, the checksummed writer, XXH64.
// See include/fsdp/safetensors.h for the contract and docs/checkpoint.md for the format.
#include <fcntl.h>
#include <fsdp/error.h>
#include <fsdp/safetensors.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/atomic_file.h"
#include "checkpoint/hex.h"
#include "checkpoint/safetensors_internal.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "fsdp safetensors I/O copies tensor bytes as they are: little-endian hosts only");

namespace fsdp::safetensors {

using detail::cat;
using namespace internal;  // errors, checked sizes

namespace {

std::string errno_text() { return std::strerror(errno); }

// ---- POSIX helpers ----
void pread_all(int fd, void* dst, uint64_t len, uint64_t offset, const std::string& path) {
  auto* p = static_cast<uint8_t*>(dst);
  while (len > 0) {
    ssize_t n = ::pread(fd, p, std::min<uint64_t>(len, 1ull << 30), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      fail(path, cat("read of ", len, " bytes at offset ", offset, " failed: ", errno_text()));
    if (n == 0) {
      fail(path, cat("file ended at offset ", offset, " while ", len,
                     " more bytes were expected; it was truncated while open"));
    }
    p += n;
    len -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

// Streams bytes to a file while computing the whole-file and per-block XXH64.
class HashingWriter {
 public:
  HashingWriter(int fd, std::string path, uint64_t block_bytes)
      : fd_(fd), path_(std::move(path)), block_bytes_(block_bytes) {}
  void write(const void* data, uint64_t len) {
    write_all(fd_, data, len, path_);
    whole_.update(data, len);
    const auto* p = static_cast<const uint8_t*>(data);
    while (len > 0) {
      uint64_t take = std::min(len, block_bytes_ - in_block_);
      block_.update(p, take);
      in_block_ += take;
      p += take;
      len -= take;
      total_ += take;
      if (in_block_ == block_bytes_) {
        sums_.blocks.push_back(block_.digest());
        block_ = Xxh64();
        in_block_ = 0;
      }
    }
  }
  Checksums finish() {
    if (in_block_ > 0) sums_.blocks.push_back(block_.digest());
    sums_.file_bytes = total_;
    sums_.xxh64 = whole_.digest();
    sums_.block_bytes = block_bytes_;
    return sums_;
  }

 private:
  int fd_;
  std::string path_;
  uint64_t block_bytes_;
  uint64_t in_block_ = 0;
  uint64_t total_ = 0;
  Xxh64 whole_;
  Xxh64 block_;
  Checksums sums_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// XXH64: Debian's libxxhash
// ---------------------------------------------------------------------------------------------
void Xxh64::FreeState::operator()(XXH64_state_s* s) const { XXH64_freeState(s); }

Xxh64::Xxh64(uint64_t seed) : state_(XXH64_createState()) {
  FSDP_CHECK(state_ != nullptr, "XXH64_createState: out of memory");
  XXH64_reset(state_.get(), seed);
}

void Xxh64::update(const void* data, size_t len) { XXH64_update(state_.get(), data, len); }

uint64_t Xxh64::digest() const { return XXH64_digest(state_.get()); }

uint64_t xxh64(const void* data, size_t len, uint64_t seed) { return XXH64(data, len, seed); }

// ---------------------------------------------------------------------------------------------
// File
// ---------------------------------------------------------------------------------------------
std::unique_ptr<File> File::open(const std::string& path) { return open_impl(path, nullptr); }

std::unique_ptr<File> File::open_verified(const std::string& path, const Checksums& sums) {
  return open_impl(path, &sums);
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

std::unique_ptr<File> File::open_impl(const std::string& path, const Checksums* sums) {
  std::unique_ptr<File> f(new File());
  f->path_ = path;
  f->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f->fd_ < 0) fail(path, cat("cannot open: ", errno_text()));
  struct stat st {};
  if (::fstat(f->fd_, &st) != 0) fail(path, cat("cannot stat: ", errno_text()));
  if (!S_ISREG(st.st_mode)) fail(path, "is not a regular file");
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (sums) {
    if (f->size_ != sums->file_bytes) {
      fail(path, cat("file is ", f->size_, " bytes, the index says ", sums->file_bytes,
                     "; it was truncated or replaced - restore it or use an older checkpoint"));
    }
    uint64_t want_blocks =
        sums->block_bytes == 0 ? 0 : (sums->file_bytes + sums->block_bytes - 1) / sums->block_bytes;
    if (sums->block_bytes == 0 || sums->blocks.size() != want_blocks) {
      fail(path, cat("index lists ", sums->blocks.size(), " block checksums of ", sums->block_bytes,
                     " bytes for a ", sums->file_bytes, "-byte file; expected ", want_blocks));
    }
    f->sums_ = *sums;
    f->verified_.assign(sums->blocks.size(), false);
  }
  // The header is parsed before it is verified: the parser takes untrusted bytes anyway, and a
  // parsed header lets a checksum error name the tensors of the damaged block.
  uint8_t first8[8] = {0};
  if (f->size_ >= 8) pread_all(f->fd_, first8, 8, 0, path);
  uint64_t n = parse_header_length(first8, f->size_, path);
  std::vector<uint8_t> prefix(8 + n);
  pread_all(f->fd_, prefix.data(), prefix.size(), 0, path);
  f->header_ = parse_header(prefix.data(), prefix.size(), f->size_, path);
  if (sums) {
    for (uint64_t b = 0; b <= (f->header_.data_start - 1) / sums->block_bytes; ++b) {
      f->verify_block(b, "the header");
    }
  }
  return f;
}

const TensorMeta& File::tensor(const std::string& name) const {
  const TensorMeta* t = header_.find(name);
  if (!t) {
    fail_tensor(path_, name,
                cat("not in this file (it holds ", header_.tensors.size(),
                    " tensors); the file does not belong to this checkpoint or model"));
  }
  return *t;
}

void File::verify_block(uint64_t block, const std::string& what) {
  uint64_t bb = sums_->block_bytes;
  uint64_t start = block * bb;
  uint64_t len = std::min(bb, size_ - start);
  std::vector<uint8_t> buf(len);
  pread_all(fd_, buf.data(), len, start, path_);
  uint64_t got = xxh64(buf.data(), len);
  if (got != sums_->blocks[block]) {
    std::vector<std::string> held;
    for (const auto& t : header_.tensors) {
      uint64_t b = header_.data_start + t.begin, e = header_.data_start + t.end;
      if (b < start + len && e > start && t.bytes() > 0) held.push_back(shown(t.name));
    }
    std::string holds = start < header_.data_start ? "the header" : "";
    for (size_t i = 0; i < held.size() && i < 8; ++i)
      holds += (holds.empty() ? "" : ", ") + ("tensor " + held[i]);
    if (held.size() > 8) holds += cat(" and ", held.size() - 8, " more tensors");
    fail(path_,
         cat("checksum mismatch in block ", block, " (bytes [", start, ", ", start + len,
             "), holding ", holds, ") while reading ", what, ": xxh64 ", hex::encode_u64(got),
             ", the index says ", hex::encode_u64(sums_->blocks[block]),
             "; the file is corrupt - restore it or use an older checkpoint"));
  }
  verified_[block] = true;
}

void File::read_bytes(uint64_t offset, void* dst, uint64_t len, const std::string& what) {
  if (offset > size_ || len > size_ - offset) {
    fail(path_, cat("read of ", len, " bytes at offset ", offset, " for ", what,
                    " is outside the file of ", size_, " bytes"));
  }
  if (len == 0) return;
  if (sums_) {
    uint64_t bb = sums_->block_bytes;
    for (uint64_t b = offset / bb; b <= (offset + len - 1) / bb; ++b) {
      if (!verified_[b]) verify_block(b, what);
    }
  }
  pread_all(fd_, dst, len, offset, path_);
}

void File::read_rows(const std::string& name, int64_t row_begin, int64_t row_end, void* dst,
                     uint64_t dst_len) {
  const TensorMeta& t = tensor(name);
  ByteRange r = row_range(header_, t, row_begin, row_end, path_);
  if (dst_len != r.end - r.begin) {
    fail_tensor(path_, name,
                cat("destination holds ", dst_len, " bytes, rows [", row_begin, ", ", row_end,
                    ") are ", r.end - r.begin, " bytes"));
  }
  read_bytes(r.begin, dst, dst_len, cat("tensor ", shown(name)));
}

void File::read_all(const std::string& name, void* dst, uint64_t dst_len) {
  read_rows(name, 0, tensor(name).rows(), dst, dst_len);
}

void File::verify_all() {
  if (!sums_) fail(path_, "verify_all() needs checksums: open it with open_verified()");
  Xxh64 whole;
  std::vector<uint8_t> buf(std::min<uint64_t>(sums_->block_bytes, 1ull << 24));
  for (uint64_t off = 0; off < size_;) {
    uint64_t len = std::min<uint64_t>(buf.size(), size_ - off);
    pread_all(fd_, buf.data(), len, off, path_);
    whole.update(buf.data(), len);
    off += len;
  }
  if (whole.digest() != sums_->xxh64) {
    fail(path_, cat("checksum mismatch: xxh64 of the file is ", hex::encode_u64(whole.digest()),
                    ", the index says ", hex::encode_u64(sums_->xxh64),
                    "; the file is corrupt - restore it or use an older checkpoint"));
  }
}

// ---------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------
Checksums write(const std::string& path, const std::vector<TensorView>& tensors,
                const std::map<std::string, std::string>& metadata, uint64_t block_bytes) {
  FSDP_CHECK(block_bytes > 0, "safetensors::write('", path, "'): block_bytes must be positive");
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    header["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) header["__metadata__"][k] = v;
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      fail_tensor(path, t.name, "invalid name; names must be non-empty and not '__metadata__'");
    }
    if (!names.insert(t.name).second)
      fail_tensor(path, t.name, "given twice; names must be unique");
    auto esize = dtype_size(t.dtype);
    if (!esize) fail_tensor(path, t.name, cat("unknown dtype ", shown(t.dtype)));
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0 || !checked_mul(numel, static_cast<uint64_t>(d), &numel)) {
        fail_tensor(path, t.name, "shape has a negative dimension or overflows");
      }
    }
    uint64_t want = 0;
    if (!checked_mul(numel, *esize, &want) || want != t.bytes) {
      fail_tensor(path, t.name,
                  cat("has ", t.bytes, " bytes, dtype ", t.dtype, " and its shape need ", want));
    }
    if (t.bytes > 0 && t.data == nullptr) fail_tensor(path, t.name, "data pointer is null");
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  FSDP_CHECK(text.size() <= kMaxHeaderBytes, "safetensors::write('", path, "'): header of ",
             text.size(), " bytes exceeds the cap of ", kMaxHeaderBytes,
             "; write fewer tensors per file");
  Checksums sums;
  atomic_write(path, [&](int fd, const std::string& tmp) {
    HashingWriter w(fd, tmp, block_bytes);
    uint8_t len8[8];
    uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) len8[i] = static_cast<uint8_t>(n >> (8 * i));
    w.write(len8, 8);
    w.write(text.data(), text.size());
    for (const auto& t : tensors) w.write(t.data, t.bytes);
    sums = w.finish();
  });
  return sums;
}

std::string read_text(const std::string& path, uint64_t max_bytes) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(cat("'", path, "': cannot open: ", errno_text()));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(cat("'", path, "': not a regular file"));
  }
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    ::close(fd);
    throw Error(cat("'", path, "': ", size, " bytes, more than the limit of ", max_bytes,
                    "; the file is corrupt or not what it claims to be"));
  }
  std::string s(size, '\0');
  try {
    pread_all(fd, s.data(), size, 0, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return s;
}

}  // namespace fsdp::safetensors
