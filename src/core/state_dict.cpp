// Whole-model state: full tensors gathered from the shards, loaded back into them, and the
// cross-rank agreement of buffers. See include/fsdp/state_dict.h.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/state_dict.h>
#include <torch/nn/module.h>

#include <map>
#include <set>

#include "core/binding.h"
#include "core/buffers.h"
#include "core/explicit_collective.h"
#include "core/group.h"

namespace fsdp {

namespace {

torch::nn::Module& module_of(const FSDPModule& root) {
  FSDP_CHECK(root.defined(), "this FSDPModule handle is empty: use the one fully_shard returned");
  return *detail::HandleAccess::binding(root)->group->module();
}

std::string shape_str(at::IntArrayRef s) { return detail::cat(s); }

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + ("'" + n + "'");
  return out;
}

// The full tensor of one parameter, from every rank's rows (slices of dim s.dim): each padded to
// rows_per_rank on the wire, then joined on the dim and cut to the global shape.
at::Tensor gather_full(const ShardInfo& s, Communicator& comm) {
  std::vector<int64_t> shape = s.global_shape;
  if (shape.empty()) shape = {1};  // a 0-d parameter: one row
  const int64_t rows = shape[s.dim];
  shape[s.dim] = s.rows_per_rank;
  at::Tensor mine = at::zeros(shape, s.shard.options().requires_grad(false));
  const int64_t held = s.shard.dim() == 0 ? 1 : s.shard.size(s.dim);
  if (s.shard.numel() > 0)
    mine.narrow(s.dim, 0, held)
        .copy_(s.shard.detach().reshape(mine.narrow(s.dim, 0, held).sizes()));
  shape.insert(shape.begin(), comm.size());
  at::Tensor all = at::empty(shape, mine.options());  // (world, rows_per_rank-sliced shape)
  comm.all_gather(all, mine).wait();
  return at::cat(all.unbind(0), s.dim)
      .narrow(s.dim, 0, rows)
      .reshape(s.global_shape)
      .to(at::kCPU, false, /*copy=*/true);
}

}  // namespace

StateDict full_state_dict(const FSDPModule& root, const StateDictOptions& options) {
  torch::nn::Module& module = module_of(root);
  detail::agree_explicit_collective(root, detail::protocol::Explicit::kFullStateDict);
  Communicator& comm = root.communicator();
  const bool keep = !options.rank0_only || comm.rank() == 0;
  at::NoGradGuard no_grad;
  StateDict out;
  for (const auto& s : root.shards()) {
    // collective (every rank, same order); an ignored parameter is this rank's own
    at::Tensor full =
        s.ignored ? s.shard.detach().to(at::kCPU, false, /*copy=*/true) : gather_full(s, comm);
    if (keep) out.insert(s.name, full);
  }
  if (keep)
    for (const auto& [name, b] : detail::defined_buffers(module))
      if (!out.contains(name)) out.insert(name, b.detach().to(at::kCPU, false, /*copy=*/true));
  return out;
}

void load_full_state_dict(const FSDPModule& root, const StateDict& dict) {
  torch::nn::Module& module = module_of(root);
  detail::agree_explicit_collective(root, detail::protocol::Explicit::kLoadFullStateDict);
  const auto shards = root.shards();
  const auto buffers = detail::defined_buffers(module);
  std::vector<std::string> missing, mismatched, unexpected;
  std::set<std::string> expected;
  auto check = [&](const std::string& name, at::IntArrayRef shape) {
    expected.insert(name);
    const at::Tensor* v = dict.find(name);
    if (!v) {
      missing.push_back(name);
    } else if (v->sizes() != shape) {
      mismatched.push_back(detail::cat("'", name, "' is ", shape_str(v->sizes()),
                                       " in the dictionary, ", shape_str(shape), " in the model"));
    }
  };
  for (const auto& s : shards) check(s.name, s.global_shape);
  for (const auto& [name, b] : buffers) check(name, b.sizes());
  for (const auto& item : dict)
    if (!expected.count(item.key())) unexpected.push_back(item.key());
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty()) {
    std::string msg = "load_full_state_dict: the dictionary does not match the model.";
    if (!missing.empty())
      msg += detail::cat(" Missing (", missing.size(), "): ", join(missing), ".");
    if (!unexpected.empty())
      msg += detail::cat(" Unexpected (", unexpected.size(), "): ", join(unexpected), ".");
    if (!mismatched.empty()) {
      msg += detail::cat(" Shape mismatch (", mismatched.size(), "): ");
      for (size_t i = 0; i < mismatched.size(); ++i) msg += (i ? "; " : "") + mismatched[i];
      msg += ".";
    }
    throw Error(msg +
                " Fix: pass the full_state_dict of the same model (names of the unsharded "
                "model's named_parameters() and named_buffers()).");
  }
  at::NoGradGuard no_grad;
  for (const auto& s : shards) {
    const at::Tensor& full = dict[s.name];
    if (s.shard.numel() == 0) continue;
    const at::Tensor rows = full.dim() == 0 ? full.reshape({1}) : full;
    const int64_t held = s.shard.dim() == 0 ? 1 : s.shard.size(s.dim);
    s.shard.copy_(rows.narrow(s.dim, s.row_offset, held).reshape(s.shard.sizes()));
  }
  for (const auto& [name, b] : buffers) b.copy_(dict[name]);
}

std::vector<std::pair<std::string, at::Tensor>> named_buffers(const FSDPModule& root) {
  return detail::defined_buffers(module_of(root));
}

std::optional<std::string> check_buffers_agree(const FSDPModule& root, const std::string& what) {
  torch::nn::Module& module = module_of(root);
  if (detail::HandleAccess::binding(root)->group->options().runtime.broadcast_buffers)
    return std::nullopt;
  Communicator& comm = root.communicator();
  auto diff = detail::first_differing_buffer(module, comm);
  if (!diff) return std::nullopt;
  if (comm.rank() == 0)
    TORCH_WARN(detail::cat(
        "fsdp: warning: buffer '", diff->name, "' differs between rank ", diff->rank,
        " and rank 0 (", what,
        "). Buffers such as BatchNorm running statistics are updated from each rank's own batches "
        "and drift apart. Fix: set ShardOptions::broadcast_buffers = true on the root (rank 0's "
        "buffers are broadcast at each forward, as DDP does)"));
  return diff->name;
}

}  // namespace fsdp
