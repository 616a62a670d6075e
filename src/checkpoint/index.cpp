// index.json: validation of untrusted index text, and its serialisation. Torch-free (fuzzed alone).
#include <fsdp/checkpoint_index.h>
#include <fsdp/error.h>

#include <algorithm>
#include <limits>
#include <set>

#include "checkpoint/hex.h"
#include "strict_json.h"
#include "util/shown.h"

namespace fsdp::checkpoint {

using detail::cat;
using detail::shown;
using json = nlohmann::json;

namespace {

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw Error(cat("checkpoint index '", source, "': ", what));
}

[[noreturn]] void fail_tensor(const std::string& source, const std::string& name,
                              const std::string& what) {
  fail(source, cat("tensor ", shown(name), ": ", what));
}

const json& field(const json& obj, const char* key, const std::string& source,
                  const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end()) fail(source, cat(where, "is missing the field '", key, "'"));
  return *it;
}

int64_t get_int(const json& v, int64_t lo, int64_t hi, const std::string& source,
                const std::string& what) {
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(source, cat(what, " = ", v.dump(), " is out of range [", lo, ", ", hi, "]"));
    }
    x = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else {
    fail(source, cat(what, " is a ", v.type_name(), ", expected an integer"));
  }
  if (x < lo || x > hi) fail(source, cat(what, " = ", x, " is out of range [", lo, ", ", hi, "]"));
  return x;
}

std::string get_str(const json& v, const std::string& source, const std::string& what) {
  if (!v.is_string()) fail(source, cat(what, " is a ", v.type_name(), ", expected a string"));
  return v.get<std::string>();
}

uint64_t get_hex64(const json& v, const std::string& source, const std::string& what) {
  auto x = hex::decode_u64(get_str(v, source, what));
  if (!x) fail(source, cat(what, " is not 16 hex digits"));
  return *x;
}

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

// The index's own checksum: XXH64 of the index's compact JSON without this field. Parsing and
// dumping again gives the same text (keys sorted, numbers in their shortest round-trip form), so a
// reader recomputes it from what it parsed, whatever the file's whitespace.
constexpr const char* kIndexChecksum = "index_xxh64";
uint64_t content_checksum(const json& without_checksum) {
  const std::string text = without_checksum.dump();
  return safetensors::xxh64(text.data(), text.size());
}

// An index that records its checksum must still match it: the fields it validates can be edited
// into other valid values (the data position, the RNG state, the trainer's settings, a tensor's
// entry removed) that nothing else would catch. One without the field (written before indexes
// carried it, or edited on purpose and the field removed) is read as it stands.
void check_content(json j, const std::string& source) {
  const auto it = j.find(kIndexChecksum);
  if (it == j.end()) return;
  const uint64_t recorded = get_hex64(*it, source, kIndexChecksum);
  j.erase(it);
  const uint64_t got = content_checksum(j);
  if (got != recorded)
    fail(source, cat("its content does not match its checksum (", kIndexChecksum, " ",
                     hex::encode_u64(recorded), ", the content's ", hex::encode_u64(got),
                     "): the index was changed after it was written, by an edit or on the disk. "
                     "Restore it from a copy, or use an older checkpoint; for an edit you intend, "
                     "remove the field '",
                     kIndexChecksum, "' and the index is read as it stands"));
}

