// Sharded checkpoints, the writing side: save() (and HSDP's replica 0 writing for all replicas),
// each rank's file, and rank 0's index, written last.
// [Note: checkpoint atomicity] Each rank renames its file into place, then rank 0 renames the index
// last; a step directory without a parseable index is incomplete and latest() reports and skips it.
// Every step that can fail on one rank ends in agree(), so all ranks raise together instead of one
// rank waiting in the next collective. Format and schema: docs/checkpoint.md.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fsdp/checkpoint.h>
#include <fsdp/safetensors_torch.h>
#include <fsdp/state_dict.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <map>
#include <optional>
#include <utility>

#include "checkpoint/atomic_file.h"
#include "checkpoint/checkpoint_common.h"
#include "checkpoint/hex.h"
#include "checkpoint/optim_state.h"
#include "checkpoint/save_phases.h"
#include "checkpoint/test_hooks.h"
#include "core/explicit_collective.h"

namespace fsdp::checkpoint {

namespace fs = std::filesystem;
namespace st = fsdp::safetensors;
using detail::cat;
using json = nlohmann::json;
using namespace internal;

namespace test_hooks {
namespace {
std::optional<int> g_fail_after_files;
std::optional<SavePoint> g_kill_at;
std::chrono::milliseconds g_delay{0};
}  // namespace
void fail_next_save_after_files(int n) { g_fail_after_files = n; }
void kill_next_save_at(SavePoint point) { g_kill_at = point; }
void delay_next_async_write(std::chrono::milliseconds delay) { g_delay = delay; }
Taken take() {
  Taken t{std::exchange(g_fail_after_files, std::nullopt), std::exchange(g_kill_at, std::nullopt),
          std::exchange(g_delay, std::chrono::milliseconds(0))};
  return t;
}
}  // namespace test_hooks

namespace {

// What one rank wrote, sent to rank 0 for the index.
json local_manifest(const std::vector<st::TensorView>& views,
                    const std::vector<std::pair<int64_t, int64_t>>& rows,
                    const std::vector<int64_t>& dims,
                    const std::vector<std::vector<int64_t>>& global_shapes,
                    const std::vector<bool>& replicated, const st::Checksums& sums) {
  json m;
  m["bytes"] = sums.file_bytes;
  m["xxh64"] = hex::encode_u64(sums.xxh64);
  m["block_bytes"] = sums.block_bytes;
  json blocks = json::array();
  for (auto b : sums.blocks) blocks.push_back(hex::encode_u64(b));
  m["block_xxh64"] = blocks;
  m["tensors"] = json::array();
  for (size_t i = 0; i < views.size(); ++i) {
    m["tensors"].push_back({{"name", views[i].name},
                            {"dtype", views[i].dtype},
                            {"shape", global_shapes[i]},
                            {"replicated", replicated[i]},
                            {"dim", dims[i]},
                            {"rows", {rows[i].first, rows[i].second}}});
  }
  return m;
}

Index build_index(const std::vector<std::string>& manifests, const std::string& optimizer,
                  const TrainState& state, const std::string& ckpt) {
  Index idx;
  idx.world_size = static_cast<int>(manifests.size());
  idx.optimizer = optimizer;
  idx.state = state;
  std::map<std::string, IndexEntry> by_name;
  for (size_t r = 0; r < manifests.size(); ++r) {
    json m = json::parse(manifests[r]);
    FileEntry f;
    f.name = rank_file_name(static_cast<int>(r));
    f.sums.file_bytes = m["bytes"].get<uint64_t>();
    f.sums.xxh64 = *hex::decode_u64(m["xxh64"].get<std::string>());
    f.sums.block_bytes = m["block_bytes"].get<uint64_t>();
    for (const auto& b : m["block_xxh64"])
      f.sums.blocks.push_back(*hex::decode_u64(b.get<std::string>()));
    idx.files.push_back(std::move(f));
    for (const auto& t : m["tensors"]) {
      auto name = t["name"].get<std::string>();
      auto [it, fresh] = by_name.try_emplace(name);
      IndexEntry& e = it->second;
      auto shape = t["shape"].get<std::vector<int64_t>>();
      auto dtype = t["dtype"].get<std::string>();
      bool repl = t["replicated"].get<bool>();
      auto dim = t["dim"].get<int64_t>();
      if (fresh) {
        e.name = name;
        e.dtype = dtype;
        e.global_shape = shape;
        e.replicated = repl;
        e.dim = dim;
      } else if (e.dtype != dtype || e.global_shape != shape || e.replicated != repl ||
                 e.dim != dim) {
        throw Error(cat("checkpoint save '", ckpt, "': tensor '", name, "' is ", dtype, " ",
                        shape_str(shape), " sharded on dim ", dim, " on rank ", r, " but ", e.dtype,
                        " ", shape_str(e.global_shape), " sharded on dim ", e.dim,
                        " on a lower rank; every rank must shard the same model"));
      }
      IndexEntry::Piece p;
      p.rank = static_cast<int>(r);
      p.row_begin = t["rows"][0].get<int64_t>();
      p.row_end = t["rows"][1].get<int64_t>();
      e.pieces.push_back(p);
    }
  }
  for (auto& [name, e] : by_name) {
    if (e.replicated) e.pieces.resize(1);  // any one copy will do; keep the lowest rank's
    std::sort(e.pieces.begin(), e.pieces.end(),
              [](const auto& a, const auto& b) { return a.row_begin < b.row_begin; });
    idx.tensors.push_back(std::move(e));
  }
  return idx;
}

void maybe_kill(const test_hooks::Taken& hooks, test_hooks::SavePoint here) {
  if (hooks.kill_at == here) ::raise(SIGKILL);
}

std::string save_shards(const std::string& dir, const FSDPModule& root,
                        torch::optim::Optimizer* opt, const TrainState& state, Communicator& comm);

}  // namespace

std::string save(const std::string& dir, const FSDPModule& root, torch::optim::Optimizer* opt,
                 const TrainState& state, Communicator& comm) {
  refuse_elastic(root, "checkpoint save");
  fsdp::detail::agree_explicit_collective(root, fsdp::detail::protocol::Explicit::kCheckpointSave);
  // An AsyncSaver's write still running may be of this very step directory: let it end first.
  wait_for_background_writes(2 * comm.timeout(), "checkpoint save");
  const auto& replicas = root.replicate_communicator();
  if (!replicas) return save_shards(dir, root, opt, state, comm);
  // HSDP: every replica holds the same shards; replica 0 writes them over the shard communicator,
  // the others wait for its outcome (success, or its error), so that no two ranks write one file.
  // The caller may pass that communicator or the world (as load takes either).
  Communicator& shard = root.communicator();
  FSDP_CHECK(&comm == &shard || comm.size() == shard.size() * replicas->size(),
             "checkpoint save: under HSDP pass the shard communicator (mesh.shard, ", shard.size(),
             " ranks) or the world (", shard.size() * replicas->size(), " ranks); '", comm.name(),
             "' has ", comm.size());
  std::string path = dir + "/" + step_dir_name(state.step);
  std::exception_ptr error;
  if (replicas->rank() == 0) {
    try {
      path = save_shards(dir, root, opt, state, shard);
    } catch (...) {
      error = std::current_exception();
    }
  }
  auto failed = at::tensor(std::vector<int64_t>{error ? 1 : 0}, at::kLong);
  replicas->broadcast(failed, 0).wait();
  if (error) std::rethrow_exception(error);
  FSDP_CHECK(failed.item<int64_t>() == 0,
             "checkpoint save: replica 0, which writes for every "
             "replica under HSDP, failed (its error says why); nothing was saved");
  return path;
}

namespace {
std::string save_shards(const std::string& dir, const FSDPModule& root,
                        torch::optim::Optimizer* opt, const TrainState& state, Communicator& comm) {
  FSDP_CHECK(state.step >= 0, "checkpoint save: step ", state.step, " is negative");
  const auto hooks = test_hooks::take();
  // Buffers are saved from rank 0: say so when the ranks' copies differ (collective).
  check_buffers_agree(root, cat("checkpoint save '", dir, "/", step_dir_name(state.step),
                                "' keeps rank 0's values"));
  RankFile file;
  const std::string error =
      detail::error_of([&] { file = collect(root, opt, comm.rank(), nullptr); });
  return commit_files(dir, file, state, comm, error, hooks);
}
}  // namespace
}  // namespace fsdp::checkpoint

