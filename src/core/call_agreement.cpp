// CallAgreement: rounds on the gather lane ([Note: calls that differ between ranks]).
#include "core/call_agreement.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/fully_shard.h>

#include <algorithm>
#include <optional>

#include "core/context.h"
#include "core/group.h"

namespace fsdp::detail {
namespace {

constexpr size_t kFixedWords = 3;  // kind, who, rank

size_t words_for(size_t groups) { return (groups + 63) / 64; }
void set_bit(std::vector<uint64_t>& bits, size_t k) { bits[k / 64] |= uint64_t{1} << (k % 64); }
bool bit(const std::vector<uint64_t>& bits, size_t k) {
  return (bits[k / 64] >> (k % 64)) & uint64_t{1};
}

// The lists of all ranks merged position by position: every rank's first entry (in rank order),
// then every rank's second, ..., each group once. The same on every rank that holds the same lists.
std::vector<int64_t> interleave(const std::vector<std::vector<int64_t>>& lists) {
  std::vector<int64_t> out;
  size_t longest = 0;
  for (const auto& l : lists) longest = std::max(longest, l.size());
  for (size_t pos = 0; pos < longest; ++pos)
    for (const auto& l : lists)
      if (pos < l.size() && std::find(out.begin(), out.end(), l[pos]) == out.end())
        out.push_back(l[pos]);
  return out;
}

// Every rank's row (all of one length), indexed by rank: one all-gather.
std::vector<std::vector<int64_t>> gather_rows(Communicator& c, const std::vector<int64_t>& row) {
  const auto len = static_cast<int64_t>(row.size());
  auto recv = at::empty({c.size() * len}, at::kLong);
  c.all_gather(recv, at::tensor(row, at::kLong)).wait();
  const int64_t* v = recv.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows;
  for (int r = 0; r < c.size(); ++r) rows.emplace_back(v + r * len, v + (r + 1) * len);
  return rows;
}

// FNV-1a over the words of a bit set: what a message's bits are, in one number that crosses the
// replicate lane.
int64_t digest_of(const std::vector<uint64_t>& bits) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t w : bits)
    for (int i = 0; i < 8; ++i) h = (h ^ ((w >> (8 * i)) & 0xff)) * 1099511628211ull;
  return static_cast<int64_t>(h);
}

const char* explicit_name(int64_t what) {
  switch (static_cast<CallAgreement::Explicit>(what)) {
    case CallAgreement::Explicit::kClipGradNorm:
      return "clip_grad_norm_";
    case CallAgreement::Explicit::kFullStateDict:
      return "full_state_dict";
    case CallAgreement::Explicit::kLoadFullStateDict:
      return "load_full_state_dict";
    case CallAgreement::Explicit::kCheckpointSave:
      return "checkpoint::save";
    case CallAgreement::Explicit::kCheckpointLoad:
      return "checkpoint::load";
    case CallAgreement::Explicit::kFinalizeBackward:
      return "finalize_backward";
  }
  return "an unknown collective";
}

}  // namespace

bool CallAgreement::active() const { return ctx_.gather_lane().size() > 1; }

CallAgreement::Message CallAgreement::message(Kind kind, const Group* who) const {
  const size_t w = words_for(ctx_.groups().size());
  Message m;
  m.kind = kind;
  m.who = who ? ctx_.index_of(who) : -1;
  m.rank = mesh_rank();
  m.need.assign(w, 0);
  m.prefetch.assign(w, 0);
  m.changed.assign(w, 0);
  m.held.assign(w, 0);
  return m;
}

std::string CallAgreement::describe(const Message& m) const {
  const auto& groups = ctx_.groups();
  const std::string who =
      m.kind != kExplicit && m.who >= 0 && static_cast<size_t>(m.who) < groups.size()
          ? groups[m.who]->name()
          : "?";
  switch (m.kind) {
    case kStart:
      return "began a top-level forward of '" + who + "'";
    case kCall:
      return "was inside a forward (a call of '" + who + "')";
    case kDone:
      return "had ended a top-level forward of '" + who + "'";
    case kBackward:
      return detail::cat("began a backward reducing ", m.who, " of ", groups.size(),
                         " sharded modules");
    case kFinalize:
      return detail::cat("called finalize_backward reducing ", m.who, " of ", groups.size(),
                         " sharded modules");
    case kUnshard:
      return "called unshard() of '" + who + "'";
    case kExplicit:
      return std::string("called ") + explicit_name(m.who);
    default:
      return "sent an unknown message (kind " + std::to_string(m.kind) + ")";
  }
}

