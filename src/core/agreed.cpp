#include "core/agreed.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>

#include "core/rounds.h"
#include "util/checksum.h"

namespace fsdp::detail {

void AgreedLog::Sequence::record(const Collective& c) {
  // XXH3 over (hash, group, value): order-sensitive.
  const int64_t value = 2 * c.numel + (c.flag ? 1 : 0);
  const uint64_t words[3] = {hash, static_cast<uint64_t>(c.group), static_cast<uint64_t>(value)};
  hash = checksum_bytes(words, sizeof(words));
  ++count;
  if (entries.size() < kMaxRecorded) entries.emplace_back(c.group, value);
}

void AgreedLog::reset() {
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
// Gathers (gather hash, count, reduce hash, count, extra, bits..., riders' words...) from every
// rank of `lane`; the riders examine theirs.
Exchanged exchange_hashes(Communicator& lane, const std::vector<int64_t>& hashes, bool extra,
                          const std::vector<uint64_t>& bits, size_t first = 0,
                          const std::vector<AgreedRider*>& riders = {}) {
  std::vector<int64_t> row = hashes;
  row.push_back(extra ? 1 : 0);
  for (uint64_t w : bits) row.push_back(static_cast<int64_t>(w));
  std::vector<size_t> at;
  for (auto* r : riders) {
    at.push_back(row.size());
    row.resize(row.size() + r->words());
    r->fill(row.data() + at.back());
  }
  Exchanged out;
  out.bits.assign(bits.size(), 0);
  const auto rows = gather_rows(lane, row);
  for (const auto& r : rows) {
    out.differ =
        out.differ || !std::equal(r.begin() + first, r.begin() + 4, hashes.begin() + first);
    out.any_extra = out.any_extra || r[4] != 0;
    for (size_t i = 0; i < bits.size(); ++i) out.bits[i] |= static_cast<uint64_t>(r[5 + i]);
  }
  // Only where the collectives agreed: otherwise the riders' words describe other collectives.
  if (!out.differ)
    for (size_t k = 0; k < riders.size(); ++k) {
      std::vector<const int64_t*> theirs;
      for (const auto& r : rows) theirs.push_back(r.data() + at[k]);
      riders[k]->examine(theirs);
    }
  return out;
}
}  // namespace

std::vector<uint64_t> AgreedLog::check(Communicator& agree, Communicator* replicate,
                                       const Names& names, std::vector<uint64_t> bits) {
  const std::vector<int64_t> mine{static_cast<int64_t>(gathers_.hash), gathers_.count,
                                  static_cast<int64_t>(reduces_.hash), reduces_.count};
  bool row_differs = false, any_row_differs = false, column_differs = false;
  if (agree.size() > 1) {
    auto got = exchange_hashes(agree, mine, false, bits, 0, riders_);
    any_row_differs = row_differs = got.differ;
    bits = std::move(got.bits);
  }
  if (replicate && replicate->size() > 1) {
    // Every rank learns whether any shard group disagreed. When none did, every column compares
    // the same per-row sequences, so all columns agree or all differ: every rank of the mesh
    // takes the same decision below. Across replicas only the reductions must agree: each shard
    // group gathers what its own ranks called. The bits travel on with the shard group's OR, so
    // that they end as the OR over the mesh.
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
  const auto group_names = names();
  Communicator& on = any_row_differs ? agree : *replicate;
  std::string diff =
      any_row_differs ? first_difference(on, "all-gather", gathers_, group_names) : std::string();
  if (diff.empty()) diff = first_difference(on, "reduce-scatter", reduces_, group_names);
  if (diff.empty())
    diff = any_row_differs && !row_differs
               ? std::string("the ranks of another shard group (HSDP replica) disagreed")
               : cat("the ranks' collective sequences differ after the first ", kMaxRecorded,
                     " recorded ones (FSDP_AUDIT=1 records them all)");
  reset();
  throw Error(cat(
      "Agreed: ", diff,
      ". The ranks issued different collectives, so they would exchange other modules' "
      "parameters or gradients. Either their calls of sharded modules differed inside a forward "
      "not declared to allow it (set_calls_may_differ on the module whose forward makes those "
      "calls, or RuntimeOptions::calls_may_differ), or their explicit collectives differed: "
      "unshard() and reshard() of an FSDPModule, state dicts and checkpoints, clip_grad_norm_, "
      "and the top-level forward and backward calls must be the same on every rank. Fix: declare "
      "the module, or make those calls on every rank; if they are, please report this with "
      "FSDP_DEBUG=1's output"));
}

void AgreedLog::check_all_reduce_settings(Communicator& agree, Communicator& replicate,
                                          const std::vector<bool>& all_reduces,
                                          const Names& names) {
  Sequence flags;
  for (size_t k = 0; k < all_reduces.size(); ++k)
    flags.record(Collective{static_cast<int64_t>(k), 0, all_reduces[k]});
  const std::vector<int64_t> mine{static_cast<int64_t>(flags.hash), flags.count, 0, 0};
  const bool row_differs = agree.size() > 1 && exchange_hashes(agree, mine, false, {}).differ;
  const auto across = exchange_hashes(replicate, mine, row_differs, {});
  if (!across.differ && !across.any_extra) return;
  const auto group_names = names();
  std::string off;
  for (size_t k = 0; k < all_reduces.size(); ++k)
    if (!all_reduces[k]) off += cat(off.empty() ? "" : ", ", "'", group_names[k], "'");
  throw Error(
      cat("set_requires_all_reduce differs between ranks: on rank ", agree.rank(), " of replica ",
          replicate.rank(), " it is off for ", off.empty() ? std::string("no module") : off,
          " and on for the rest, and another rank decided otherwise. Every rank of the mesh must "
          "skip or issue the same all-reduces across replicas. Fix: call set_requires_all_reduce "
          "with the same value on every rank (e.g. true on the last micro-batch everywhere)"));
}

std::string AgreedLog::first_difference(Communicator& lane, const char* what, const Sequence& s,
                                        const std::vector<std::string>& names) {
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
    return gi >= 0 && gi < static_cast<int64_t>(names.size()) ? "'" + names[gi] + "'" : "<none>";
  };
  auto entry = [&](int64_t gi, int64_t value) -> std::string {
    if (value < 0) return "nothing";  // the rank issued fewer
    return cat("group ", name_of(gi), " (", value / 2, " elements",
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
    return cat(what, " #", pos, " was ", entry(a[2 * pos], a[2 * pos + 1]), " on rank 0 but ",
               entry(b[2 * pos], b[2 * pos + 1]), " on rank ", r, " (rank 0 issued ",
               lens[0].item<int64_t>(), ", rank ", r, " issued ", lens[r].item<int64_t>(), ")");
  }
  return "";
}

}  // namespace fsdp::detail
