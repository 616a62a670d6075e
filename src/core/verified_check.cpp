// VerifiedCollectives: the row each rank adds to the Agreed exchange, the check of every rank's
// rows, and on a mismatch the exchange of the collectives' own digests that names the first
// collective that differs ([Note: verified collectives] in docs/design.md).
#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "core/payload_digest.h"
#include "core/rounds.h"
#include "core/verified.h"
#include "core/verified_state.h"

namespace fsdp::detail {

namespace {
// The row: flags, then by rank the pair sums (gathers, custom wires) and the sketches (doubles
// by their bits), then the output's sketch.
enum Word : size_t {
  kEnabled,
  kPeriod,
  kStep,
  kOrphaned,
  kSketched,
  kMaxTerms,
  kUnchecked,
  kHeader
};
int64_t bits_of(double x) {
  int64_t w;
  std::memcpy(&w, &x, sizeof(w));
  return w;
}
double double_of(int64_t w) {
  double x;
  std::memcpy(&x, &w, sizeof(x));
  return x;
}
// Hoeffding's bound for a sum of terms w_i e_i with independent weights w_i = +-1: exceeded with
// probability at most 2 exp(-t^2 / (2 V)) at t = k sqrt(V), V >= sum_i e_i^2; k = 9.5 makes it
// below 1e-19 per check and rank.
constexpr double kTail = 9.5;

const char* const kHowToTurnOff =
    "To train on without this check: RuntimeOptions::verify_collectives = false on the root "
    "module's ShardOptions (or FSDP_VERIFY_COLLECTIVES=0 in the environment)";

// Where one rank's row keeps its columns.
struct Layout {
  size_t n;
  size_t sent() const { return kHeader; }
  size_t received() const { return kHeader + n; }
  size_t wire_sent() const { return kHeader + 2 * n; }
  size_t wire_received() const { return kHeader + 3 * n; }
  size_t sketch() const { return kHeader + 4 * n; }
  size_t var() const { return kHeader + 5 * n; }
  size_t abs() const { return kHeader + 6 * n; }
  size_t out() const { return kHeader + 7 * n; }  // sketch, var, abs
  size_t words() const { return kHeader + 7 * n + 3; }
};

// A reduction's check for receiver j: the senders' sketches summed against its output's.
struct SumCheck {
  bool checked = false, differs = false;
  double difference = 0, bound = 0;
};
SumCheck check_sum(const std::vector<double>& sketches, const std::vector<double>& vars,
                   const std::vector<double>& abss, double out_sketch, double out_var,
                   double out_abs, int64_t terms) {
  SumCheck c;
  double sum = 0, var = out_var, abs = out_abs;
  for (size_t s = 0; s < sketches.size(); ++s) {
    sum += sketches[s];
    var += vars[s];
    abs += abss[s];
  }
  // Inputs that were not finite (a diverged step) have no sum to compare with.
  if (!std::isfinite(sum) || !std::isfinite(var) || !std::isfinite(abs)) return c;
  c.checked = true;
  c.difference = std::abs(sum - out_sketch);
  c.bound =
      kTail * std::sqrt(var) + fp64_gamma(terms + static_cast<int64_t>(sketches.size()) + 2) * abs;
  c.differs = !std::isfinite(out_sketch) || c.difference > c.bound;
  return c;
}

std::string iteration_of(const VerifiedCollectives::Window& w) {
  return cat("iteration ", w.step + 1, " (the check at the end of its ",
             w.backward ? "backward" : "forward", ")");
}
std::string hex(uint64_t x) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(x));
  return buf;
}
}  // namespace

size_t VerifiedCollectives::words() const { return Layout{static_cast<size_t>(n_)}.words(); }

