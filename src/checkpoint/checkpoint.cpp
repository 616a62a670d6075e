// Sharded checkpoints over fully_shard: save / latest / load / consolidate / init_from.
// [Note: checkpoint atomicity] Each rank renames its file into place, then rank 0 renames the index
// last; a step directory without a parseable index is incomplete and latest() reports and skips it.
// Every step that can fail on one rank ends in agree(), so all ranks raise together instead of one
// rank waiting in the next collective. Format and schema: docs/checkpoint.md.
#include <ATen/ATen.h>
#include <fsdp/atomic_file.h>
#include <fsdp/checkpoint.h>
#include <fsdp/hex.h>
#include <fsdp/safetensors_torch.h>
#include <fsdp/state_dict.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>

#include "compat/optim.h"

namespace fsdp::checkpoint {

namespace fs = std::filesystem;
namespace st = fsdp::safetensors;
using detail::cat;
using json = nlohmann::json;

namespace {

enum class OptKind {
  kNone,   // no optimizer state saved / loaded
  kAdamW,  // torch::optim::AdamW
  kAdam,   // torch::optim::Adam
  kSGD,    // torch::optim::SGD
};

OptKind kind_of(torch::optim::Optimizer* opt) {
  if (!opt) return OptKind::kNone;
  if (dynamic_cast<torch::optim::AdamW*>(opt)) return OptKind::kAdamW;
  if (dynamic_cast<torch::optim::Adam*>(opt)) return OptKind::kAdam;
  if (dynamic_cast<torch::optim::SGD*>(opt)) return OptKind::kSGD;
  throw Error(
      "checkpoint: the optimizer is not torch::optim AdamW, Adam or SGD, whose state layout this "
      "checkpoint format knows; pass nullptr to save parameters only");
}

const char* kind_name(OptKind k) {
  switch (k) {
    case OptKind::kAdamW:
      return "adamw";
    case OptKind::kAdam:
      return "adam";
    case OptKind::kSGD:
      return "sgd";
    case OptKind::kNone:
      break;
  }
  return "none";
}

template <class State>
void adam_state_out(const State& s, std::vector<std::pair<std::string, at::Tensor>>* rows,
                    std::optional<int64_t>* step) {
  rows->emplace_back("exp_avg", s.exp_avg());
  rows->emplace_back("exp_avg_sq", s.exp_avg_sq());
  if (s.max_exp_avg_sq().defined()) rows->emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
  *step = s.step();
}

// The state of one parameter shard: row-sharded tensors by suffix, and the step count.
void state_of(torch::optim::Optimizer* opt, OptKind kind, const at::Tensor& shard,
              std::vector<std::pair<std::string, at::Tensor>>* rows, std::optional<int64_t>* step) {
  if (kind == OptKind::kNone) return;
  auto it = opt->state().find(compat::optim_state_key(shard));
  if (it == opt->state().end()) return;
  auto* base = it->second.get();
  if (kind == OptKind::kAdamW) {
    adam_state_out(static_cast<torch::optim::AdamWParamState&>(*base), rows, step);
  } else if (kind == OptKind::kAdam) {
    adam_state_out(static_cast<torch::optim::AdamParamState&>(*base), rows, step);
  } else {
    auto& s = static_cast<torch::optim::SGDParamState&>(*base);
    if (s.momentum_buffer().defined()) rows->emplace_back("momentum_buffer", s.momentum_buffer());
  }
}

// ---- agreement over ranks ----
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  int w = comm.size();
  auto len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  auto lens = at::empty({w}, at::kLong);
  comm.all_gather(lens, len).wait();
  int64_t max_len = std::max<int64_t>(1, lens.max().item<int64_t>());
  auto buf = at::zeros({max_len}, at::kByte);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  auto all = at::empty({w * max_len}, at::kByte);
  comm.all_gather(all, buf).wait();
  std::vector<std::string> out;
  auto* p = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < w; ++r)
    out.emplace_back(p + r * max_len, static_cast<size_t>(lens[r].item<int64_t>()));
  return out;
}