// The top-level fields: format, version, world size, sharding, optimizer and the TrainState.
void parse_header_fields(const json& j, const std::string& source, Index& idx) {
  if (get_str(field(j, "format", source, ""), source, "format") != kFormatName) {
    fail(source, cat("format is not '", kFormatName, "'"));
  }
  idx.format_version = static_cast<int>(
      get_int(field(j, "format_version", source, ""), 1, 1000, source, "format_version"));
  if (idx.format_version != kFormatVersion) {
    fail(source, cat("format_version ", idx.format_version, " is not supported (this build reads ",
                     kFormatVersion, "); use a matching fsdp-cpp"));
  }
  idx.world_size = static_cast<int>(
      get_int(field(j, "world_size", source, ""), 1, kMaxWorldSize, source, "world_size"));
  idx.sharding = get_str(field(j, "sharding", source, ""), source, "sharding");
  if (idx.sharding != "dim0-chunk")
    fail(source, cat("sharding ", shown(idx.sharding), " is unknown; expected 'dim0-chunk'"));
  idx.optimizer = get_str(field(j, "optimizer", source, ""), source, "optimizer");
  if (idx.optimizer != "none" && idx.optimizer != "adamw" && idx.optimizer != "adam" &&
      idx.optimizer != "sgd") {
    fail(source,
         cat("optimizer ", shown(idx.optimizer), " is unknown; expected adamw, adam, sgd or none"));
  }
  idx.state.step = get_int(field(j, "step", source, ""), 0, kI64Max, source, "step");
  idx.state.data_position =
      get_int(field(j, "data_position", source, ""), 0, kI64Max, source, "data_position");
  const std::string rng_hex =
      get_str(field(j, "rng_state_hex", source, ""), source, "rng_state_hex");
  auto rng = hex::decode(rng_hex);
  if (!rng) {
    fail(source, cat("rng_state_hex (", rng_hex.size(),
                     " characters) is not hex: an even number of digits 0-9a-f is expected"));
  }
  idx.state.rng_state = *rng;
  if (j.contains("extra")) idx.state.extra = j["extra"];
  if (get_str(field(j, "checksum", source, ""), source, "checksum") != "xxh64") {
    fail(source, "checksum algorithm is not 'xxh64'");
  }
}

// files[k]: the rank file's fixed name, its size and its checksums.
FileEntry parse_file_entry(const json& f, size_t k, const std::string& source) {
  std::string where = cat("files[", k, "] ");
  if (!f.is_object()) fail(source, where + "is not an object");
  FileEntry fe;
  fe.name = get_str(field(f, "name", source, where), source, where + "name");
  // A fixed pattern: an index can never name a path outside its directory.
  if (fe.name != rank_file_name(static_cast<int>(k))) {
    fail(source, cat(where, "name ", shown(fe.name), " is not '",
                     rank_file_name(static_cast<int>(k)), "'"));
  }
  fe.sums.file_bytes = static_cast<uint64_t>(
      get_int(field(f, "bytes", source, where), 8, kI64Max, source, where + "bytes"));
  fe.sums.xxh64 = get_hex64(field(f, "xxh64", source, where), source, where + "xxh64");
  fe.sums.block_bytes =
      static_cast<uint64_t>(get_int(field(f, "block_bytes", source, where), 4096, int64_t{1} << 32,
                                    source, where + "block_bytes"));
  const json& blocks = field(f, "block_xxh64", source, where);
  uint64_t want = (fe.sums.file_bytes + fe.sums.block_bytes - 1) / fe.sums.block_bytes;
  if (!blocks.is_array() || blocks.size() != want) {
    fail(source, cat(where, "block_xxh64 must list ", want, " checksums for ", fe.sums.file_bytes,
                     " bytes in blocks of ", fe.sums.block_bytes));
  }
  for (const auto& b : blocks)
    fe.sums.blocks.push_back(get_hex64(b, source, where + "block_xxh64[]"));
  return fe;
}