void VerifiedCollectives::fill(int64_t* words) {
  Timed timed;
  State& st = *state_;
  MutexLock lock(st.mu);
  Window& w = st.window;
  const Layout at{static_cast<size_t>(n_)};
  std::fill(words, words + at.words(), 0);
  words[kEnabled] = st.active ? 1 : 0;
  words[kPeriod] = st.settings.period;
  words[kStep] = st.step;
  // A collective not yet completed on this rank has folded nothing, but may have on others: the
  // window is left unchecked on every rank, and its step folds nothing when it comes.
  for (auto& p : st.pending)
    if (!p->done) {
      p->orphaned = true;
      w.orphaned = true;
    }
  st.pending.clear();
  words[kOrphaned] = w.orphaned ? 1 : 0;
  words[kSketched] = w.sketched;
  words[kMaxTerms] = w.max_terms;
  words[kUnchecked] = w.unchecked;
  for (int r = 0; r < n_; ++r) {
    words[at.sent() + r] = static_cast<int64_t>(w.sent[r]);
    words[at.received() + r] = static_cast<int64_t>(w.received[r]);
    words[at.wire_sent() + r] = static_cast<int64_t>(w.wire_sent[r]);
    words[at.wire_received() + r] = static_cast<int64_t>(w.wire_received[r]);
    words[at.sketch() + r] = bits_of(w.sketch[r]);
    words[at.var() + r] = bits_of(w.var[r]);
    words[at.abs() + r] = bits_of(w.abs[r]);
  }
  words[at.out()] = bits_of(w.out_sketch);
  words[at.out() + 1] = bits_of(w.out_var);
  words[at.out() + 2] = bits_of(w.out_abs);
  w.step = st.step;
  w.backward = backward_check_;
  examined_ = std::move(w);
  w = Window(n_);
  if (backward_check_) ++st.step;
  backward_check_ = false;
}

void VerifiedCollectives::examine(const std::vector<const int64_t*>& rows) {
  Timed timed;
  std::string on, off;
  for (size_t r = 0; r < rows.size(); ++r) (rows[r][kEnabled] ? on : off) += cat(" ", r);
  bool periods_differ = false;
  for (const auto* row : rows) periods_differ |= row[kPeriod] != rows[0][kPeriod];
  if (!on.empty() && !off.empty())
    throw Error(cat("verified collectives are on for ranks", on, " but off for ranks", off,
                    ". Every rank must check alike (each adds its digests to the check at the end "
                    "of every forward and backward). Fix: set RuntimeOptions::verify_collectives "
                    "and FSDP_VERIFY_COLLECTIVES alike on every rank"));
  if (off.empty() && periods_differ)
    throw Error(cat("RuntimeOptions::verify_period differs between ranks (", rows[0][kPeriod],
                    " on rank 0); every rank must check the same part of each collective. Fix: "
                    "set it (and FSDP_VERIFY_COLLECTIVES) alike on every rank"));
  if (on.empty()) return;
  int64_t latest = 0;
  bool steps_differ = false, orphaned = false;
  for (const auto* row : rows) {
    steps_differ |= row[kStep] != rows[0][kStep];
    latest = std::max(latest, row[kStep]);
    orphaned |= row[kOrphaned] != 0;
  }
  if (steps_differ) {
    // A rank missed a check (an error on it alone): its parts no longer match; start again.
    MutexLock lock(state_->mu);
    state_->step = latest + (examined_.backward ? 1 : 0);
    return;
  }
  if (orphaned) return;
  throw_if_differ(rows);
  count_passed();
}

void VerifiedCollectives::throw_if_differ(const std::vector<const int64_t*>& rows) {
  const Layout at{static_cast<size_t>(n_)};
  for (int x = 0; x < n_; ++x)
    for (int r = 0; r < n_; ++r)
      if (r != x && (rows[x][at.received() + r] != rows[r][at.sent() + x] ||
                     rows[x][at.wire_received() + r] != rows[r][at.wire_sent() + x]))
        report(rows);
  int64_t sketched = 0, terms = 0;
  for (const auto* row : rows) {
    sketched = std::max(sketched, row[kSketched]);
    terms = std::max(terms, row[kMaxTerms]);
  }
  for (int j = 0; j < n_; ++j) {
    std::vector<double> s, v, a;
    for (const auto* row : rows) {
      s.push_back(double_of(row[at.sketch() + j]));
      v.push_back(double_of(row[at.var() + j]));
      a.push_back(double_of(row[at.abs() + j]));
    }
    const auto* mine = rows[j];
    if (check_sum(s, v, a, double_of(mine[at.out()]), double_of(mine[at.out() + 1]),
                  double_of(mine[at.out() + 2]), terms + sketched)
            .differs)
      report(rows);
  }
}

