#include "comm/rank_agreement.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>
#include <cstring>

#include "util/checksum.h"

namespace fsdp::detail {

std::vector<std::string> all_gather_strings(Communicator& c, const std::string& mine) {
  const int w = c.size();
  auto len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  auto lens = at::empty({w}, at::kLong);
  c.all_gather(lens, len).wait();
  const int64_t max_len = std::max<int64_t>(1, lens.max().item<int64_t>());
  auto buf = at::zeros({max_len}, at::kByte);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  auto all = at::empty({w * max_len}, at::kByte);
  c.all_gather(all, buf).wait();
  std::vector<std::string> out;
  const auto* p = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < w; ++r)
    out.emplace_back(p + r * max_len, static_cast<size_t>(lens[r].item<int64_t>()));
  return out;
}

std::string broadcast_string(Communicator& c, const std::string& s, int root) {
  if (c.size() == 1) return s;
  auto len = at::full({1}, static_cast<int64_t>(c.rank() == root ? s.size() : 0), at::kLong);
  c.broadcast(len, root).wait();
  auto buf = at::zeros({std::max<int64_t>(1, len.item<int64_t>())}, at::kByte);
  if (c.rank() == root) std::memcpy(buf.data_ptr(), s.data(), s.size());
  c.broadcast(buf, root).wait();
  return std::string(static_cast<const char*>(buf.data_ptr()),
                     static_cast<size_t>(len.item<int64_t>()));
}

std::optional<RankFailure> first_failure(Communicator& c, const std::string& error) {
  auto flag = at::full({1}, error.empty() ? 0 : 1, at::kLong);
  c.all_reduce(flag, ReduceOp::kSum).wait();
  if (flag.item<int64_t>() == 0) return std::nullopt;
  const auto all = all_gather_strings(c, error);  // every rank takes part, failed or not
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) return RankFailure{static_cast<int>(r), all[r]};
  return RankFailure{-1, {}};  // a rank failed with an empty message
}

namespace {
// An fsdp::Error's message without the "fsdp: " that Error puts in front again.
std::string unprefixed(const std::string& m) { return m.rfind("fsdp: ", 0) == 0 ? m.substr(6) : m; }
}  // namespace

void raise_together(Communicator& c, const std::string& error, const std::string& what) {
  const auto failure = first_failure(c, error);
  if (!failure) return;
  if (!error.empty()) throw Error(unprefixed(error));
  if (failure->rank < 0) throw Error(cat(what, " failed on another rank"));
  throw Error(cat(what, " failed on rank ", failure->rank, ": ", failure->message));
}

namespace {
std::string failed_elsewhere(const RankFailure& f, const Communicator& c, const std::string& what) {
  if (f.rank < 0) return cat(what, " failed on another rank");
  return cat(what, " failed on rank ", f.rank, " of '", c.name(), "': ", unprefixed(f.message));
}
}  // namespace

void raise_together(Communicator& c, Communicator* across, const std::string& error,
                    const std::string& what) {
  if (!across) return raise_together(c, error, what);
  std::string mine = error;
  if (const auto f = first_failure(c, error); f && error.empty())
    mine = failed_elsewhere(*f, c, what);
  const auto g = first_failure(*across, mine);
  if (!g) return;
  if (!mine.empty()) throw Error(unprefixed(mine));
  throw Error(failed_elsewhere(*g, *across, what));
}

std::vector<std::vector<int64_t>> all_gather_values(Communicator& c,
                                                    const std::vector<int64_t>& mine) {
  std::string bytes(mine.size() * sizeof(int64_t), '\0');
  if (!mine.empty()) std::memcpy(bytes.data(), mine.data(), bytes.size());
  std::vector<std::vector<int64_t>> out;
  for (const auto& s : all_gather_strings(c, bytes)) {
    std::vector<int64_t> v(s.size() / sizeof(int64_t));
    if (!v.empty()) std::memcpy(v.data(), s.data(), v.size() * sizeof(int64_t));
    out.push_back(std::move(v));
  }
  return out;
}

std::optional<RankDifference> first_difference_from_rank0(
    const std::vector<std::vector<int64_t>>& per_rank) {
  if (per_rank.size() < 2) return std::nullopt;
  size_t longest = 0;
  for (const auto& v : per_rank) longest = std::max(longest, v.size());
  const auto& ref = per_rank[0];
  for (size_t i = 0; i < longest; ++i)
    for (size_t r = 1; r < per_rank.size(); ++r) {
      const auto& v = per_rank[r];
      const bool differs = (i < v.size()) != (i < ref.size()) || (i < v.size() && v[i] != ref[i]);
      if (differs) return RankDifference{i, static_cast<int>(r)};
    }
  return std::nullopt;
}

std::optional<RankDifference> first_value_difference(Communicator& c,
                                                     const std::vector<at::Tensor>& tensors) {
  if (c.size() == 1 || tensors.empty()) return std::nullopt;
  std::vector<int64_t> sums;
  for (const auto& t : tensors) sums.push_back(value_checksum(t));
  return first_difference_from_rank0(all_gather_values(c, sums));
}

}  // namespace fsdp::detail
