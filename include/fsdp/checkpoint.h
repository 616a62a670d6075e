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
// the thread that trains); defect/scan/latest/keep_last/remove_stale_temporaries/consolidate are
// local and may run on any thread.
#pragma once

#include <fsdp/checkpoint_index.h>
#include <fsdp/communicator.h>
#include <fsdp/error.h>
#include <fsdp/fully_shard.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace fsdp::checkpoint {

// Collective: every rank writes DIR/step_<step>/rank<k>.safetensors (params + optimizer state of
// its shards; rank 0 also the model's buffers, whole, after a warning (TORCH_WARN) when they differ
// across ranks: fsdp::check_buffers_agree), rank 0 writes index.json last. Returns the checkpoint
// directory. `opt` may be null (parameters only). Optimizer state is saved for torch::optim AdamW,
// Adam and SGD, and fsdp::optim AdamW and SGD (include/fsdp/optim.h: LibTorch's state layout, so a
// checkpoint of one loads into the other); another optimizer type is an error. Under HSDP `comm` is
// the shard communicator (mesh.shard) or the world; the ranks of replica 0 write, the others wait
// for their outcome. An AsyncSaver's background write still running in this process (it may be of
// the same step) is waited for first; its failure stays the AsyncSaver's to raise.
std::string save(const std::string& dir, const FSDPModule& root, torch::optim::Optimizer* opt,
                 const TrainState& state, Communicator& comm);

// Why the step directory `ckpt_dir` cannot be loaded ("incomplete: no index.json ...", the index's
// parse error, a rank file missing or of the wrong size), or nullopt when it looks complete.
// Cheap: parses the index and stats the files; load() verifies the checksums.
std::optional<std::string> defect(const std::string& ckpt_dir);

// A step directory passed over, and why.
struct Skipped {
  std::string path;
  std::string reason;  // defect()'s text
};
struct Scan {
  std::optional<std::string> latest;  // the newest step directory without a defect
  std::vector<Skipped> skipped;       // newest first: every step directory newer than `latest`
};
// Examines the step_* directories of `dir`, newest first, down to the first without a defect.
Scan scan(const std::string& dir);

// scan(dir).latest, after reporting every newer step directory it passes over ("checkpoint
// 'DIR/step_..' is unusable (reason); falling back to ..."), one line each through `report`
// (default: a warning through TORCH_WARN, on stderr unless a c10 warning handler routes it). A
// damaged newest checkpoint is never skipped silently.
std::optional<std::string> latest(const std::string& dir,
                                  const std::function<void(const std::string&)>& report = nullptr);

// Retention: removes every complete checkpoint of `dir` but the newest `keep`, and incomplete or
// damaged step directories older than the oldest one kept (never a newer one: it may be a save in
// progress, or the evidence of a failure). Returns the removed directories, oldest first. Local:
// call it on one rank, between saves. REQUIRES: keep >= 1.
std::vector<std::string> keep_last(const std::string& dir, int keep);

// Removes the "<file>.tmp.<pid>" temporaries of killed saves (the pid is not a live process on this
// host) in `dir` and its step directories; returns their paths. save() does this on rank 0 before
// any rank writes. REQUIRES: no save into `dir` in progress on another host.
std::vector<std::string> remove_stale_temporaries(const std::string& dir);

// Collective: loads `ckpt_dir` (a step_* directory) into the sharded model and optimizer at any
// world size. Verifies the checksum of every file it reads, dtype/shape against the model, and
// names missing tensors; restores every buffer (an index without buffers, from before they were
// saved, leaves them as they are, with a note (TORCH_WARN) on rank 0). With `opt` null the
// optimizer state is not read. Creates optimizer state entries when the optimizer has none yet.
// Returns the saved TrainState.
TrainState load(const std::string& ckpt_dir, const FSDPModule& root, torch::optim::Optimizer* opt,
                Communicator& comm);

// Offline, one process: writes one full safetensors file with the unsharded parameter and buffer
// names (no optimizer state); the index's step/data_position are copied into its __metadata__.
void consolidate(const std::string& ckpt_dir, const std::string& out_file);

// Each rank reads its rows of every parameter from a full safetensors file (e.g. consolidate()'s
// output, or any file with the model's parameter names and dtypes), and every buffer whole (a file
// without any of the model's buffers leaves them as they are, with a note (TORCH_WARN) on rank 0).
// Collective over root.communicator(): a failure on any rank is raised on every rank.
void init_from(const std::string& file, const FSDPModule& root);

}  // namespace fsdp::checkpoint