// The pieces of entry `e`: the ranks holding it, and for a row-sharded tensor their rows, which
// must cover all rows in order.
void parse_pieces(const json& t, const std::string& name, const std::string& where, int world_size,
                  const std::string& source, IndexEntry& e) {
  const json& pieces = field(t, "pieces", source, where);
  if (!pieces.is_array()) fail_tensor(source, name, "pieces is not an array");
  int64_t next = 0;
  for (const auto& p : pieces) {
    if (!p.is_object()) fail_tensor(source, name, "a piece is not an object");
    IndexEntry::Piece pc;
    pc.rank = static_cast<int>(get_int(field(p, "rank", source, where + "piece "), 0,
                                       world_size - 1, source, where + "piece rank"));
    if (e.replicated) {
      pc.row_begin = 0;
      pc.row_end = e.rows();
    } else {
      const json& rows = field(p, "rows", source, where + "piece ");
      if (!rows.is_array() || rows.size() != 2)
        fail_tensor(source, name, "piece rows is not [begin, end]");
      pc.row_begin = get_int(rows[0], 0, e.rows(), source, where + "piece rows[0]");
      pc.row_end = get_int(rows[1], 0, e.rows(), source, where + "piece rows[1]");
      if (pc.row_begin != next || pc.row_end <= pc.row_begin) {
        fail_tensor(source, name,
                    cat("piece rows [", pc.row_begin, ", ", pc.row_end, ") of rank ", pc.rank,
                        " do not continue at row ", next,
                        "; pieces must cover the rows in order without gaps or overlaps"));
      }
      next = pc.row_end;
    }
    e.pieces.push_back(pc);
  }
  if (e.replicated && e.pieces.empty())
    fail_tensor(source, name, "replicated tensor lists no rank");
  if (!e.replicated && next != e.rows()) {
    fail_tensor(source, name,
                cat("pieces cover rows [0, ", next, ") of ", e.rows(),
                    "; rows are missing - the checkpoint is incomplete"));
  }
}

// tensors[name]: dtype, shape (bounded, no overflow), kind and pieces.
IndexEntry parse_tensor_entry(const std::string& name, const json& t, int world_size,
                              const std::string& source) {
  std::string where = cat("tensor ", shown(name), " ");
  if (name.empty()) fail(source, "a tensor has an empty name");
  if (!t.is_object()) fail_tensor(source, name, "is not an object");
  IndexEntry e;
  e.name = name;
  e.dtype = get_str(field(t, "dtype", source, where), source, where + "dtype");
  if (!safetensors::dtype_size(e.dtype))
    fail_tensor(source, name, cat("unknown dtype ", shown(e.dtype)));
  const json& shape = field(t, "shape", source, where);
  if (!shape.is_array() || shape.size() > 64)
    fail_tensor(source, name, "shape is not an array of at most 64 sizes");
  uint64_t numel = 1;
  for (const auto& d : shape) {
    int64_t x = get_int(d, 0, kI64Max, source, where + "shape[]");
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(x), &numel)) {
      fail_tensor(source, name,
                  cat("shape ", shape.dump(), " has an element count that overflows 64 bits"));
    }
    e.global_shape.push_back(x);
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(numel, *safetensors::dtype_size(e.dtype), &bytes) ||
      bytes > static_cast<uint64_t>(kI64Max)) {
    fail_tensor(source, name, cat("shape ", shape.dump(), " is too large for its dtype"));
  }
  std::string kind = get_str(field(t, "kind", source, where), source, where + "kind");
  if (kind != "rows" && kind != "slices" && kind != "replicated")
    fail_tensor(source, name,
                cat("kind ", shown(kind), " is not 'rows', 'slices' or 'replicated'"));
  e.replicated = kind == "replicated";
  if (kind == "slices") {
    // Dim 0 is "rows"; a 0-d tensor has one row and no other dim.
    const int64_t n = static_cast<int64_t>(e.global_shape.size());
    if (n < 2) fail_tensor(source, name, cat("kind 'slices' needs at least 2 dims, shape has ", n));
    e.dim = get_int(field(t, "dim", source, where), 1, n - 1, source, where + "dim");
  }
  parse_pieces(t, name, where, world_size, source, e);
  return e;
}

}  // namespace

std::string rank_file_name(int rank) { return cat("rank", rank, ".safetensors"); }

