// Sharded checkpoints, the reading side: load() at any world size, consolidate() into one file,
// and init_from() a full file. Format and schema: docs/checkpoint.md.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <fsdp/checkpoint.h>
#include <fsdp/safetensors_torch.h>
#include <fsdp/state_dict.h>

#include <algorithm>
#include <set>

#include "checkpoint/checkpoint_common.h"
#include "checkpoint/optim_state.h"
#include "checkpoint/reader.h"
#include "core/explicit_collective.h"

namespace fsdp::checkpoint {

namespace st = fsdp::safetensors;
using detail::cat;
using namespace internal;

namespace {

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
    TORCH_WARN(cat("fsdp: note: ", where,
                   " holds no buffers (saved before fsdp-cpp stored them); the model keeps its "
                   "current values of ",
                   kept.size(), " buffers: ", join(kept)));
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
      TORCH_WARN(cat("fsdp: note: ", where,
                     " holds no buffers; the model keeps its current values of ", missing.size(),
                     " buffers: ", join(missing)));
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

TrainState load(const std::string& ckpt_dir, const FSDPModule& root, torch::optim::Optimizer* opt,
                Communicator& comm) {
  fsdp::detail::agree_explicit_collective(root, fsdp::detail::protocol::Explicit::kCheckpointLoad);
  TrainState out;
  std::string error = detail::error_of([&] {
    OptKind kind = kind_of(opt);
    CheckpointReader rd(ckpt_dir);
    const std::string where = cat("checkpoint '", ckpt_dir, "'");
    auto shards = root.shards();
    auto buffers = named_buffers(root);
    check_names(rd.index(), shards, buffers, where);
    for (const auto& info : shards) {
      const IndexEntry& e = *rd.index().find(info.name);
      check_against_model(e, info, where);
      rd.fill(e, info.shard, info.dim, info.row_offset);
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
    rd.fill(e, full, 0, 0);
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
  std::string error = detail::error_of([&] {
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
      const int64_t n = info.shard.dim() == 0 ? 1 : info.shard.size(info.dim);
      // Dim 0: only this rank's rows are read; another dim reads the whole tensor.
      at::Tensor src =
          info.dim == 0
              ? st::read_rows(*f, info.name, info.row_offset, info.row_offset + n)
              : st::read_tensor(*f, info.name).narrow(info.dim, info.row_offset, n).contiguous();
      at::NoGradGuard no_grad;
      info.shard.view({-1}).copy_(src.reshape({-1}));
    }
    init_buffers(*f, named_buffers(root), where, root.communicator().rank());
  });
  agree(root.communicator(), error, "init_from");
}

}  // namespace fsdp::checkpoint
