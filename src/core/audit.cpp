#include "core/audit.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

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

void Audit::check(const TaskState& t, const std::vector<Group*>& groups) {
  ++checked_;
  auto fail = [&](std::string v) { violations_.push_back(std::move(v)); };
  if (t.reducing) {
    for (Group* g : groups) {
      auto it = t.issued.find(g);
      const int n = it == t.issued.end() ? 0 : it->second;
      const bool must = g->has_trainable() && g->requires_gradient_sync;
      if (must && n != 1)
        fail(detail::cat(n == 0 ? "Complete" : "Once", ": group '", g->name(), "' was reduced ", n,
                         " times in this backward; expected exactly once"));
      if (!must) continue;
      for (const auto& p : g->params()) {
        if (!p.trainable()) continue;
        if (p.param().grad().defined())
          fail(detail::cat("Final: parameter '", g->prefix(), p.name(), "' of group '", g->name(),
                           "' holds an unsharded gradient after its group was reduced (event: a "
                           "late AccumulateGrad)"));
        if (!p.shard().grad().defined())
          fail(detail::cat("Complete: parameter '", g->prefix(), p.name(), "' of group '",
                           g->name(), "' has no shard gradient when backward returns"));
      }
    }
    if (!t.in_flight.empty())
      fail(detail::cat("Complete: ", t.in_flight.size(),
                       " reduce-scatters were still in flight when backward returned"));
    // Agreed: the issue sequence of every rank equals rank 0's.
    if (lane && lane->size() > 1) {
      const int64_t slots = static_cast<int64_t>(groups.size()) * 2 + 1;
      auto mine = at::full({slots}, -1, at::kLong);
      auto acc = mine.accessor<int64_t, 1>();
      acc[0] = static_cast<int64_t>(t.issue_log.size());
      for (size_t i = 0; i < t.issue_log.size() && 2 * i + 2 < static_cast<size_t>(slots); ++i) {
        acc[2 * i + 1] = t.issue_log[i].first;
        acc[2 * i + 2] = t.issue_log[i].second;
      }
      auto all = at::empty({lane->size() * slots}, at::kLong);
      lane->all_gather(all, mine).wait();
      auto rows = all.view({lane->size(), slots});
      for (int r = 1; r < lane->size(); ++r) {
        if (at::equal(rows[r], rows[0])) continue;
        at::Tensor row0 = rows[0], rowr = rows[r];
        auto a = row0.accessor<int64_t, 1>();
        auto b = rowr.accessor<int64_t, 1>();
        int64_t k = 1;
        while (k < slots && a[k] == b[k]) ++k;
        const int64_t pos = (k - 1) / 2;
        auto name_of = [&](int64_t gi) -> std::string {
          return gi >= 0 && gi < static_cast<int64_t>(groups.size()) ? groups[gi]->name()
                                                                     : "<none>";
        };
        fail(detail::cat("Agreed: reduce-scatter #", pos, " was group '", name_of(a[1 + 2 * pos]),
                         "' (", a[2 + 2 * pos], " elements) on rank 0 but group '",
                         name_of(b[1 + 2 * pos]), "' (", b[2 + 2 * pos], " elements) on rank ", r,
                         " (rank 0 issued ", a[0], " reductions, rank ", r, " issued ", b[0], ")"));
        break;
      }
    }
  }
  if (violations_.empty()) return;
  std::string msg =
      detail::cat("audit failed on rank ", lane ? lane->rank() : 0, ": ", violations_.front());
  if (violations_.size() > 1) msg += detail::cat(" (and ", violations_.size() - 1, " more)");
  violations_.clear();
  throw AuditError(msg);
}

}  // namespace fsdp::detail
