// Sharded checkpoints: each rank writes its shards (parameters and optimizer state) to one
// safetensors file, rank 0 writes index.json last. Loadable at any world size (resharding from the
// index: each rank reads only the byte ranges of the rows it holds), consolidable offline into one
// full safetensors file with the unsharded names. No pickle; every byte read is validated first.
// Format, index schema, atomicity and the security stance: docs/checkpoint.md.
//
// Layout:  DIR/step_<8-digit step>/rank<k>.safetensors   (k = 0 .. world-1)
//          DIR/step_<8-digit step>/index.json            (written last; its presence = complete)
//
// Thread-safety: save/load/init_from are collectives (every rank calls them in the same order, from
// the thread that trains); latest/consolidate are local and may run on any thread.
#pragma once

#include <fsdp/communicator.h>
#include <fsdp/error.h>
#include <fsdp/fully_shard.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace fsdp::checkpoint {

// Everything besides tensors that a resumed run needs.
struct TrainState {
  int64_t step = 0;           // optimizer steps taken
  int64_t data_position = 0;  // opaque to the checkpoint: where the data loader resumes
  std::string rng_state;      // raw bytes (e.g. a generator's state); stored hex in the index
  nlohmann::json extra;       // any JSON the trainer wants back (config, metrics, ...)
};

// Collective: every rank writes DIR/step_<step>/rank<k>.safetensors (params + optimizer state of
// its shards), rank 0 writes index.json last. Returns the checkpoint directory. `opt` may be null
// (parameters only). Optimizer state is saved for torch::optim AdamW, Adam and SGD; another
// optimizer type is an error.
std::string save(const std::string& dir, const FSDPModule& root, torch::optim::Optimizer* opt,
                 const TrainState& state, Communicator& comm);

// The newest complete checkpoint under `dir` (a step_* directory whose index.json is present and
// parses), or nullopt. Incomplete saves (no index) are skipped.
std::optional<std::string> latest(const std::string& dir);

// Collective: loads `ckpt_dir` (a step_* directory) into the sharded model and optimizer at any
// world size. Verifies the checksum of every file it reads, dtype/shape against the model, and
// names missing tensors. With `opt` null the optimizer state is not read. Creates optimizer state
// entries when the optimizer has none yet. Returns the saved TrainState.
TrainState load(const std::string& ckpt_dir, const FSDPModule& root, torch::optim::Optimizer* opt,
                Communicator& comm);

// Offline, one process: writes one full safetensors file with the unsharded parameter names (no
// optimizer state); the index's step/data_position are copied into its __metadata__.
void consolidate(const std::string& ckpt_dir, const std::string& out_file);

// Each rank reads its rows of every parameter from a full safetensors file (e.g. consolidate()'s
// output, or any file with the model's parameter names). Not collective: no communication.
void init_from(const std::string& file, const FSDPModule& root);

// ---- lower-level pieces (tests, tools) ----

// The index of one checkpoint, parsed and validated (untrusted bytes). Throws fsdp::Error naming
// `source` and the offending entry.
struct IndexEntry {
  std::string name;                   // tensor name as stored, e.g. "h.0.w" or "h.0.w::exp_avg"
  std::string dtype;                  // safetensors dtype string ("F32", ...)
  std::vector<int64_t> global_shape;  // [] for a 0-d tensor
  struct Piece {
    int rank = 0;           // file rank<rank>.safetensors
    int64_t row_begin = 0;  // global rows [row_begin, row_end) held by that file
    int64_t row_end = 0;
  };
  std::vector<Piece> pieces;  // ordered by row_begin, covering [0, rows) without gaps
};
struct Index {
  int format_version = 1;
  int world_size = 1;
  std::string sharding = "dim0-chunk";
  TrainState state;
  std::vector<std::string> files;    // per rank, file name relative to the checkpoint dir
  std::vector<uint64_t> checksums;   // per rank, fnv1a64 of the whole file
  std::vector<uint64_t> file_sizes;  // per rank, bytes
  std::vector<IndexEntry> tensors;   // parameters and optimizer state
};
Index parse_index(const std::string& json_text, const std::string& source);
std::string index_to_json(const Index& index);

// Test hook: when the environment variable FSDP_CKPT_FAIL_AFTER_FILES=n is set, save() throws
// fsdp::Error on every rank after n rank files were renamed into place (before the index).
inline constexpr const char* kFailAfterFilesEnv = "FSDP_CKPT_FAIL_AFTER_FILES";

}  // namespace fsdp::checkpoint