// Raises on every rank when `error` is non-empty on any rank: the local message where this rank
// failed, else the first failing rank's message.
void agree(Communicator& comm, const std::string& error, const char* what) {
  auto flag = at::full({1}, error.empty() ? 0 : 1, at::kLong);
  comm.all_reduce(flag, ReduceOp::kSum).wait();
  if (flag.item<int64_t>() == 0) return;
  auto all = all_gather_strings(comm, error);  // every rank takes part, failed or not
  if (!error.empty()) throw Error(error.rfind("fsdp: ", 0) == 0 ? error.substr(6) : error);
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) throw Error(cat("checkpoint ", what, " failed on rank ", r, ": ", all[r]));
  }
  throw Error(cat("checkpoint ", what, " failed on another rank"));
}

template <class F>
std::string capture(F&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

std::string step_dir_name(int64_t step) {
  std::string s = std::to_string(step);
  if (s.size() < 8) s.insert(0, 8 - s.size(), '0');
  return "step_" + s;
}

std::string join(const std::vector<std::string>& names, size_t max = 10) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < max; ++i)
    s += (i ? ", " : "") + ("'" + names[i] + "'");
  if (names.size() > max) s += cat(", ... (", names.size() - max, " more)");
  return s;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// What one rank wrote, sent to rank 0 for the index.