// ---- the phases (save_phases.h) ----
namespace fsdp::checkpoint::internal {

at::Tensor Staging::copy(size_t slot, const at::Tensor& src) {
  at::Tensor t = src.detach();
  if (t.dim() == 0) t = t.reshape({1});
  if (slot >= buffers_.size()) buffers_.resize(slot + 1);
  at::Tensor& buf = buffers_[slot];
  if (!buf.defined() || buf.sizes() != t.sizes() || buf.scalar_type() != t.scalar_type()) {
    // Pinned host memory lets a CUDA source copy at full bus speed; a CPU source needs none.
    buf = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.is_cuda()));
  }
  buf.copy_(t);
  return buf;
}

void Staging::trim(size_t used) {
  if (buffers_.size() > used) buffers_.resize(used);
}

uint64_t Staging::bytes() const {
  uint64_t n = 0;
  for (const auto& b : buffers_)
    if (b.defined()) n += static_cast<uint64_t>(b.numel()) * b.element_size();
  return n;
}

void RankFile::add(const std::string& name, at::Tensor host, std::pair<int64_t, int64_t> r,
                   int64_t dim, std::vector<int64_t> shape, bool repl) {
  keep.push_back(std::move(host));
  views.push_back(st::view_of(name, keep.back()));
  rows.push_back(r);
  dims.push_back(dim);
  shapes.push_back(std::move(shape));
  replicated.push_back(repl);
}