// This rank's number in the whole mesh (the world's rank, as published at the rendezvous), which
// names it in errors; its gather-lane rank where the communicator was built without identities.
int64_t CallAgreement::mesh_rank() const {
  auto& lane = ctx_.gather_lane();
  const auto& peers = lane.peers();
  return static_cast<size_t>(lane.rank()) < peers.size() ? peers[lane.rank()].rank : lane.rank();
}

bool CallAgreement::exclusive(int64_t kind) {
  return kind == kStart || kind == kBackward || kind == kUnshard || kind == kExplicit ||
         kind == kFinalize;
}

// The exclusive kinds pair only with their own kind (two top-level forwards only when of the same
// module: the root's ends with an agreement check that a block's does not; two explicit
// collectives only when the same; two backwards only when they reduce the same groups); a forward's
// calls and the done rounds of a forward that ended pair with each other.
bool CallAgreement::clash(const Message& a, const Message& b) {
  if (a.kind == b.kind && (a.kind == kBackward || a.kind == kFinalize))
    return a.digest != b.digest;  // what it reduces
  if (a.kind == b.kind) return (a.kind == kStart || a.kind == kExplicit) && a.who != b.who;
  return exclusive(a.kind) || exclusive(b.kind);
}

std::vector<CallAgreement::Message> CallAgreement::gather_messages(const Message& mine) {
  auto& lane = ctx_.gather_lane();
  const size_t w = mine.need.size();
  std::vector<int64_t> row{mine.kind, mine.who, mine.rank};
  for (const auto* bits : {&mine.need, &mine.prefetch, &mine.changed, &mine.held})
    for (uint64_t x : *bits) row.push_back(static_cast<int64_t>(x));
  const auto rows = gather_rows(lane, row);
  std::vector<Message> all(lane.size());
  for (int r = 0; r < lane.size(); ++r) {
    const int64_t* v = rows[r].data();
    Message& m = all[r];
    m.kind = v[0];
    m.who = v[1];
    m.rank = v[2];
    size_t at = kFixedWords;
    for (auto* bits : {&m.need, &m.prefetch, &m.changed, &m.held}) {
      bits->assign(v + at, v + at + w);
      at += w;
    }
  }
  if (ctx_.debug()) {
    std::string line = "round:";
    for (const Message& m : all) {
      line += detail::cat(" [rank ", m.rank, " kind ", m.kind, " who ", m.who, " need");
      for (size_t k = 0; k < 64 * w; ++k)
        if (bit(m.need, k)) line += detail::cat(" ", k);
      line += " prefetch";
      for (size_t k = 0; k < 64 * w; ++k)
        if (bit(m.prefetch, k)) line += detail::cat(" ", k);
      line += "]";
    }
    ctx_.log(nullptr, line);
  }
  return all;
}