json local_manifest(const std::vector<st::TensorView>& views,
                    const std::vector<std::pair<int64_t, int64_t>>& rows,
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
      if (fresh) {
        e.name = name;
        e.dtype = dtype;
        e.global_shape = shape;
        e.replicated = repl;
      } else if (e.dtype != dtype || e.global_shape != shape || e.replicated != repl) {
        throw Error(cat("checkpoint save '", ckpt, "': tensor '", name, "' is ", dtype, " ",
                        shape_str(shape), " on rank ", r, " but ", e.dtype, " ",
                        shape_str(e.global_shape),
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

// ---- reading pieces ----
class CheckpointReader {
 public:
  CheckpointReader(std::string dir) : dir_(std::move(dir)) {
    std::string path = dir_ + "/" + kIndexFile;
    if (!fs::exists(path)) {
      throw Error(cat("checkpoint '", dir_, "' has no ", kIndexFile,
                      ": the save did not complete; load the previous checkpoint (latest() skips "
                      "incomplete ones)"));
    }
    index_ = parse_index(st::read_text(path, kMaxIndexBytes), path);
  }
  const Index& index() const { return index_; }
  const std::string& dir() const { return dir_; }

  st::File& file(int rank) {
    auto& f = files_[rank];
    if (!f) {
      const auto& fe = index_.files.at(rank);
      f = st::File::open_verified(dir_ + "/" + fe.name, fe.sums);
    }
    return *f;
  }

  // Copies global rows [row_offset, row_offset + dst.size(0)) of `e` into dst (shape
  // [n, global_shape[1:]...]; [n] for a 0-d tensor).
  void fill_rows(const IndexEntry& e, const at::Tensor& dst, int64_t row_offset) {
    int64_t n = dst.dim() == 0 ? 1 : dst.size(0);
    for (const auto& p : e.pieces) {
      int64_t lo = std::max(row_offset, p.row_begin), hi = std::min(row_offset + n, p.row_end);
      if (lo >= hi) continue;
      st::File& f = file(p.rank);
      check_piece(f, e, p);
      at::Tensor src = st::read_rows(f, e.name, lo - p.row_begin, hi - p.row_begin);
      at::NoGradGuard no_grad;
      dst.view({-1})
          .narrow(0, (lo - row_offset) * row_numel(e), (hi - lo) * row_numel(e))
          .copy_(src.view({-1}));
    }
  }

  // Checks every piece of `e` against its file's header before anything is allocated for it, so
  // an index claiming a huge shape cannot make the reader allocate more than the files hold.
  void check_pieces(const IndexEntry& e) {
    for (const auto& p : e.pieces) check_piece(file(p.rank), e, p);
  }

  // A replicated tensor (e.g. an Adam step count), read whole from the first rank holding it.
  at::Tensor read_replicated(const IndexEntry& e) {
    st::File& f = file(e.pieces.at(0).rank);
    check_piece(f, e, e.pieces[0]);
    return st::read_tensor(f, e.name);
  }

 private:
  static int64_t row_numel(const IndexEntry& e) {
    int64_t n = 1;
    for (size_t i = 1; i < e.global_shape.size(); ++i) n *= e.global_shape[i];
    return n;
  }
  // The file's own header must agree with the index about this piece.
  void check_piece(st::File& f, const IndexEntry& e, const IndexEntry::Piece& p) {
    const st::TensorMeta& m = f.tensor(e.name);
    std::vector<int64_t> want = e.global_shape;
    if (!e.replicated) {
      if (want.empty()) want = {1};
      want[0] = p.row_end - p.row_begin;
    }
    if (m.dtype != e.dtype || m.shape != want) {
      throw Error(cat("checkpoint file '", f.path(), "': tensor '", e.name, "' is ", m.dtype, " ",
                      shape_str(m.shape), ", the index says ", e.dtype, " ", shape_str(want),
                      "; the file does not belong to this index - restore the checkpoint"));
    }
  }

  std::string dir_;
  Index index_;
  std::map<int, std::unique_ptr<st::File>> files_;
};

void check_against_model(const IndexEntry& e, const ShardInfo& info, const std::string& where) {
  std::string dtype = st::dtype_name(info.shard.scalar_type());
  if (e.dtype != dtype) {
    throw Error(cat(where, ": tensor '", e.name, "' is ", e.dtype, " in the checkpoint, ", dtype,
                    " in the model; build the model with the dtype it was saved with"));
  }
  if (e.global_shape != info.global_shape) {
    throw Error(cat(where, ": tensor '", e.name, "' has shape ", shape_str(e.global_shape),
                    " in the checkpoint, ", shape_str(info.global_shape),
                    " in the model; the model configuration differs from the saved one"));
  }
}

// A buffer is stored whole (replicated, rank 0's copy) under its own name, without "::".
bool is_buffer_entry(const IndexEntry& e) {
  return e.replicated && e.name.find("::") == std::string::npos;
}

// Parameters and buffers of the model against the index. An index without any buffer entry (a
// checkpoint from before buffers were saved) does not count its buffers as missing: load() keeps
// the model's and says so.
void check_names(const Index& idx, const std::vector<ShardInfo>& shards,
                 const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                 const std::string& where) {
  std::set<std::string> model;
  std::vector<std::string> missing, extra;
  for (const auto& s : shards) {
    model.insert(s.name);
    if (!idx.find(s.name)) missing.push_back(s.name);
  }
  const bool has_buffers = std::any_of(idx.tensors.begin(), idx.tensors.end(),
                                       [](const auto& e) { return is_buffer_entry(e); });
  for (const auto& [name, b] : buffers) {
    model.insert(name);
    if (has_buffers && !idx.find(name)) missing.push_back(name);
  }
  for (const auto& e : idx.tensors) {
    if (e.name.find("::") == std::string::npos && !model.count(e.name)) extra.push_back(e.name);
  }
  if (!missing.empty()) {
    throw Error(cat(where, ": missing tensors ", join(missing), " (", missing.size(), " of ",
                    shards.size() + buffers.size(),
                    " model parameters and buffers); the checkpoint was saved from a "
                    "different model"));
  }
  if (!extra.empty()) {
    throw Error(cat(where, ": the checkpoint holds tensors the model lacks: ", join(extra),
                    "; the checkpoint was saved from a different model"));
  }
}

template <class State, class Options>
void adam_state_in(torch::optim::Optimizer* opt, const compat::OptimStateKey& key,
                   const at::Tensor& shard, const ShardInfo& info, CheckpointReader& rd,
                   bool amsgrad, const std::string& where) {
  const Index& idx = rd.index();
  const IndexEntry* step = idx.find(info.name + "::step");
  const IndexEntry* m = idx.find(info.name + "::exp_avg");
  const IndexEntry* v = idx.find(info.name + "::exp_avg_sq");
  const IndexEntry* vmax = idx.find(info.name + "::max_exp_avg_sq");
  if (!step && !m && !v) {  // never stepped when saved
    opt->state().erase(key);
    return;
  }
  std::vector<std::string> missing;
  if (!step) missing.push_back(info.name + "::step");
  if (!m) missing.push_back(info.name + "::exp_avg");
  if (!v) missing.push_back(info.name + "::exp_avg_sq");
  if (amsgrad && !vmax) missing.push_back(info.name + "::max_exp_avg_sq");
  if (!missing.empty()) {
    throw Error(cat(where, ": missing optimizer state ", join(missing),
                    amsgrad && !vmax ? " (the optimizer uses amsgrad; was it saved without?)" : "",
                    "; the checkpoint is incomplete or from another optimizer configuration"));
  }
  auto read_like = [&](const IndexEntry& e) {
    FSDP_CHECK(
        e.dtype == st::dtype_name(shard.scalar_type()) && e.global_shape == info.global_shape,
        where, ": optimizer state '", e.name, "' is ", e.dtype, " ", shape_str(e.global_shape),
        ", its parameter is ", st::dtype_name(shard.scalar_type()), " ",
        shape_str(info.global_shape), "; the checkpoint is inconsistent");
    at::Tensor t = at::zeros_like(shard, at::MemoryFormat::Preserve);
    rd.fill_rows(e, t, info.row_offset);
    return t;
  };
  FSDP_CHECK(step->dtype == "I64" && step->global_shape.empty(), where, ": '", step->name, "' is ",
             step->dtype, " ", shape_str(step->global_shape), ", expected I64 []");
  auto s = std::make_unique<State>();
  s->step(rd.read_replicated(*step).item<int64_t>());
  s->exp_avg(read_like(*m));
  s->exp_avg_sq(read_like(*v));
  if (vmax) s->max_exp_avg_sq(read_like(*vmax));
  opt->state()[key] = std::move(s);
}

bool group_amsgrad(const torch::optim::OptimizerParamGroup& g, OptKind kind) {
  if (kind == OptKind::kAdamW)
    return static_cast<const torch::optim::AdamWOptions&>(g.options()).amsgrad();
  if (kind == OptKind::kAdam)
    return static_cast<const torch::optim::AdamOptions&>(g.options()).amsgrad();
  return false;
}

void load_optimizer(torch::optim::Optimizer* opt, OptKind kind,
                    const std::vector<ShardInfo>& shards, CheckpointReader& rd,
                    const std::string& where) {
  const Index& idx = rd.index();
  if (idx.optimizer == "none") return;  // parameters-only checkpoint: the optimizer is untouched
  if (idx.optimizer != kind_name(kind)) {
    throw Error(cat(where, ": the checkpoint holds ", idx.optimizer, " state, the optimizer is ",
                    kind_name(kind),
                    "; build the optimizer the run was saved with, or pass "
                    "nullptr to load parameters only"));
  }
  std::map<compat::OptimStateKey, bool> in_opt;  // state key -> amsgrad of its group
  for (const auto& g : opt->param_groups()) {
    for (const auto& p : g.params()) in_opt[compat::optim_state_key(p)] = group_amsgrad(g, kind);
  }
  for (const auto& info : shards) {
    auto key = compat::optim_state_key(info.shard);
    auto it = in_opt.find(key);
    if (it == in_opt.end()) continue;  // not optimized (e.g. frozen)
    if (kind == OptKind::kSGD) {
      const IndexEntry* e = idx.find(info.name + "::momentum_buffer");
      if (!e) {
        opt->state().erase(key);
        continue;
      }
      FSDP_CHECK(e->global_shape == info.global_shape &&
                     e->dtype == st::dtype_name(info.shard.scalar_type()),
                 where, ": optimizer state '", e->name, "' does not match its parameter");
      at::Tensor buf = at::zeros_like(info.shard, at::MemoryFormat::Preserve);
      rd.fill_rows(*e, buf, info.row_offset);
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(buf);
      opt->state()[key] = std::move(s);
    } else if (kind == OptKind::kAdamW) {
      adam_state_in<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(
          opt, key, info.shard, info, rd, it->second, where);
    } else {
      adam_state_in<torch::optim::AdamParamState, torch::optim::AdamOptions>(
          opt, key, info.shard, info, rd, it->second, where);
    }
  }
}

// Every buffer from its replicated entry (rank 0's values at save time). A checkpoint without any
// buffer entry (saved before buffers were) leaves the model's buffers as they are, with a note.
void load_buffers(CheckpointReader& rd,
                  const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                  const std::string& where, int rank) {
  std::vector<std::string> kept;
  at::NoGradGuard no_grad;
  for (const auto& [name, b] : buffers) {
    const IndexEntry* e = rd.index().find(name);
    if (!e) {
      kept.push_back(name);
      continue;
    }
    std::string dtype = st::dtype_name(b.scalar_type());
    FSDP_CHECK(e->replicated && e->dtype == dtype && e->global_shape == b.sizes().vec(), where,
               ": buffer '", name, "' is ", e->dtype, " ", shape_str(e->global_shape),
               e->replicated ? "" : " (sharded rows)", " in the checkpoint, ", dtype, " ",
               shape_str(b.sizes().vec()),
               " in the model; the model configuration differs from the saved one");
    b.copy_(rd.read_replicated(*e).reshape(b.sizes()));
  }
  if (!kept.empty() && rank == 0)
    std::cerr << cat("fsdp: note: ", where,
                     " holds no buffers (saved before fsdp-cpp stored "
                     "them); the model keeps its current values of ",
                     kept.size(), " buffers: ", join(kept))
              << std::endl;
}

// init_from's buffers: every model buffer from the file when it has any (a consolidated file
// has them), else (a file written without buffers) the model keeps its own, with a note.
void init_buffers(st::File& f, const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                  const std::string& where, int rank) {
  std::vector<std::string> missing;
  for (const auto& [name, b] : buffers)
    if (!f.header().find(name)) missing.push_back(name);
  if (!missing.empty() && missing.size() < buffers.size())
    throw Error(cat(where, ": missing buffers ", join(missing), " (", missing.size(), " of ",
                    buffers.size(), "); the file is from a different model"));
  if (!missing.empty()) {
    if (rank == 0)
      std::cerr << cat("fsdp: note: ", where,
                       " holds no buffers; the model keeps its current "
                       "values of ",
                       missing.size(), " buffers: ", join(missing))
                << std::endl;
    return;
  }
  at::NoGradGuard no_grad;
  for (const auto& [name, b] : buffers) {
    const st::TensorMeta& m = f.tensor(name);
    std::string dtype = st::dtype_name(b.scalar_type());
    FSDP_CHECK(m.dtype == dtype && m.shape == b.sizes().vec(), where, ": buffer '", name, "' is ",
               m.dtype, " ", shape_str(m.shape), " in the file, ", dtype, " ",
               shape_str(b.sizes().vec()), " in the model; the file is from a different model");
    b.copy_(st::read_tensor(f, name).reshape(b.sizes()));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
namespace {
std::string save_shards(const std::string& dir, const FSDPModule& root,
                        torch::optim::Optimizer* opt, const TrainState& state, Communicator& comm);
}  // namespace

std::string save(const std::string& dir, const FSDPModule& root, torch::optim::Optimizer* opt,
                 const TrainState& state, Communicator& comm) {
  const auto& replicas = root.replicate_communicator();
  if (!replicas) return save_shards(dir, root, opt, state, comm);
  // HSDP: every replica holds the same shards; replica 0 writes them, the others wait for its
  // outcome (success, or its error), so that no two ranks write one file.
  FSDP_CHECK(&comm == &root.communicator(),
             "checkpoint save: under HSDP pass the shard "
             "communicator (mesh.shard, the one the model is sharded over), not the world");
  std::string path = dir + "/" + step_dir_name(state.step);
  std::exception_ptr error;
  if (replicas->rank() == 0) {
    try {
      path = save_shards(dir, root, opt, state, comm);
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
  OptKind kind = kind_of(opt);
  FSDP_CHECK(state.step >= 0, "checkpoint save: step ", state.step, " is negative");
  const std::string ckpt = dir + "/" + step_dir_name(state.step);
  const int rank = comm.rank();

  // 1. Rank 0 prepares the directory and withdraws an older index of the same step, so that a
  //    half-rewritten step can never look complete.
  //    Temporaries of killed saves go too: no rank writes before this step's agreement.
  agree(comm, rank != 0 ? std::string() : capture([&] {
          fs::create_directories(ckpt);
          fs::remove(fs::path(ckpt) / kIndexFile);
          remove_stale_temporaries(dir);
        }),
        "save");

  // Buffers are saved from rank 0: say so when the ranks' copies differ (collective).
  check_buffers_agree(root, cat("checkpoint save '", ckpt, "' keeps rank 0's values"));

  // 2. Every rank writes its file.
  std::vector<at::Tensor> keep;
  std::vector<st::TensorView> views;
  std::vector<std::pair<int64_t, int64_t>> rows;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<bool> replicated;
  st::Checksums sums;
  int fail_after = -1;
  if (const char* env = std::getenv(kFailAfterFilesEnv)) fail_after = std::atoi(env);
  std::string error = capture([&] {
    for (const auto& info : root.shards()) {
      std::vector<std::pair<std::string, at::Tensor>> state_rows;
      std::optional<int64_t> step;
      state_of(opt, kind, info.shard, &state_rows, &step);
      auto add_rows = [&](const std::string& name, const at::Tensor& t) {
        at::Tensor c = t.detach().contiguous().cpu();
        int64_t n = c.dim() == 0 ? 1 : c.size(0);
        if (n == 0) return;  // an empty shard contributes no piece
        keep.push_back(c);
        views.push_back(st::view_of(name, c));
        rows.emplace_back(info.row_offset, info.row_offset + n);
        shapes.push_back(info.global_shape);
        replicated.push_back(false);
      };
      add_rows(info.name, info.shard);
      for (const auto& [suffix, t] : state_rows) add_rows(info.name + "::" + suffix, t);
      if (step) {
        keep.push_back(at::scalar_tensor(*step, at::kLong));
        views.push_back(st::view_of(info.name + "::step", keep.back()));
        rows.emplace_back(0, 1);
        shapes.push_back({});
        replicated.push_back(true);
      }
    }
    if (rank == 0) {
      for (const auto& [name, b] : named_buffers(root)) {
        keep.push_back(b.detach().contiguous().cpu());
        views.push_back(st::view_of(name, keep.back()));
        rows.emplace_back(0, 1);
        shapes.push_back(b.sizes().vec());
        replicated.push_back(true);
      }
    }
    if (fail_after < 0 || rank < fail_after) {
      sums = st::write(ckpt + "/" + rank_file_name(rank), views,
                       {{"format", "pt"},
                        {"fsdp_rank", std::to_string(rank)},
                        {"fsdp_world_size", std::to_string(comm.size())}});
    }
  });
  agree(comm, error, "save");
  if (fail_after >= 0) {
    throw Error(cat("checkpoint save '", ckpt, "' interrupted by ", kFailAfterFilesEnv, "=",
                    fail_after, " (test hook) after the rank files, before the index"));
  }

  // 3. Rank 0 writes the index last.
  auto manifests =
      all_gather_strings(comm, local_manifest(views, rows, shapes, replicated, sums).dump());
  error = rank != 0 ? std::string() : capture([&] {
    Index idx = build_index(manifests, kind_name(kind), state, ckpt);
    std::string text = index_to_json(idx);
    parse_index(text, ckpt + "/" + kIndexFile);  // what we write must pass our own validation
    write_text_atomic(ckpt + "/" + kIndexFile, text);
  });
  agree(comm, error, "save");
  return ckpt;
}
}  // namespace

TrainState load(const std::string& ckpt_dir, const FSDPModule& root, torch::optim::Optimizer* opt,
                Communicator& comm) {
  TrainState out;
  std::string error = capture([&] {
    OptKind kind = kind_of(opt);
    CheckpointReader rd(ckpt_dir);
    const std::string where = cat("checkpoint '", ckpt_dir, "'");
    auto shards = root.shards();
    auto buffers = named_buffers(root);
    check_names(rd.index(), shards, buffers, where);
    for (const auto& info : shards) {
      const IndexEntry& e = *rd.index().find(info.name);
      check_against_model(e, info, where);
      rd.fill_rows(e, info.shard, info.row_offset);
    }
    load_buffers(rd, buffers, where, comm.rank());
    if (opt) load_optimizer(opt, kind, shards, rd, where);
    out = rd.index().state;
  });
  agree(comm, error, "load");
  return out;
}

void consolidate(const std::string& ckpt_dir, const std::string& out_file) {
  CheckpointReader rd(ckpt_dir);
  std::vector<at::Tensor> keep;
  std::vector<st::TensorView> views;
  for (const auto& e : rd.index().tensors) {
    if (e.name.find("::") != std::string::npos) continue;  // optimizer state
    if (e.replicated) {                                    // a buffer, whole
      keep.push_back(rd.read_replicated(e).contiguous());
      views.push_back(st::view_of(e.name, keep.back()));
      continue;
    }
    rd.check_pieces(e);
    std::vector<int64_t> rows_shape =
        e.global_shape.empty() ? std::vector<int64_t>{1} : e.global_shape;
    at::Tensor full = at::empty(
        rows_shape, at::TensorOptions().dtype(st::scalar_type(e.dtype, ckpt_dir, e.name)));
    rd.fill_rows(e, full, 0);
    keep.push_back(full.reshape(e.global_shape).contiguous());
    views.push_back(st::view_of(e.name, keep.back()));
  }
  const auto& s = rd.index().state;
  st::write(out_file, views,
            {{"format", "pt"},
             {"fsdp_step", std::to_string(s.step)},
             {"fsdp_data_position", std::to_string(s.data_position)}});
}

void init_from(const std::string& file, const FSDPModule& root) {
  std::string error = capture([&] {
    auto f = st::File::open(file);
    const std::string where = cat("init_from '", file, "'");
    auto shards = root.shards();
    std::vector<std::string> missing;
    for (const auto& info : shards) {
      if (!f->header().find(info.name)) missing.push_back(info.name);
    }
    if (!missing.empty()) {
      throw Error(cat(where, ": missing tensors ", join(missing), " (", missing.size(), " of ",
                      shards.size(), " model parameters); the file is from a different model"));
    }
    for (const auto& info : shards) {
      const st::TensorMeta& m = f->tensor(info.name);
      std::string dtype = st::dtype_name(info.shard.scalar_type());
      if (m.dtype != dtype || m.shape != info.global_shape) {
        throw Error(cat(where, ": tensor '", info.name, "' is ", m.dtype, " ", shape_str(m.shape),
                        " in the file, ", dtype, " ", shape_str(info.global_shape),
                        " in the model; the file is from a different model or dtype"));
      }
      int64_t n = info.shard.dim() == 0 ? 1 : info.shard.size(0);
      at::Tensor src = st::read_rows(*f, info.name, info.row_offset, info.row_offset + n);
      at::NoGradGuard no_grad;
      info.shard.view({-1}).copy_(src.view({-1}));
    }
    init_buffers(*f, named_buffers(root), where, root.communicator().rank());
  });
  agree(root.communicator(), error, "init_from");
}

}  // namespace fsdp::checkpoint
