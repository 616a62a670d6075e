// The index of a sharded checkpoint (index.json): what a checkpoint holds and where. Torch-free so
// that its parser can be fuzzed alone. The index is untrusted input: parse_index() validates every
// field (file names are fixed patterns, so an index cannot point outside its directory; pieces
// cover each tensor's rows exactly; shapes, sizes and checksums are well formed). Schema:
// docs/checkpoint.md.
//
// Thread-safety: plain values and reentrant functions.
#pragma once

#include <fsdp/safetensors.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::checkpoint {

inline constexpr int kFormatVersion = 1;
inline constexpr const char* kFormatName = "fsdp-cpp-checkpoint";
inline constexpr const char* kIndexFile = "index.json";
inline constexpr uint64_t kMaxIndexBytes = 256ull << 20;
inline constexpr int kMaxWorldSize = 1 << 16;

// Everything besides tensors that a resumed run needs.
struct TrainState {
  int64_t step = 0;           // optimizer steps taken
  int64_t data_position = 0;  // opaque to the checkpoint: where the data loader resumes
  std::string rng_state;      // raw bytes (e.g. a generator's state); stored hex in the index
  nlohmann::json extra;       // any JSON the trainer wants back (config, metrics, ...)
};

// One tensor of the checkpoint: a parameter ("h.0.w") or a piece of optimizer state
// ("h.0.w::exp_avg", "h.0.w::step").
struct IndexEntry {
  std::string name;
  std::string dtype;                  // safetensors dtype string ("F32", ...)
  std::vector<int64_t> global_shape;  // [] for a 0-d tensor (one row)
  // "rows": sharded on dim 0, each piece holds global rows [row_begin, row_end) in the file of
  // `rank` as a tensor of shape [row_end - row_begin, global_shape[1:]...] (a 0-d tensor: [1]).
  // "slices": the same on dim `dim` (ShardOptions::shard_placement_fn): a piece holds indices
  // [row_begin, row_end) of that dim, its shape global_shape with that dim row_end - row_begin.
  // "replicated": every listed rank's file holds the whole tensor; any one may be read.
  bool replicated = false;
  struct Piece {
    int rank = 0;
    int64_t row_begin = 0;
    int64_t row_end = 0;
  };
  std::vector<Piece> pieces;  // rows: ordered, exactly covering [0, rows); replicated: >= 1
  int64_t dim = 0;            // the dim the pieces split ("rows": 0)
  int64_t rows() const { return global_shape.empty() ? 1 : global_shape[dim]; }
};

struct FileEntry {
  std::string name;  // "rank<k>.safetensors", relative to the checkpoint directory
  safetensors::Checksums sums;
};

struct Index {
  int format_version = kFormatVersion;
  int world_size = 1;
  std::string sharding = "dim0-chunk";  // torch.chunk rule: c = ceil(rows / world)
  std::string optimizer = "none";       // "adamw", "adam", "sgd" or "none"
  TrainState state;
  std::vector<FileEntry> files;                           // one per rank, files[k] is rank k's
  std::vector<IndexEntry> tensors;                        // sorted by name
  const IndexEntry* find(const std::string& name) const;  // nullptr when absent
};

// Validates and parses; throws fsdp::Error naming `source` and the offending entry.
Index parse_index(const std::string& json_text, const std::string& source);
std::string index_to_json(const Index& index);

// The file name of rank k's shards.
std::string rank_file_name(int rank);

// The step a step directory's name stands for ("RUN/step_00000300" -> 300; a trailing '/' is
// ignored), or nullopt for any other name.
std::optional<int64_t> step_of_dir(const std::string& ckpt_dir);
// Throws fsdp::Error when `ckpt_dir` is named for another step than its index holds (an edited
// index or a renamed directory: which step the weights belong to is unknown, and a resumed run
// would continue them as the wrong step, then overwrite the real one).
void check_index_step(const Index& index, const std::string& ckpt_dir);

}  // namespace fsdp::checkpoint
