#include "core/audit.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include "core/backward.h"
#include "core/group.h"

namespace fsdp::detail {

void Audit::late_gradient(const Group& g, size_t i) {
  violations_.push_back(detail::cat(
      "Final: the gradient of parameter '", g.prefix(), g.params()[i].name(), "' in group '",
      g.name(),
      "' arrived (AccumulateGrad post hook) after the group's reduce-scatter was issued"));
}

void Audit::issued_twice(const Group& g) {
  violations_.push_back(detail::cat("Once: group '", g.name(),
                                    "' was about to be reduced a second time in one backward"));
}

void Audit::check_reductions(const Backward& pass, const std::vector<Group*>& groups,
                             const std::vector<uint64_t>& any_rank) {
  auto fail = [&](std::string v) { violations_.push_back(std::move(v)); };
  size_t bit = 0;  // the parameter's place in any_rank
  for (Group* g : groups) {
    const size_t first_bit = bit;
    bit += g->params().size();
    const int n = pass.reductions_of(*g);
    const bool must = pass.reduces(*g);
    if (n != (must ? 1 : 0))
      fail(detail::cat(n == 0 ? "Complete" : "Once", ": group '", g->name(), "' was reduced ", n,
                       " times in this backward; expected ", must ? "exactly once" : "none"));
    if (!must) continue;
    for (size_t i = 0; i < g->params().size(); ++i) {
      const auto& p = g->params()[i];
      if (!p.trainable()) continue;
      if (p.holds_unsharded_grad() || p.holds_accumulated_grad())
        fail(detail::cat("Final: parameter '", g->prefix(), p.name(), "' of group '", g->name(),
                         "' holds an unsharded gradient after its group was reduced (event: a "
                         "late AccumulateGrad)"));
      // Set aside for the next all-reduce across replicas (set_requires_all_reduce(false)): the
      // shards' gradients change only then. A parameter no rank contributed to keeps what it had.
      const size_t b = first_bit + i;
      const bool contributed = b / 64 < any_rank.size() && ((any_rank[b / 64] >> (b % 64)) & 1);
      if (contributed && !p.shard().grad().defined() && !g->holds_partial_reduce())
        fail(detail::cat("Complete: parameter '", g->prefix(), p.name(), "' of group '", g->name(),
                         "' has no shard gradient when backward returns"));
    }
  }
  if (pass.reductions_in_flight() > 0)
    fail(detail::cat("Complete: ", pass.reductions_in_flight(),
                     " reduce-scatters were still in flight when backward returned"));
}

void Audit::check(const Backward& pass, const std::vector<Group*>& groups,
                  const std::vector<uint64_t>& any_rank, int rank) {
  if (pass.plain()) check_reductions(pass, groups, any_rank);
  if (violations_.empty()) return;
  std::string msg = detail::cat("audit failed on rank ", rank, ": ", violations_.front());
  if (violations_.size() > 1) msg += detail::cat(" (and ", violations_.size() - 1, " more)");
  violations_.clear();
  throw AuditError(msg);
}

}  // namespace fsdp::detail