RankFile collect(const FSDPModule& root, torch::optim::Optimizer* opt, int rank, Staging* staging) {
  RankFile out;
  out.kind = kind_of(opt);
  size_t slot = 0;
  // A host copy of t: a staged copy, or t itself where it already is a contiguous CPU tensor.
  auto host = [&](const at::Tensor& t) {
    if (staging) return staging->copy(slot++, t);
    at::Tensor c = t.detach().contiguous().cpu();
    return c.dim() == 0 ? c.reshape({1}) : c;
  };
  // A shard's rows (of dim info.dim) under `name`; an empty shard contributes no piece. A 0-d
  // tensor is one row, written as shape [1] like a sharded 0-d parameter's shard: an ignored
  // parameter (and its optimizer state) is the whole 0-d tensor, which the pieces' shapes in the
  // index and every reader take as one row.
  auto add_rows = [&](const std::string& name, const at::Tensor& t, const ShardInfo& info) {
    const int64_t n = t.dim() == 0 ? 1 : t.size(info.dim);
    if (n == 0) return;
    out.add(name, host(t), {info.row_offset, info.row_offset + n}, info.dim, info.global_shape,
            false);
  };
  for (const auto& info : root.shards()) {
    if (info.ignored && rank != 0) continue;  // whole on every rank: rank 0's rows are the entry
    std::vector<std::pair<std::string, at::Tensor>> state_rows;
    std::optional<int64_t> step;
    state_of(opt, out.kind, info.shard, &state_rows, &step);
    add_rows(info.name, info.shard, info);
    for (const auto& [suffix, t] : state_rows) add_rows(info.name + "::" + suffix, t, info);
    if (step)
      out.add(info.name + "::step", at::scalar_tensor(*step, at::kLong), {0, 1}, 0, {}, true);
  }
  if (rank == 0) {
    for (const auto& [name, b] : named_buffers(root)) {
      at::Tensor h = staging ? staging->copy(slot++, b) : b.detach().contiguous().cpu();
      if (b.dim() == 0) h = h.reshape({});  // a buffer keeps its own shape
      out.add(name, h, {0, 1}, 0, b.sizes().vec(), true);
    }
  }
  if (staging) staging->trim(slot);
  return out;
}

std::string commit_files(const std::string& dir, const RankFile& file, const TrainState& state,
                         Communicator& comm, const std::string& prior_error,
                         const test_hooks::Taken& hooks) {
  const std::string ckpt = dir + "/" + step_dir_name(state.step);
  const int rank = comm.rank();
  using test_hooks::SavePoint;

  // 1. Rank 0 prepares the directory and withdraws an older index of the same step, so that a
  //    half-rewritten step can never look complete.
  //    Temporaries of killed saves go too: no rank writes before this step's agreement.
  std::string error = prior_error;
  if (rank == 0 && error.empty()) {
    error = detail::error_of([&] {
      fs::create_directories(ckpt);
      fs::remove(fs::path(ckpt) / kIndexFile);
      remove_stale_temporaries(dir);
    });
  }
  agree(comm, error, "save");
  maybe_kill(hooks, SavePoint::kBeforeFiles);

  // 2. Every rank writes its file.
  st::Checksums sums;
  error = detail::error_of([&] {
    if (!hooks.fail_after_files || rank < *hooks.fail_after_files) {
      sums = st::write(ckpt + "/" + rank_file_name(rank), file.views,
                       {{"format", "pt"},
                        {"fsdp_rank", std::to_string(rank)},
                        {"fsdp_world_size", std::to_string(comm.size())}});
    }
  });
  maybe_kill(hooks, SavePoint::kFileInPlace);
  agree(comm, error, "save");
  if (hooks.fail_after_files) {
    throw Error(cat("checkpoint save '", ckpt,
                    "' interrupted by the test hook fail_next_save_after_files(",
                    *hooks.fail_after_files, ") after the rank files, before the index"));
  }

  // 3. Rank 0 writes the index last.
  auto manifests = detail::all_gather_strings(
      comm,
      local_manifest(file.views, file.rows, file.dims, file.shapes, file.replicated, sums).dump());
  maybe_kill(hooks, SavePoint::kBeforeIndex);
  error = rank != 0 ? std::string() : detail::error_of([&] {
    Index idx = build_index(manifests, kind_name(file.kind), state, ckpt);
    std::string text = index_to_json(idx);
    parse_index(text, ckpt + "/" + kIndexFile);  // what we write must pass our own validation
    write_text_atomic(ckpt + "/" + kIndexFile, text);
  });
  agree(comm, error, "save");
  maybe_kill(hooks, SavePoint::kAfterCommit);
  return ckpt;
}

}  // namespace fsdp::checkpoint::internal
