// safetensors format, the header: dtypes, the hardened header parser and row ranges.
// See include/fsdp/safetensors.h for the contract and docs/checkpoint.md for the format.
#include <fsdp/error.h>
#include <fsdp/safetensors.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/safetensors_internal.h"
#include "strict_json.h"

namespace fsdp::safetensors {

using detail::cat;
using namespace internal;  // errors, checked sizes

namespace {

uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
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

}  // namespace fsdp::safetensors
