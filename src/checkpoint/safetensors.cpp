// safetensors format: hardened header parser, verified range reader, checksummed writer.
// See include/fsdp/safetensors.h for the contract and docs/checkpoint.md for the format.
#include <fcntl.h>
#include <fsdp/atomic_file.h>
#include <fsdp/error.h>
#include <fsdp/hex.h>
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

#include "strict_json.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "fsdp safetensors I/O copies tensor bytes as they are: little-endian hosts only");

namespace fsdp::safetensors {

using detail::cat;

namespace {

std::string shown(const std::string& s) {
  // Names come from untrusted bytes: show at most 200 characters of them.
  if (s.size() <= 200) return "'" + s + "'";
  return "'" + s.substr(0, 200) + "...' (" + std::to_string(s.size()) + " bytes)";
}

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw Error(cat("safetensors file '", source, "': ", what));
}

[[noreturn]] void fail_tensor(const std::string& source, const std::string& name,
                              const std::string& what) {
  throw Error(cat("safetensors file '", source, "': tensor ", shown(name), ": ", what));
}

std::string errno_text() { return std::strerror(errno); }

uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// A JSON integer in [0, max], or nullopt.
std::optional<uint64_t> as_u64(const nlohmann::json& v, uint64_t max) {
  if (v.is_number_unsigned()) {
    auto x = v.get<uint64_t>();
    if (x <= max) return x;
    return std::nullopt;
  }
  if (v.is_number_integer()) {
    auto x = v.get<int64_t>();
    if (x >= 0 && static_cast<uint64_t>(x) <= max) return static_cast<uint64_t>(x);
  }
  return std::nullopt;
}

TensorMeta parse_entry(const std::string& name, const nlohmann::json& v, uint64_t data_bytes,
                       const std::string& source) {
  TensorMeta t;
  t.name = name;
  if (name.empty()) fail(source, "a tensor has an empty name");
  if (!v.is_object()) {
    fail_tensor(source, name,
                cat("entry is a JSON ", v.type_name(),
                    ", expected an object {dtype, shape, data_offsets}"));
  }
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
      fail_tensor(
          source, name,
          cat("unknown field ", shown(it.key()), "; expected only dtype, shape, data_offsets"));
    }
  }
  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) fail_tensor(source, name, "missing string field 'dtype'");
  t.dtype = dt->get<std::string>();
  auto esize = dtype_size(t.dtype);
  if (!esize) {
    fail_tensor(source, name,
                cat("unknown dtype ", shown(t.dtype),
                    "; known: BOOL U8 I8 F8_E5M2 F8_E4M3 I16 U16 F16 BF16 I32 U32 "
                    "F32 F64 I64 U64"));
  }
  auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) fail_tensor(source, name, "missing array field 'shape'");
  uint64_t numel = 1;
  for (const auto& d : *sh) {
    auto x = as_u64(d, static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
    if (!x) {
      fail_tensor(source, name,
                  cat("shape entry ", d.dump(),
                      " is not an integer in [0, 2^63); shapes are non-negative"));
    }
    t.shape.push_back(static_cast<int64_t>(*x));
    if (!checked_mul(numel, *x, &numel)) {
      fail_tensor(source, name,
                  cat("shape ", sh->dump(),
                      " has an element count that overflows 64 bits; the header "
                      "is corrupt or crafted"));
    }
  }
  t.numel = numel;
  uint64_t want = 0;
  if (!checked_mul(numel, *esize, &want)) {
    fail_tensor(source, name,
                cat("shape ", sh->dump(), " times ", *esize,
                    "-byte dtype overflows 64 bits; the header is corrupt or "
                    "crafted"));
  }
  auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2) {
    fail_tensor(source, name, "missing field 'data_offsets' of two integers [begin, end]");
  }
  auto b = as_u64((*off)[0], std::numeric_limits<uint64_t>::max());
  auto e = as_u64((*off)[1], std::numeric_limits<uint64_t>::max());
  if (!b || !e) {
    fail_tensor(source, name, cat("data_offsets ", off->dump(), " are not non-negative integers"));
  }
  if (*b > *e) {
    fail_tensor(source, name, cat("data_offsets ", off->dump(), " end before they begin"));
  }
  if (*e > data_bytes) {
    fail_tensor(source, name,
                cat("data_offsets ", off->dump(), " run past the data section of ", data_bytes,
                    " bytes; the file is truncated or the header is "
                    "corrupt - re-save it"));
  }
  if (*e - *b != want) {
    fail_tensor(source, name,
                cat("data_offsets ", off->dump(), " span ", *e - *b, " bytes, but dtype ", t.dtype,
                    " x shape ", sh->dump(), " needs ", want, " bytes"));
  }
  t.begin = *b;
  t.end = *e;
  return t;
}

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
// dtypes and headers
// ---------------------------------------------------------------------------------------------
std::optional<uint64_t> dtype_size(const std::string& d) {
  static const std::map<std::string, uint64_t> kSizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
  auto it = kSizes.find(d);
  if (it == kSizes.end()) return std::nullopt;
  return it->second;
}