// ---------------------------------------------------------------------------------------------
// A check failed: every rank exchanges its collectives' digests (the same on every rank, so every
// rank finds the same first difference and throws the same error).
// ---------------------------------------------------------------------------------------------
namespace {
// One rank's window as words: counts, then its gathers (group, bytes, digest by rank), then its
// reductions (group, numel, custom, sketch/var/abs by rank, the output's, wire digests by rank).
std::vector<int64_t> serialize(const VerifiedCollectives::Window& w, int n) {
  std::vector<int64_t> out{static_cast<int64_t>(w.gathers.size()),
                           static_cast<int64_t>(w.reduces.size())};
  for (const auto& g : w.gathers) {
    out.push_back(g.group);
    out.push_back(g.bytes);
    for (uint64_t d : g.digests) out.push_back(static_cast<int64_t>(d));
  }
  for (const auto& r : w.reduces) {
    out.insert(out.end(), {r.group, r.numel, r.custom});
    for (const auto* v : {&r.sketch, &r.var, &r.abs})
      for (int j = 0; j < n; ++j)
        out.push_back(bits_of(j < static_cast<int>(v->size()) ? (*v)[j] : 0));
    out.insert(out.end(), {bits_of(r.out_sketch), bits_of(r.out_var), bits_of(r.out_abs)});
    for (const auto* v : {&r.wire_sent, &r.wire_received})
      for (int j = 0; j < n; ++j)
        out.push_back(j < static_cast<int>(v->size()) ? static_cast<int64_t>((*v)[j]) : 0);
  }
  return out;
}
size_t gather_words(int n) { return 2 + static_cast<size_t>(n); }
size_t reduce_words(int n) { return 6 + 5 * static_cast<size_t>(n); }
}  // namespace

