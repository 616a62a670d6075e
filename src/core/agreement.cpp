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
// What one exchange of the hashes learns: whether the hashes (from column `first` on) differ
// anywhere, whether any rank's `extra` is set, and the OR over the ranks of the bit words.
struct Exchanged {
  bool differ = false, any_extra = false;
  std::vector<uint64_t> bits;
};
// Gathers (gather hash, count, reduce hash, count, extra, bits...) from every rank of `lane`.
Exchanged exchange_hashes(Communicator& lane, const at::Tensor& mine, bool extra,
                          const std::vector<uint64_t>& bits, int64_t first = 0) {
  const int world = lane.size();
  const int64_t width = 5 + static_cast<int64_t>(bits.size());
  std::vector<int64_t> tail{extra ? 1 : 0};
  for (uint64_t w : bits) tail.push_back(static_cast<int64_t>(w));
  auto row = at::cat({mine, at::tensor(tail, at::kLong)});
  auto all = at::empty({world * width}, at::kLong);
  lane.all_gather(all, row).wait();
  auto rows = all.view({world, width});
  Exchanged out;
  out.differ = !rows.narrow(1, first, 4 - first)
                    .eq(mine.narrow(0, first, 4 - first).unsqueeze(0))
                    .all()
                    .item<bool>();
  out.any_extra = rows.select(1, 4).gt(0).any().item<bool>();
  out.bits.assign(bits.size(), 0);
  const int64_t* v = all.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < bits.size(); ++i)
      out.bits[i] |= static_cast<uint64_t>(v[r * width + 5 + static_cast<int64_t>(i)]);
  return out;
}
}  // namespace

std::vector<uint64_t> Agreement::check(Communicator& lane, Communicator* replicate,
                                       const std::vector<Group*>& groups,
                                       std::vector<uint64_t> bits) {
  auto mine = at::tensor({static_cast<int64_t>(gathers_.hash), gathers_.count,
                          static_cast<int64_t>(reduces_.hash), reduces_.count},
                         at::kLong);
  bool row_differs = false, any_row_differs = false, column_differs = false;
  if (lane.size() > 1) {
    auto got = exchange_hashes(lane, mine, false, bits);
    any_row_differs = row_differs = got.differ;
    bits = std::move(got.bits);
  }
  if (replicate && replicate->size() > 1) {
    // Every rank learns whether any shard group disagreed. When none did, every column compares
    // the same per-row sequences, so all columns agree or all differ: every rank of the mesh
    // takes the same decision below. Across replicas only the reductions must agree: each shard
    // group gathers what its own ranks called ([Note: calls that differ between ranks]). The bits
    // travel on with the shard group's OR, so that they end as the OR over the mesh.
    auto got = exchange_hashes(*replicate, mine, row_differs, bits, /*first=*/2);
    column_differs = got.differ;
    any_row_differs = got.any_extra;
    bits = std::move(got.bits);
  }
  if (!any_row_differs && !column_differs) {
    reset();
    return bits;
  }
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
  const bool row_differs = lane.size() > 1 && exchange_hashes(lane, mine, false, {}).differ;
  const auto across = exchange_hashes(replicate, mine, row_differs, {});
  if (!across.differ && !across.any_extra) return;
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