uint64_t TensorMeta::row_bytes() const {
  int64_t r = rows();
  return r == 0 ? 0 : bytes() / static_cast<uint64_t>(r);
}

const TensorMeta* Header::find(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

uint64_t parse_header_length(const uint8_t* first8, uint64_t file_size, const std::string& source) {
  if (file_size < 8) {
    fail(source, cat("file is ", file_size,
                     " bytes, shorter than the 8-byte header length; it is truncated or not a "
                     "safetensors file"));
  }
  uint64_t n = load_le64(first8);
  if (n > kMaxHeaderBytes) {
    fail(source, cat("header length ", n, " exceeds the cap of ", kMaxHeaderBytes,
                     " bytes; the file is corrupt or crafted"));
  }
  if (n > file_size - 8) {
    fail(source, cat("header length ", n, " is beyond the file (", file_size, " bytes, so at most ",
                     file_size - 8, "); the file is truncated or corrupt"));
  }
  if (n < 2) fail(source, cat("header length ", n, " is too short for a JSON object"));
  return n;
}

Header parse_header(const uint8_t* prefix, size_t prefix_len, uint64_t file_size,
                    const std::string& source) {
  if (prefix_len < 8 || file_size < 8) {
    parse_header_length(prefix, std::min<uint64_t>(prefix_len, file_size), source);
  }
  Header h;
  h.header_bytes = parse_header_length(prefix, file_size, source);
  if (prefix_len - 8 < h.header_bytes) {
    fail(source, cat("only ", prefix_len, " bytes given, the header needs ", 8 + h.header_bytes));
  }
  h.data_start = 8 + h.header_bytes;
  h.data_bytes = file_size - h.data_start;
  const char* begin = reinterpret_cast<const char*>(prefix + 8);
  if (begin[0] != '{') {
    fail(source, "header does not start with '{'; this is not a safetensors file");
  }
  auto j = detail::parse_json_strict(std::string_view(begin, h.header_bytes), kMaxJsonDepth,
                                     cat("safetensors file '", source, "': header"));
  if (!j.is_object()) fail(source, "header is not a JSON object");
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) fail(source, "__metadata__ is not an object of strings");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          fail(source, cat("__metadata__ value of ", shown(m.key()), " is a ", m->type_name(),
                           "; only strings are allowed"));
        }
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    h.tensors.push_back(parse_entry(it.key(), *it, h.data_bytes, source));
  }
  std::stable_sort(h.tensors.begin(), h.tensors.end(),
                   [](const TensorMeta& a, const TensorMeta& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  uint64_t expect = 0;
  const TensorMeta* prev = nullptr;
  for (const auto& t : h.tensors) {
    if (t.begin < expect) {
      fail_tensor(
          source, t.name,
          cat("data_offsets [", t.begin, ", ", t.end, "] overlap tensor ", shown(prev->name), " [",
              prev->begin, ", ", prev->end, "]; the header is corrupt or crafted"));
    }
    if (t.begin > expect) {
      fail_tensor(
          source, t.name,
          cat("data_offsets [", t.begin, ", ", t.end, "] leave a gap of ", t.begin - expect,
              " bytes after offset ", expect, "; tensors must cover the data section exactly"));
    }
    expect = t.end;
    prev = &t;
  }
  if (expect != h.data_bytes) {
    fail(source, cat("tensors cover ", expect, " bytes but the data section has ", h.data_bytes,
                     " bytes; the file has trailing garbage or was truncated"));
  }
  return h;
}

ByteRange row_range(const Header& h, const TensorMeta& t, int64_t row_begin, int64_t row_end,
                    const std::string& source) {
  if (row_begin < 0 || row_end < row_begin || row_end > t.rows()) {
    fail_tensor(
        source, t.name,
        cat("rows [", row_begin, ", ", row_end, ") requested, the tensor has ", t.rows(), " rows"));
  }
  uint64_t rb = t.row_bytes();
  ByteRange r;
  r.begin = h.data_start + t.begin + static_cast<uint64_t>(row_begin) * rb;
  r.end = h.data_start + t.begin + static_cast<uint64_t>(row_end) * rb;
  return r;
}

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