void VerifiedCollectives::report(const std::vector<const int64_t*>& rows) {
  const Window& w = examined_;
  const int n = n_;
  const Layout at{static_cast<size_t>(n)};
  // The lengths agree when the collectives did (Agreed checked them); exchanged first anyway, so
  // that a difference cannot make this exchange itself wait on mismatched sizes.
  std::vector<int64_t> mine = serialize(w, n);
  int64_t longest = 0;
  for (const auto& len : gather_rows(*agree_, {static_cast<int64_t>(mine.size())}))
    longest = std::max(longest, len[0]);
  mine.resize(static_cast<size_t>(longest), 0);
  const auto all = gather_rows(*agree_, mine);
  int64_t gathers = std::numeric_limits<int64_t>::max(), reduces = gathers;
  for (const auto& r : all) {
    gathers = std::min(gathers, r[0]);
    reduces = std::min(reduces, r[1]);
  }
  const auto names = names_();
  auto module = [&](int64_t g) {
    return g >= 0 && g < static_cast<int64_t>(names.size()) ? "'" + names[g] + "'"
                                                            : std::string("<unknown>");
  };
  const int period = settings().period;
  const std::string part =
      period > 1 ? cat(", the rotating 1/", period, " of it checked in this iteration") : "";
  const std::string when = iteration_of(w);
  // Gathers: rank x's digest of rank s's block against s's own.
  for (int64_t t = 0; t < gathers; ++t) {
    auto word = [&](int r, size_t k) { return all[r][2 + t * gather_words(n) + k]; };
    for (int s = 0; s < n; ++s)
      for (int x = 0; x < n; ++x) {
        const auto sent = static_cast<uint64_t>(word(s, 2 + s)),
                   got = static_cast<uint64_t>(word(x, 2 + s));
        if (x == s || sent == 0 || got == 0 || sent == got) continue;
        throw Error(
            cat("Verified collectives: all-gather #", t + 1, " of ", when, ", of module ",
                module(word(s, 0)), " (", word(s, 1), " bytes per rank", part, "): the bytes rank ",
                s, " sent arrived different on rank ", x, " (XXH3 ", hex(sent), " sent, ", hex(got),
                " received). They were corrupted between the ranks (transport, memory "
                "or device), so rank ",
                x, " would compute with wrong parameters; every rank stops here. ", kHowToTurnOff));
      }
  }
  // Reductions: a custom collective's wire, else the senders' sketches against the receiver's.
  const size_t base = 2 + static_cast<size_t>(gathers) * gather_words(n);
  for (int64_t t = 0; t < reduces; ++t) {
    auto word = [&](int r, size_t k) { return all[r][base + t * reduce_words(n) + k]; };
    const int64_t group = word(0, 0), numel = word(0, 1);
    const bool custom = word(0, 2) != 0;
    // The wire (a custom collective's digests, or the communicator's): exact.
    for (int s = 0; s < n; ++s)
      for (int x = 0; x < n; ++x) {
        const auto sent = static_cast<uint64_t>(word(s, 6 + 3 * n + x)),
                   got = static_cast<uint64_t>(word(x, 6 + 4 * n + s));
        if (x == s || sent == got || (!custom && (sent == 0 || got == 0))) continue;
        throw Error(cat("Verified collectives: reduce-scatter #", t + 1, " of ", when,
                        ", of module ", module(group), " (", numel, " elements per rank",
                        custom ? ", a custom collective" : "", "): the bytes rank ", s,
                        " sent to rank ", x, " arrived different (XXH3 ", hex(sent), " sent, ",
                        hex(got),
                        " received, before the sum). They were corrupted between the "
                        "ranks (transport, memory or device), so the optimizer would step on a "
                        "wrong gradient; every rank stops here. ",
                        kHowToTurnOff));
      }
    if (custom) continue;
    for (int j = 0; j < n; ++j) {
      std::vector<double> s, v, a;
      for (int r = 0; r < n; ++r) {
        s.push_back(double_of(word(r, 3 + j)));
        v.push_back(double_of(word(r, 3 + n + j)));
        a.push_back(double_of(word(r, 3 + 2 * n + j)));
      }
      const auto c =
          check_sum(s, v, a, double_of(word(j, 3 + 3 * n)), double_of(word(j, 4 + 3 * n)),
                    double_of(word(j, 5 + 3 * n)), 64 + numel / 64 + 2);
      if (!c.differs) continue;
      throw Error(cat("Verified collectives: reduce-scatter #", t + 1, " of ", when, ", of module ",
                      module(group), " (", numel, " elements per rank", part,
                      "): the reduced gradient shard on rank ", j,
                      " differs from the sum of the blocks the ranks sent it by ", c.difference,
                      " in a random projection, where the rounding of the sum allows at most ",
                      c.bound, ". A block was corrupted on its way to rank ", j,
                      " or in its sum (a sum cannot tell which rank's block), so the optimizer "
                      "would step on a wrong gradient; every rank stops here. ",
                      kHowToTurnOff));
    }
  }
  // Only the window's totals differ (collectives past the recorded ones, or errors within each
  // collective's bound that add up): named by the ranks alone.
  for (int x = 0; x < n; ++x)
    for (int r = 0; r < n; ++r) {
      if (r != x && rows[x][at.received() + r] != rows[r][at.sent() + x])
        throw Error(cat("Verified collectives: in the all-gathers of ", when, ", the bytes rank ",
                        r, " sent arrived different on rank ", x,
                        ". They were corrupted between the ranks; every rank stops here. ",
                        kHowToTurnOff));
      if (r != x && rows[x][at.wire_received() + r] != rows[r][at.wire_sent() + x])
        throw Error(cat("Verified collectives: in the reduce-scatters of ", when,
                        ", the bytes rank ", r, " sent to rank ", x,
                        " arrived different. They were corrupted between the ranks; every rank "
                        "stops here. ",
                        kHowToTurnOff));
    }
  throw Error(cat("Verified collectives: in the reduce-scatters of ", when,
                  ", a reduced gradient shard differs from the sum of the blocks the ranks sent "
                  "beyond the rounding of the sums; every rank stops here. ",
                  kHowToTurnOff));
}

}  // namespace fsdp::detail