// HSDP: each shard group's rounds are its own, but its exclusive rounds (one per top-level call,
// backward, unshard() and explicit collective, which must match over the whole mesh) meet the other
// replicas' too, on the replicate lane: a clash found in one shard group, or between replicas,
// stops every rank of the mesh at once. A rank whose shard group found a clash in any round joins
// this exchange too.
std::optional<CallAgreement::Clash> CallAgreement::agree_across_replicas(
    Communicator& rep, const Message& mine, const std::optional<Clash>& found) {
  // kind, who, rank, digest of this rank's message; whether its shard group found a clash; the
  // two messages of that clash.
  constexpr size_t kFields = 4;
  std::vector<int64_t> row(2 + 3 * kFields, 0);
  auto put = [&](size_t at, const Message& m) {
    row[at] = m.kind;
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
  const auto rows = gather_rows(rep, row);
  auto brief = [](const int64_t* v) {
    Message m;
    m.kind = v[0];
    m.who = v[1];
    m.rank = v[2];
    m.digest = v[3];
    return m;
  };
  for (const auto& r : rows)
    if (r[kFields] != 0) return Clash{brief(&r[kFields + 1]), brief(&r[2 * kFields + 1])};
  for (size_t r = 1; r < rows.size(); ++r)
    if (clash(brief(&rows[0][0]), brief(&rows[r][0])))
      return Clash{brief(&rows[0][0]), brief(&rows[r][0])};
  return std::nullopt;
}

std::vector<CallAgreement::Message> CallAgreement::exchange(Message mine) {
  // Only a backward's bits (what it reduces) must match: the forward's rounds skip the digest.
  auto digest = [](Message& m) {
    if (m.kind == kBackward || m.kind == kFinalize) m.digest = digest_of(m.need);
  };
  digest(mine);
  std::vector<Message> all = active() ? gather_messages(mine) : std::vector<Message>{mine};
  for (Message& m : all) digest(m);
  std::optional<Clash> found;
  for (size_t r = 1; r < all.size() && !found; ++r)
    if (clash(all[0], all[r])) found = Clash{all[0], all[r]};
  Communicator* rep = ctx_.replicate_agree_lane();
  if (rep && rep->size() > 1 && (exclusive(mine.kind) || found))
    found = agree_across_replicas(*rep, mine, found);
  if (!found) return all;
  const Message &a = found->first, &b = found->second;
  if (a.kind == b.kind && (a.kind == kBackward || a.kind == kFinalize))
    throw Error(detail::cat(
        "the ranks' gradient synchronisation differs: rank ", a.rank, " ", describe(a),
        " while rank ", b.rank, " ", describe(b),
        ". A backward's reductions are collectives, so every rank must reduce the same sharded "
        "modules. Fix: call set_requires_gradient_sync with the same value on every rank (e.g. "
        "false on every micro-batch but the last, on every rank)"));
  throw Error(detail::cat(
      "the ranks' top-level calls differ: rank ", a.rank, " ", describe(a), " while rank ", b.rank,
      " ", describe(b),
      ". Ranks may call different sharded modules inside a forward, but every rank must make "
      "the same top-level calls (forwards of the root, or of a module called outside any other "
      "sharded module's forward), the same backward calls and the same explicit collectives "
      "(FSDPModule::unshard(), clip_grad_norm_, state dicts, checkpoints). Fix: make those calls "
      "on every rank (a rank with nothing to compute can call the model on an empty batch)"));
}

void CallAgreement::issue_union(const Message& mine, const std::vector<Message>& all) {
  const auto& groups = ctx_.groups();
  std::vector<uint64_t> need(mine.need.size(), 0), prefetch(mine.need.size(), 0);
  for (const auto& m : all)
    for (size_t i = 0; i < need.size(); ++i) {
      need[i] |= m.need[i];
      prefetch[i] |= m.prefetch[i];
    }
  for (size_t i = 0; i < need.size(); ++i) prefetch[i] &= ~need[i];
  auto issue = [&](const std::vector<uint64_t>& set) {
    for (size_t k = 0; k < groups.size(); ++k) {
      if (!bit(set, k)) continue;
      Group* g = groups[k];
      if (bit(mine.need, k)) {
        g->unshard();
      } else if (bit(mine.prefetch, k)) {
        ctx_.log(g, "forward prefetch");
        g->unshard();
        prefetched_.push_back(g);
      } else {
        g->serve_gather();
      }
    }
  };
  issue(need);
  issue(prefetch);
}

// [Note: stale gathered parameters] The ranks decide together: a group is stale when some rank's
// shard changed since its gather, or when only some ranks hold it (one that does not hold it
// cannot tell whether its shard changed since the others gathered).
void CallAgreement::begin_top_level(Group& g) {
  prefetched_.clear();
  const auto& groups = ctx_.groups();
  Message m = message(kStart, &g);
  for (size_t k = 0; k < groups.size(); ++k) {
    if (!groups[k]->held_from_earlier_epoch()) continue;
    set_bit(m.held, k);
    if (groups[k]->changed_since_gather()) set_bit(m.changed, k);
  }
  const auto all = exchange(m);
  for (size_t k = 0; k < groups.size(); ++k) {
    if (!bit(m.held, k)) continue;
    bool stale = false;
    for (const auto& o : all) stale = stale || bit(o.changed, k) || !bit(o.held, k);
    if (stale)
      groups[k]->reshard();
    else
      groups[k]->mark_current();
  }
}

void CallAgreement::gather_for_call(Group& g) {
  prefetched_.erase(std::remove(prefetched_.begin(), prefetched_.end(), &g), prefetched_.end());
  Message m = message(kCall, &g);
  const size_t k = static_cast<size_t>(ctx_.index_of(&g));
  bool any = false;
  if (g.shard_state() == ShardState::kSharded) {
    set_bit(m.need, k);
    any = true;
  }
  for (Group* t : ctx_.forward_prefetch_targets(g)) {
    set_bit(m.prefetch, static_cast<size_t>(ctx_.index_of(t)));
    any = true;
  }
  if (!any) return;
  issue_union(m, exchange(m));
}

void CallAgreement::explicit_unshard(Group& g) {
  Message m = message(kUnshard, &g);
  if (g.shard_state() == ShardState::kSharded)
    set_bit(m.need, static_cast<size_t>(ctx_.index_of(&g)));
  issue_union(m, exchange(m));
}

void CallAgreement::explicit_collective(Explicit what) {
  Message m = message(kExplicit, nullptr);
  m.who = static_cast<int64_t>(what);
  exchange(m);
}

void agree_explicit_collective(const FSDPModule& module, CallAgreement::Explicit what) {
  const auto& g = HandleAccess::group(module);
  if (g) g->context().calls().explicit_collective(what);
}

void CallAgreement::end_top_level(Group& g) {
  if (active()) {
    for (;;) {
      Message m = message(kDone, &g);
      const auto all = exchange(m);
      issue_union(m, all);
      if (std::all_of(all.begin(), all.end(), [](const Message& o) { return o.kind == kDone; }))
        break;
    }
  }
  // Prefetched for a call this rank did not make: no longer needed.
  for (Group* t : prefetched_)
    if (t->shard_state() == ShardState::kGathering && t->training_state() == TrainingState::kIdle) {
      ctx_.log(t, "forward prefetch unused: dropped");
      t->reshard();
    }
  prefetched_.clear();
}

std::vector<bool> CallAgreement::agree_finalize(const std::vector<bool>& my_reductions,
                                                const std::vector<bool>& my_holdings) {
  const auto all = agree_reductions(kFinalize, my_reductions, my_holdings);
  std::vector<uint64_t> held(words_for(my_holdings.size()), 0);
  for (const auto& m : all)
    for (size_t i = 0; i < held.size(); ++i) held[i] |= m.held[i];
  // HSDP: the all-reduces across replicas follow, so the replicas decide alike too.
  if (Communicator* rep = ctx_.replicate_agree_lane(); rep && rep->size() > 1) {
    std::vector<int64_t> row(held.begin(), held.end());
    for (const auto& r : gather_rows(*rep, row))
      for (size_t i = 0; i < held.size(); ++i) held[i] |= static_cast<uint64_t>(r[i]);
  }
  std::vector<bool> out;
  for (size_t k = 0; k < my_holdings.size(); ++k) out.push_back(bit(held, k));
  return out;
}

std::vector<CallAgreement::Message> CallAgreement::agree_reductions(
    Kind kind, const std::vector<bool>& my_reductions, const std::vector<bool>& my_holdings) {
  Message opening = message(kind, nullptr);  // `need`: the groups reduced; `held`: holdings
  opening.who = 0;
  for (size_t k = 0; k < my_reductions.size(); ++k) {
    if (my_reductions[k]) {
      set_bit(opening.need, k);
      ++opening.who;
    }
    if (k < my_holdings.size() && my_holdings[k]) set_bit(opening.held, k);
  }
  return exchange(opening);
}

CallAgreement::BackwardOrders CallAgreement::agree_backward(
    const std::vector<Group*>& my_gathers, const std::vector<Group*>& my_reverse_forward,
    const std::vector<bool>& my_reductions, const std::vector<bool>& my_holdings) {
  const auto& groups = ctx_.groups();
  Group* root = ctx_.root();
  auto indices = [&](const std::vector<Group*>& v) {
    std::vector<int64_t> out;
    for (Group* g : v) out.push_back(ctx_.index_of(g));
    return out;
  };
  std::vector<std::vector<int64_t>> plans{indices(my_gathers)};
  std::vector<std::vector<int64_t>> orders{indices(my_reverse_forward)};
  // hpZ: the groups whose post-forward chunk this rank holds; a group is gathered from the chunks
  // only when every rank of the shard group holds its own.
  std::vector<uint64_t> chunks(words_for(groups.size()), 0);
  for (size_t k = 0; k < groups.size(); ++k)
    if (groups[k]->holds_chunk()) set_bit(chunks, k);
  // [Note: parameters that got no gradient] The groups some rank may have something to reduce
  // for: any rank's is every rank's.
  std::vector<uint64_t> holdings(words_for(groups.size()), 0);
  for (size_t k = 0; k < groups.size(); ++k)
    if (my_holdings[k]) set_bit(holdings, k);
  agree_reductions(kBackward, my_reductions, {});
  if (active()) {
    // One row per rank, all of one length: the two counts, both lists, padding, the chunk bits,
    // the holdings.
    std::vector<int64_t> mine{static_cast<int64_t>(plans[0].size()),
                              static_cast<int64_t>(orders[0].size())};
    mine.insert(mine.end(), plans[0].begin(), plans[0].end());
    mine.insert(mine.end(), orders[0].begin(), orders[0].end());
    mine.resize(2 + 2 * groups.size(), -1);
    for (uint64_t w : chunks) mine.push_back(static_cast<int64_t>(w));
    for (uint64_t w : holdings) mine.push_back(static_cast<int64_t>(w));
    plans.clear();
    orders.clear();
    for (const auto& l : gather_rows(ctx_.gather_lane(), mine)) {
      const auto plan = l.begin() + 2, order = plan + l[0];
      plans.emplace_back(plan, order);
      orders.emplace_back(order, order + l[1]);
      const size_t at = 2 + 2 * groups.size();
      for (size_t i = 0; i < chunks.size(); ++i) {
        chunks[i] &= static_cast<uint64_t>(l[at + i]);
        holdings[i] |= static_cast<uint64_t>(l[at + chunks.size() + i]);
      }
    }
  }
  // Reductions: the merged reverse first-forward orders (the root left out), the groups no rank
  // forwarded in reverse registration order, the root last.
  std::vector<int64_t> reduce = interleave(orders);
  const int64_t root_index = ctx_.index_of(root);
  reduce.erase(std::remove(reduce.begin(), reduce.end(), root_index), reduce.end());
  for (int64_t k = static_cast<int64_t>(groups.size()) - 1; k >= 0; --k)
    if (k != root_index && std::find(reduce.begin(), reduce.end(), k) == reduce.end())
      reduce.push_back(k);
  if (root) reduce.push_back(root_index);
  bool differ = false;
  for (size_t r = 1; r < plans.size(); ++r)
    differ = differ || plans[r] != plans[0] || orders[r] != orders[0];
  // HSDP: every replica's order, merged again, so that the all-reduces agree across the mesh;
  // whether any shard group's calls differed (first entry) and the holdings travel with it.
  if (Communicator* rep = ctx_.replicate_agree_lane(); rep && rep->size() > 1) {
    std::vector<int64_t> row{differ ? 1 : 0};
    for (uint64_t w : holdings) row.push_back(static_cast<int64_t>(w));
    row.insert(row.end(), reduce.begin(), reduce.end());
    auto lists = gather_rows(*rep, row);  // every order holds every group: one length
    for (auto& l : lists) {
      differ = differ || l.front() != 0;
      for (size_t i = 0; i < holdings.size(); ++i)
        holdings[i] |= static_cast<uint64_t>(l[1 + i]);
      l.erase(l.begin(), l.begin() + 1 + static_cast<std::ptrdiff_t>(holdings.size()));
    }
    reduce = interleave(lists);
  }
  BackwardOrders out;
  out.calls_differ = differ;
  for (size_t k = 0; k < groups.size(); ++k) out.from_chunk.push_back(bit(chunks, k));
  for (size_t k = 0; k < groups.size(); ++k) out.held.push_back(bit(holdings, k));
  for (int64_t k : interleave(plans)) out.gathers.push_back(groups[k]);
  for (int64_t k : reduce) out.reductions.push_back(groups[k]);
  return out;
}

}  // namespace fsdp::detail
