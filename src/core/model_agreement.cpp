#include "core/model_agreement.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include "comm/rank_agreement.h"
#include "core/deferred_init.h"
#include "util/checksum.h"

namespace fsdp::detail {

namespace {
std::string describe(const at::Tensor& t, int64_t dim, std::optional<at::ScalarType> compute) {
  return detail::cat(t.sizes(), " ", t.scalar_type(), t.requires_grad() ? "" : " (frozen)",
                     " sharded on dim ", dim,
                     compute ? detail::cat(", computing in ", *compute) : std::string());
}

}  // namespace

void check_same_model(Communicator& comm, const std::string& module, const NamedTensors& params,
                      const std::vector<int64_t>& dims,
                      const std::vector<std::optional<at::ScalarType>>& compute) {
  if (comm.size() == 1) return;
  std::vector<int64_t> hashes;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string text =
        params[i].first + "|" + describe(params[i].second, dims[i], compute[i]);
    hashes.push_back(static_cast<int64_t>(checksum_bytes(text.data(), text.size()) >> 1));
  }
  const auto per_rank = all_gather_values(comm, hashes);
  const auto diff = first_difference_from_rank0(per_rank);
  if (!diff) return;
  const size_t first = diff->index;
  std::string counts;
  for (size_t r = 0; r < per_rank.size(); ++r)
    counts += detail::cat(r ? ", " : "", per_rank[r].size());
  std::string mine_desc =
      first < params.size()
          ? detail::cat("'", params[first].first, "' ",
                        describe(params[first].second, dims[first], compute[first]))
          : "no such parameter";
  throw Error(detail::cat(
      "fully_shard(", module, "): the model differs across ranks at parameter #", first,
      " (first seen on rank ", diff->rank, "); on this rank (", comm.rank(), ") it is ", mine_desc,
      "; parameter counts per rank: ", counts,
      ". Every rank must construct the same model (same config, same parameter shapes) and give "
      "it the same shard_placement_fn and param_dtype_override_fn before fully_shard."));
}

void agree_on_values(Communicator& comm, const std::string& module, const NamedTensors& params,
                     bool sync) {
  if (comm.size() == 1 || params.empty()) return;
  // Built under deferred_init: no values yet (materialize compares them across ranks).
  for (const auto& [name, t] : params)
    if (deferred::is_pending(t)) return;
  if (sync) {
    at::NoGradGuard no_grad;
    for (const auto& [name, t] : params) {
      at::Tensor wire = t.detach().contiguous();
      comm.broadcast(wire, 0).wait();
      if (!wire.is_same(t)) t.detach().copy_(wire);
    }
    return;
  }
  std::vector<at::Tensor> values;
  for (const auto& [name, t] : params) values.push_back(t);
  if (auto diff = first_value_difference(comm, values))
    throw Error(detail::cat(
        "fully_shard(", module, "): parameter '", params[diff->index].first,
        "' has different initial values on rank ", diff->rank, " than on rank 0 (this is rank ",
        comm.rank(),
        "). Every rank must start from the same weights: seed the random generator "
        "identically on every rank before building the model (torch::manual_seed), or set "
        "RuntimeOptions::sync_module_states = true to broadcast rank 0's values"));
}

}  // namespace fsdp::detail
