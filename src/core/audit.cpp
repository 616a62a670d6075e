#include "core/audit.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include "core/backward_pass.h"
#include "core/group.h"

namespace fsdp::detail {

void Audit::on_gather(int group, int64_t numel) {
  if (enabled) gathers_.emplace_back(group, numel);
}

void Audit::on_reduce(int group, int64_t numel) {
  if (enabled) reduces_.emplace_back(group, numel);
}

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

void Audit::check_reductions(const BackwardPass& pass, const std::vector<Group*>& groups) {
  auto fail = [&](std::string v) { violations_.push_back(std::move(v)); };
  for (Group* g : groups) {
    const int n = pass.reductions_of(*g);
    const bool must = g->has_trainable() && g->requires_gradient_sync();
    if (must && n != 1)
      fail(detail::cat(n == 0 ? "Complete" : "Once", ": group '", g->name(), "' was reduced ", n,
                       " times in this backward; expected exactly once"));
    if (!must) continue;
    for (const auto& p : g->params()) {
      if (!p.trainable()) continue;
      if (p.holds_unsharded_grad())
        fail(detail::cat("Final: parameter '", g->prefix(), p.name(), "' of group '", g->name(),
                         "' holds an unsharded gradient after its group was reduced (event: a "
                         "late AccumulateGrad)"));
      if (!p.shard().grad().defined())
        fail(detail::cat("Complete: parameter '", g->prefix(), p.name(), "' of group '", g->name(),
                         "' has no shard gradient when backward returns"));
    }
  }
  if (pass.reductions_in_flight() > 0)
    fail(detail::cat("Complete: ", pass.reductions_in_flight(),
                     " reduce-scatters were still in flight when backward returned"));
}

// Agreed: this rank's sequence equals rank 0's. Two exchanges: the lengths, then the sequences
// padded to the longest.
void Audit::check_agreed(const char* what, const Log& log, const std::vector<Group*>& groups) {
  if (!lane || lane->size() == 1) return;
  const int world = lane->size();
  auto len = at::full({1}, static_cast<int64_t>(log.size()), at::kLong);
  auto lens = at::empty({world}, at::kLong);
  lane->all_gather(lens, len).wait();
  const int64_t slots = 2 * std::max<int64_t>(1, lens.max().item<int64_t>());
  auto mine = at::full({slots}, -1, at::kLong);
  auto m = mine.accessor<int64_t, 1>();
  for (size_t i = 0; i < log.size(); ++i) {
    m[2 * i] = log[i].first;
    m[2 * i + 1] = log[i].second;
  }
  auto all = at::empty({world * slots}, at::kLong);
  lane->all_gather(all, mine).wait();
  auto rows = all.view({world, slots});
  auto name_of = [&](int64_t gi) -> std::string {
    return gi >= 0 && gi < static_cast<int64_t>(groups.size()) ? "'" + groups[gi]->name() + "'"
                                                               : "<none>";
  };
  for (int r = 1; r < world; ++r) {
    at::Tensor row0 = rows[0], rowr = rows[r];
    auto a = row0.accessor<int64_t, 1>();
    auto b = rowr.accessor<int64_t, 1>();
    int64_t k = 0;
    while (k < slots && a[k] == b[k]) ++k;
    if (k == slots) continue;
    const int64_t pos = k / 2;
    violations_.push_back(detail::cat(
        "Agreed: ", what, " #", pos, " was group ", name_of(a[2 * pos]), " (", a[2 * pos + 1],
        " elements) on rank 0 but group ", name_of(b[2 * pos]), " (", b[2 * pos + 1],
        " elements) on rank ", r, " (rank 0 issued ", lens[0].item<int64_t>(), ", rank ", r,
        " issued ", lens[r].item<int64_t>(), ")"));
    return;
  }
}

void Audit::check(const BackwardPass& pass, const std::vector<Group*>& groups) {
  ++checked_;
  if (pass.reducing()) check_reductions(pass, groups);
  check_agreed("all-gather", gathers_, groups);
  check_agreed("reduce-scatter", reduces_, groups);
  gathers_.clear();
  reduces_.clear();
  if (violations_.empty()) return;
  std::string msg =
      detail::cat("audit failed on rank ", lane ? lane->rank() : 0, ": ", violations_.front());
  if (violations_.size() > 1) msg += detail::cat(" (and ", violations_.size() - 1, " more)");
  violations_.clear();
  throw AuditError(msg);
}

}  // namespace fsdp::detail
