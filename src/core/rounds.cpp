#include "core/rounds.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

namespace fsdp::detail {

using protocol::Message;

std::vector<std::vector<int64_t>> gather_rows(Communicator& c, const std::vector<int64_t>& row) {
  const auto len = static_cast<int64_t>(row.size());
  auto recv = at::empty({c.size() * len}, at::kLong);
  c.all_gather(recv, at::tensor(row, at::kLong)).wait();
  const int64_t* v = recv.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows;
  for (int r = 0; r < c.size(); ++r) rows.emplace_back(v + r * len, v + (r + 1) * len);
  return rows;
}

bool Rounds::active() const { return ctx_.gather.size() > 1; }

bool Rounds::has_replicas() const {
  return ctx_.replicate_agree && ctx_.replicate_agree->size() > 1;
}

int64_t Rounds::mesh_rank() const {
  const auto& peers = ctx_.gather.comm().peers();
  const int r = ctx_.gather.rank();
  return static_cast<size_t>(r) < peers.size() ? peers[r].rank : r;
}

std::vector<Message> Rounds::gather(const Message& mine, size_t groups) {
  if (!active()) return {mine};
  const auto rows = gather_rows(ctx_.gather.comm(), protocol::serialize(mine, groups));
  std::vector<Message> all;
  for (const auto& r : rows) all.push_back(protocol::deserialize(r.data(), groups));
  log(all, groups);
  return all;
}

void Rounds::log(const std::vector<Message>& all, size_t groups) const {
  if (!ctx_.debug) return;
  std::string line = "round:";
  for (const Message& m : all) {
    line += cat(" [rank ", m.rank, " kind ", static_cast<int64_t>(m.kind), " who ", m.who, " need");
    for (size_t k = 0; k < groups; ++k)
      if (protocol::test_bit(m.need, k)) line += cat(" ", k);
    line += " prefetch";
    for (size_t k = 0; k < groups; ++k)
      if (protocol::test_bit(m.prefetch, k)) line += cat(" ", k);
    line += "]";
  }
  ctx_.log("-", line);
}

std::vector<std::vector<int64_t>> Rounds::across_replicas(const std::vector<int64_t>& row) {
  if (!has_replicas()) return {};
  return gather_rows(*ctx_.replicate_agree, row);
}

// HSDP: each shard group's rounds are its own, but its exclusive rounds (one per top-level call,
// backward, unshard() and explicit collective, which must match over the whole mesh) meet the other
// replicas' too: a clash found in one shard group, or between replicas, stops every rank of the
// mesh at once. A rank whose shard group found a clash in any round joins this exchange too,
// carrying the two messages.
std::optional<Rounds::Clash> Rounds::meet_replicas(const Message& mine,
                                                   const std::optional<Clash>& found) {
  constexpr size_t kFields = 4;  // kind, who, rank, digest
  std::vector<int64_t> row(2 + 3 * kFields, 0);
  auto put = [&](size_t at, const Message& m) {
    row[at] = static_cast<int64_t>(m.kind);
    row[at + 1] = m.who;
    row[at + 2] = m.rank;
    row[at + 3] = m.digest;
  };
  put(0, mine);
  row[kFields] = found ? 1 : 0;
  if (found) {
    put(kFields + 1, found->first);
    put(2 * kFields + 1, found->second);
  }
  const auto rows = across_replicas(row);
  auto brief = [](const int64_t* v) {
    Message m;
    m.kind = static_cast<protocol::Kind>(v[0]);
    m.who = v[1];
    m.rank = v[2];
    m.digest = v[3];
    return m;
  };
  for (const auto& r : rows)
    if (r[kFields] != 0) return Clash{brief(&r[kFields + 1]), brief(&r[2 * kFields + 1])};
  for (size_t r = 1; r < rows.size(); ++r)
    if (protocol::clash(brief(&rows[0][0]), brief(&rows[r][0])))
      return Clash{brief(&rows[0][0]), brief(&rows[r][0])};
  return std::nullopt;
}

std::vector<Message> Rounds::exchange(const Message& mine, size_t groups, const Names& names) {
  std::vector<Message> all = gather(mine, groups);
  std::optional<Clash> found = protocol::first_clash(all);
  const bool exclusive = mine.kind != protocol::Kind::kCall && mine.kind != protocol::Kind::kDone;
  if (has_replicas() && (exclusive || found)) found = meet_replicas(mine, found);
  if (found) throw Error(protocol::clash_error(found->first, found->second, names()));
  return all;
}

}  // namespace fsdp::detail