const IndexEntry* Index::find(const std::string& name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const IndexEntry& e, const std::string& n) { return e.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

Index parse_index(const std::string& text, const std::string& source) {
  if (text.size() > kMaxIndexBytes) {
    fail(source, cat(text.size(), " bytes, over the cap of ", kMaxIndexBytes));
  }
  // 16 levels: the trainer's "extra" object nests a little; the schema itself needs 4.
  json j = detail::parse_json_strict(text, 16, cat("checkpoint index '", source, "'"));
  if (!j.is_object()) fail(source, "not a JSON object");
  Index idx;
  parse_header_fields(j, source, idx);

  const json& files = field(j, "files", source, "");
  if (!files.is_array() || files.size() != static_cast<size_t>(idx.world_size)) {
    fail(source, cat("'files' must list one file per rank (world_size ", idx.world_size, ")"));
  }
  for (size_t k = 0; k < files.size(); ++k)
    idx.files.push_back(parse_file_entry(files[k], k, source));

  const json& tensors = field(j, "tensors", source, "");
  if (!tensors.is_object()) fail(source, "'tensors' is not an object");
  for (auto it = tensors.begin(); it != tensors.end(); ++it)
    idx.tensors.push_back(parse_tensor_entry(it.key(), *it, idx.world_size, source));
  std::sort(idx.tensors.begin(), idx.tensors.end(),
            [](const IndexEntry& a, const IndexEntry& b) { return a.name < b.name; });
  check_content(std::move(j), source);  // last: a malformed index says what is malformed
  return idx;
}

std::string index_to_json(const Index& idx) {
  json j;
  j["format"] = kFormatName;
  j["format_version"] = idx.format_version;
  j["world_size"] = idx.world_size;
  j["sharding"] = idx.sharding;
  j["optimizer"] = idx.optimizer;
  j["step"] = idx.state.step;
  j["data_position"] = idx.state.data_position;
  j["rng_state_hex"] = hex::encode(idx.state.rng_state);
  if (!idx.state.extra.is_null()) j["extra"] = idx.state.extra;
  j["checksum"] = "xxh64";
  j["files"] = json::array();
  for (const auto& f : idx.files) {
    json blocks = json::array();
    for (uint64_t b : f.sums.blocks) blocks.push_back(hex::encode_u64(b));
    j["files"].push_back({{"name", f.name},
                          {"bytes", f.sums.file_bytes},
                          {"xxh64", hex::encode_u64(f.sums.xxh64)},
                          {"block_bytes", f.sums.block_bytes},
                          {"block_xxh64", blocks}});
  }
  j["tensors"] = json::object();
  for (const auto& e : idx.tensors) {
    json pieces = json::array();
    for (const auto& p : e.pieces) {
      if (e.replicated) {
        pieces.push_back({{"rank", p.rank}});
      } else {
        pieces.push_back({{"rank", p.rank}, {"rows", {p.row_begin, p.row_end}}});
      }
    }
    j["tensors"][e.name] = {{"dtype", e.dtype},
                            {"shape", e.global_shape},
                            {"kind", e.replicated ? "replicated"
                                     : e.dim      ? "slices"
                                                  : "rows"},
                            {"pieces", pieces}};
    if (e.dim) j["tensors"][e.name]["dim"] = e.dim;
  }
  j[kIndexChecksum] = hex::encode_u64(content_checksum(j));
  return j.dump(1) + "\n";
}

std::optional<int64_t> step_of_dir(const std::string& ckpt_dir) {
  std::string d = ckpt_dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  const std::string name = d.substr(d.find_last_of('/') + 1);
  if (name.rfind("step_", 0) != 0 || name.size() <= 5 || name.size() > 5 + 18) return std::nullopt;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  return std::stoll(name.substr(5));
}

void check_index_step(const Index& index, const std::string& ckpt_dir) {
  const auto named = step_of_dir(ckpt_dir);
  FSDP_CHECK(!named || *named == index.state.step, "checkpoint '", ckpt_dir, "': ", kIndexFile,
             " says step ", index.state.step, ", but the directory is named for step ", *named,
             ": the index was edited or the directory renamed, so the step of these weights is "
             "unknown (a resumed run would continue them as step ",
             index.state.step,
             "). Restore the original index, or rename the directory to "
             "match it if the index is right");
}

}  // namespace fsdp::checkpoint
