#include "core/agreement.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>
#include <tuple>

#include "core/group.h"

namespace fsdp::detail {

void Agreement::Sequence::record(int group, int64_t numel, bool flag) {
  // splitmix64 over (hash, group, numel): order-sensitive, cheap.
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  const int64_t value = 2 * numel + (flag ? 1 : 0);
  hash = mix(hash ^
             mix(static_cast<uint64_t>(group) * 0x100000001b3ULL ^ static_cast<uint64_t>(value)));
  ++count;
  if (entries.size() < kMaxRecorded) entries.emplace_back(group, value);
}

void Agreement::reset() {
  gathers_ = Sequence();
  reduces_ = Sequence();
}

namespace {
// Gathers (gather hash, count, reduce hash, count, extra) from every rank of `lane`; returns
// whether the four (from column `first` on) differ anywhere and whether any rank's `extra` is set.
std::pair<bool, bool> exchange_hashes(Communicator& lane, const at::Tensor& mine, bool extra,
                                      int64_t first = 0) {
  const int world = lane.size();
  auto row = at::cat({mine, at::full({1}, extra ? 1 : 0, at::kLong)});
  auto all = at::empty({world * 5}, at::kLong);
  lane.all_gather(all, row).wait();
  auto rows = all.view({world, 5});
  const bool differ = !rows.narrow(1, first, 4 - first)
                           .eq(mine.narrow(0, first, 4 - first).unsqueeze(0))
                           .all()
                           .item<bool>();
  const bool any_extra = rows.select(1, 4).gt(0).any().item<bool>();
  return {differ, any_extra};
}
}  // namespace

void Agreement::check(Communicator& lane, Communicator* replicate,
                      const std::vector<Group*>& groups) {
  auto mine = at::tensor({static_cast<int64_t>(gathers_.hash), gathers_.count,
                          static_cast<int64_t>(reduces_.hash), reduces_.count},
                         at::kLong);
  bool row_differs = false, any_row_differs = false, column_differs = false;
  if (lane.size() > 1) any_row_differs = row_differs = exchange_hashes(lane, mine, false).first;
  if (replicate && replicate->size() > 1) {
    // Every rank learns whether any shard group disagreed. When none did, every column compares
    // the same per-row sequences, so all columns agree or all differ: every rank of the mesh
    // takes the same decision below. Across replicas only the reductions must agree: each shard
    // group gathers what its own ranks called ([Note: calls that differ between ranks]).
    std::tie(column_differs, any_row_differs) =
        exchange_hashes(*replicate, mine, row_differs, /*first=*/2);
  }
  if (!any_row_differs && !column_differs) return reset();
  // Naming the first difference exchanges the recorded sequences on the lane that differed (on
  // the shard lane whenever any row differed: rows that agree find nothing).
  Communicator& on = any_row_differs ? lane : *replicate;
  std::string diff =
      any_row_differs ? first_difference(on, "all-gather", gathers_, groups) : std::string();
  if (diff.empty()) diff = first_difference(on, "reduce-scatter", reduces_, groups);
  if (diff.empty())
    diff = any_row_differs && !row_differs
               ? std::string("the ranks of another shard group (HSDP replica) disagreed")
               : detail::cat("the ranks' collective sequences differ after the first ",
                             kMaxRecorded, " recorded ones (FSDP_AUDIT=1 records them all)");
  reset();
  throw Error(detail::cat(
      "Agreed: ", diff,
      ". The ranks issued different collectives, so they would exchange other modules' "
      "parameters or gradients. The ranks' calls of sharded modules may differ, but not their "
      "explicit collectives: unshard() and reshard() of an FSDPModule, state dicts and "
      "checkpoints, clip_grad_norm_, and the top-level forward and backward calls must be the "
      "same on every rank. Fix: make those calls on every rank; if they are, please report this "
      "with FSDP_DEBUG=1's output"));
}

void Agreement::check_all_reduce_settings(Communicator& lane, Communicator& replicate,
                                          const std::vector<Group*>& groups) {
  Sequence flags;
  std::string off;
  for (size_t k = 0; k < groups.size(); ++k) {
    const bool all_reduces = groups[k]->all_reduces();
    flags.record(static_cast<int>(k), 0, all_reduces);
    if (!all_reduces) off += detail::cat(off.empty() ? "" : ", ", "'", groups[k]->name(), "'");
  }
  auto mine = at::tensor({static_cast<int64_t>(flags.hash), flags.count, int64_t{0}, int64_t{0}},
                         at::kLong);
  const bool row_differs = lane.size() > 1 && exchange_hashes(lane, mine, false).first;
  const auto [column_differs, any_row_differs] = exchange_hashes(replicate, mine, row_differs);
  if (!column_differs && !any_row_differs) return;
  throw Error(detail::cat(
      "set_requires_all_reduce differs between ranks: on rank ", lane.rank(), " of replica ",
      replicate.rank(), " it is off for ", off.empty() ? std::string("no module") : off,
      " and on for the rest, and another rank decided otherwise. Every rank of the mesh must "
      "skip or issue the same all-reduces across replicas. Fix: call set_requires_all_reduce "
      "with the same value on every rank (e.g. true on the last micro-batch everywhere)"));
}

std::string Agreement::first_difference(Communicator& lane, const char* what, const Sequence& s,
                                        const std::vector<Group*>& groups) {
  const int world = lane.size();
  auto len = at::full({1}, static_cast<int64_t>(s.entries.size()), at::kLong);
  auto lens = at::empty({world}, at::kLong);
  lane.all_gather(lens, len).wait();
  const int64_t slots = 2 * std::max<int64_t>(1, lens.max().item<int64_t>());
  auto mine = at::full({slots}, -1, at::kLong);
  auto m = mine.accessor<int64_t, 1>();
  for (size_t i = 0; i < s.entries.size(); ++i) {
    m[2 * i] = s.entries[i].first;
    m[2 * i + 1] = s.entries[i].second;
  }
  auto all = at::empty({world * slots}, at::kLong);
  lane.all_gather(all, mine).wait();
  auto rows = all.view({world, slots});
  auto name_of = [&](int64_t gi) -> std::string {
    return gi >= 0 && gi < static_cast<int64_t>(groups.size()) ? "'" + groups[gi]->name() + "'"
                                                               : "<none>";
  };
  auto entry = [&](int64_t gi, int64_t value) -> std::string {
    if (value < 0) return "nothing";  // the rank issued fewer
    return detail::cat("group ", name_of(gi), " (", value / 2, " elements",
                       value % 2 == 1 ? ", without the all-reduce across replicas" : "", ")");
  };
  const at::Tensor row0 = rows[0];
  auto a = row0.accessor<int64_t, 1>();
  for (int r = 1; r < world; ++r) {
    const at::Tensor rowr = rows[r];
    auto b = rowr.accessor<int64_t, 1>();
    int64_t k = 0;
    while (k < slots && a[k] == b[k]) ++k;
    if (k == slots) continue;
    const int64_t pos = k / 2;
    return detail::cat(what, " #", pos, " was ", entry(a[2 * pos], a[2 * pos + 1]),
                       " on rank 0 but ", entry(b[2 * pos], b[2 * pos + 1]), " on rank ", r,
                       " (rank 0 issued ", lens[0].item<int64_t>(), ", rank ", r, " issued ",
                       lens[r].item<int64_t>(), ")");
  }
  return "";
}

}  // namespace fsdp::detail
