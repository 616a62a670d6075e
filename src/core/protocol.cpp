// The cross-rank protocol's rules (core/protocol.h).
#include "core/protocol.h"

#include <fsdp/error.h>

#include <algorithm>

#include "util/checksum.h"

namespace fsdp::detail::protocol {

size_t words_for(size_t groups) { return (groups + 63) / 64; }
void set_bit(Bits& bits, size_t k) { bits[k / 64] |= uint64_t{1} << (k % 64); }
bool test_bit(const Bits& bits, size_t k) {
  return k / 64 < bits.size() && ((bits[k / 64] >> (k % 64)) & uint64_t{1});
}

Bits bits_of(const std::vector<bool>& v) {
  Bits b(words_for(v.size()), 0);
  for (size_t k = 0; k < v.size(); ++k)
    if (v[k]) set_bit(b, k);
  return b;
}

std::vector<bool> bools_of(const Bits& bits, size_t n) {
  std::vector<bool> out(n);
  for (size_t k = 0; k < n; ++k) out[k] = test_bit(bits, k);
  return out;
}

const char* name_of(Explicit what) {
  switch (what) {
    case Explicit::kClipGradNorm:
      return "clip_grad_norm_";
    case Explicit::kFullStateDict:
      return "full_state_dict";
    case Explicit::kLoadFullStateDict:
      return "load_full_state_dict";
    case Explicit::kCheckpointSave:
      return "checkpoint::save";
    case Explicit::kCheckpointLoad:
      return "checkpoint::load";
    case Explicit::kFinalizeBackward:
      return "finalize_backward";
  }
  return "an unknown collective";
}

int64_t digest_of(const Bits& bits) {
  return static_cast<int64_t>(checksum_bytes(bits.data(), bits.size() * sizeof(uint64_t)));
}

// ---------------------------------------------------------------------------------------------
// Layout: kind, who, rank, digest, five bit sets, the two lists' lengths, the lists padded to
// `groups` entries each.
// ---------------------------------------------------------------------------------------------
size_t serialized_words(size_t groups) { return 4 + 5 * words_for(groups) + 2 + 2 * groups; }

std::vector<int64_t> serialize(const Message& m, size_t groups) {
  const size_t w = words_for(groups);
  std::vector<int64_t> out{static_cast<int64_t>(m.kind), m.who, m.rank, m.digest};
  for (const Bits* bits : {&m.need, &m.prefetch, &m.changed, &m.held, &m.chunks})
    for (size_t i = 0; i < w; ++i)
      out.push_back(i < bits->size() ? static_cast<int64_t>((*bits)[i]) : 0);
  FSDP_CHECK(m.plan.size() <= groups && m.reverse.size() <= groups,
             "internal error: a backward message lists more groups than the root has");
  out.push_back(static_cast<int64_t>(m.plan.size()));
  out.push_back(static_cast<int64_t>(m.reverse.size()));
  for (const auto* list : {&m.plan, &m.reverse}) {
    out.insert(out.end(), list->begin(), list->end());
    out.insert(out.end(), groups - list->size(), -1);
  }
  return out;
}

Message deserialize(const int64_t* v, size_t groups) {
  const size_t w = words_for(groups);
  Message m;
  m.kind = static_cast<Kind>(v[0]);
  m.who = v[1];
  m.rank = v[2];
  m.digest = v[3];
  size_t at = 4;
  for (Bits* bits : {&m.need, &m.prefetch, &m.changed, &m.held, &m.chunks}) {
    for (size_t i = 0; i < w; ++i) bits->push_back(static_cast<uint64_t>(v[at + i]));
    at += w;
  }
  const auto plan_size = static_cast<size_t>(std::clamp<int64_t>(v[at], 0, groups));
  const auto reverse_size = static_cast<size_t>(std::clamp<int64_t>(v[at + 1], 0, groups));
  at += 2;
  m.plan.assign(v + at, v + at + plan_size);
  m.reverse.assign(v + at + groups, v + at + groups + reverse_size);
  return m;
}

// ---------------------------------------------------------------------------------------------
// Clashes
// ---------------------------------------------------------------------------------------------
namespace {
bool exclusive(Kind k) { return k != Kind::kCall && k != Kind::kDone; }
}  // namespace

bool clash(const Message& a, const Message& b) {
  if (a.kind == b.kind && (a.kind == Kind::kBackward || a.kind == Kind::kFinalize))
    return a.digest != b.digest;  // what it reduces
  if (a.kind == b.kind && a.kind == Kind::kStart)
    return a.who != b.who || a.digest != b.digest;  // the call, and the declarations
  if (a.kind == b.kind) return a.kind == Kind::kExplicit && a.who != b.who;
  return exclusive(a.kind) || exclusive(b.kind);
}

std::optional<std::pair<Message, Message>> first_clash(const std::vector<Message>& all) {
  for (size_t r = 1; r < all.size(); ++r)
    if (clash(all[0], all[r])) return std::make_pair(all[0], all[r]);
  return std::nullopt;
}

std::string describe(const Message& m, const std::vector<std::string>& groups) {
  const std::string who =
      m.kind != Kind::kExplicit && m.who >= 0 && static_cast<size_t>(m.who) < groups.size()
          ? groups[m.who]
          : "?";
  switch (m.kind) {
    case Kind::kStart:
      return "began a top-level forward of '" + who + "'";
    case Kind::kCall:
      return "was inside a forward (a call of '" + who + "')";
    case Kind::kDone:
      return "had ended a forward of '" + who + "'";
    case Kind::kBackward:
      return cat("began a backward reducing ", m.who, " of ", groups.size(), " sharded modules");
    case Kind::kFinalize:
      return cat("called finalize_backward reducing ", m.who, " of ", groups.size(),
                 " sharded modules");
    case Kind::kUnshard:
      return "called unshard() of '" + who + "'";
    case Kind::kExplicit:
      return std::string("called ") + name_of(static_cast<Explicit>(m.who));
  }
  return cat("sent an unknown message (kind ", static_cast<int64_t>(m.kind), ")");
}

std::string clash_error(const Message& a, const Message& b,
                        const std::vector<std::string>& groups) {
  const std::string both = cat("rank ", a.rank, " ", describe(a, groups), " while rank ", b.rank,
                               " ", describe(b, groups));
  if (a.kind == b.kind && (a.kind == Kind::kBackward || a.kind == Kind::kFinalize))
    return cat("the ranks' gradient synchronisation differs: ", both,
               ". A backward's reductions are collectives, so every rank must reduce the same "
               "sharded modules. Fix: call set_requires_gradient_sync with the same value on "
               "every rank (e.g. false on every micro-batch but the last, on every rank)");
  if (a.kind == Kind::kStart && b.kind == Kind::kStart && a.who == b.who)
    return cat("the ranks' declarations differ: at a top-level forward of '",
               a.who >= 0 && static_cast<size_t>(a.who) < groups.size() ? groups[a.who] : "?",
               "' rank ", a.rank, " and rank ", b.rank,
               " have set_calls_may_differ on different sharded modules. The declaration decides "
               "which collectives a forward issues, so every rank must make the same. Fix: set "
               "it on the same modules on every rank");
  return cat("the ranks' top-level calls differ: ", both,
             ". Every rank must make the same top-level calls (forwards of the root, or of a "
             "module called outside any other sharded module's forward), the same backward calls "
             "and the same explicit collectives (FSDPModule::unshard(), clip_grad_norm_, state "
             "dicts, checkpoints). Fix: make those calls on every rank (a rank with nothing to "
             "compute can call the model on an empty batch)");
}

// ---------------------------------------------------------------------------------------------
// Forward rounds
// ---------------------------------------------------------------------------------------------
std::vector<Gather> gathers_of_round(const Message& mine, const std::vector<Message>& all,
                                     size_t groups) {
  const size_t w = words_for(groups);
  Bits need(w, 0), prefetch(w, 0);
  for (const auto& m : all)
    for (size_t i = 0; i < w; ++i) {
      need[i] |= i < m.need.size() ? m.need[i] : 0;
      prefetch[i] |= i < m.prefetch.size() ? m.prefetch[i] : 0;
    }
  for (size_t i = 0; i < w; ++i) prefetch[i] &= ~need[i];
  std::vector<Gather> out;
  for (const Bits* set : {&need, &prefetch})
    for (size_t k = 0; k < groups; ++k) {
      if (!test_bit(*set, k)) continue;
      const auto use = test_bit(mine.need, k)       ? Gather::Use::kNeed
                       : test_bit(mine.prefetch, k) ? Gather::Use::kPrefetch
                                                    : Gather::Use::kServe;
      out.push_back(Gather{static_cast<int64_t>(k), use});
    }
  return out;
}

bool all_done(const std::vector<Message>& all) {
  return std::all_of(all.begin(), all.end(),
                     [](const Message& m) { return m.kind == Kind::kDone; });
}

std::vector<bool> stale(const Message& mine, const std::vector<Message>& all, size_t groups) {
  std::vector<bool> out(groups, false);
  for (size_t k = 0; k < groups; ++k) {
    if (!test_bit(mine.held, k)) continue;
    for (const auto& o : all) out[k] = out[k] || test_bit(o.changed, k) || !test_bit(o.held, k);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------
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

BackwardDecision decide_backward(const std::vector<Message>& all, size_t groups,
                                 int64_t root_index) {
  BackwardDecision d;
  std::vector<std::vector<int64_t>> plans, orders;
  const size_t w = words_for(groups);
  Bits chunks(w, ~uint64_t{0}), held(w, 0);
  for (const auto& m : all) {
    plans.push_back(m.plan);
    orders.push_back(m.reverse);
    for (size_t i = 0; i < w; ++i) {
      chunks[i] &= i < m.chunks.size() ? m.chunks[i] : 0;
      held[i] |= i < m.held.size() ? m.held[i] : 0;
    }
  }
  for (size_t r = 1; r < all.size(); ++r)
    d.calls_differ = d.calls_differ || plans[r] != plans[0] || orders[r] != orders[0];
  d.gathers = interleave(plans);
  // Reductions: the merged reverse first-forward orders without the root, the groups no rank
  // forwarded in reverse registration order, the root last.
  d.reductions = interleave(orders);
  d.reductions.erase(std::remove(d.reductions.begin(), d.reductions.end(), root_index),
                     d.reductions.end());
  for (int64_t k = static_cast<int64_t>(groups) - 1; k >= 0; --k)
    if (k != root_index &&
        std::find(d.reductions.begin(), d.reductions.end(), k) == d.reductions.end())
      d.reductions.push_back(k);
  if (root_index >= 0) d.reductions.push_back(root_index);
  d.from_chunk = bools_of(chunks, groups);
  d.held = bools_of(held, groups);
  return d;
}

void merge_replicas(BackwardDecision& d, const std::vector<std::vector<int64_t>>& orders,
                    const std::vector<Bits>& held, bool any_differ) {
  d.reductions = interleave(orders);
  d.calls_differ = any_differ;
  Bits all = bits_of(d.held);
  for (const Bits& h : held)
    for (size_t i = 0; i < all.size() && i < h.size(); ++i) all[i] |= h[i];
  d.held = bools_of(all, d.held.size());
}

}  // namespace fsdp::detail::protocol
