// VerifiedCollectives: what each collective folds into the window (this file) and the check of
// every rank's rows with its error (verified_check.cpp).
#include "core/verified.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <atomic>
#include <chrono>
#include <cmath>

#include "core/content_faults.h"
#include "core/payload_digest.h"
#include "core/verified_state.h"
#include "util/checksum.h"

namespace fsdp::detail {

namespace {
// Pair sums are of H(k, digest): the collective's place in the window enters each term, so that
// two collectives' digests cannot trade places unnoticed.
uint64_t keyed(int64_t index, uint64_t digest, uint64_t salt) {
  const uint64_t w[3] = {static_cast<uint64_t>(index), digest, salt};
  return checksum_bytes(w, sizeof(w));
}
constexpr uint64_t kGatherSalt = 0x6761746865720001ULL, kWireSalt = 0x7769726500000002ULL;

// The rounding of a reduce-scatter's sum (comm/rank_order_sum.h): accumulated in `acc` (fp32, or
// fp64 for fp64), written in the output dtype. u: unit roundoff; eta: the absolute error of one
// rounding into subnormals (half the smallest subnormal, doubled for margin).
struct Rounding {
  double u_acc, eta_acc, u_out, eta_out;
};
Rounding rounding_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return {0x1p-53, 0x1p-1074, 0, 0};
    case at::kBFloat16:
      return {0x1p-24, 0x1p-149, 0x1p-8, 0x1p-133};
    case at::kHalf:
      return {0x1p-24, 0x1p-149, 0x1p-11, 0x1p-24};
    default:
      return {0x1p-24, 0x1p-149, 0, 0};
  }
}
double gamma_of(int64_t k, double u) { return static_cast<double>(k) * u / (1 - k * u); }

std::atomic<int64_t> g_checks_passed{0};
std::atomic<int64_t> g_busy_ns{0};  // time spent digesting and sketching, this process
}  // namespace

VerifiedCollectives::Timed::Timed()
    : start_ns(std::chrono::steady_clock::now().time_since_epoch().count()) {}
VerifiedCollectives::Timed::~Timed() {
  g_busy_ns.fetch_add(std::chrono::steady_clock::now().time_since_epoch().count() - start_ns);
}
double VerifiedCollectives::seconds_spent() { return static_cast<double>(g_busy_ns.load()) * 1e-9; }

int64_t VerifiedCollectives::checks_passed() { return g_checks_passed.load(); }
void VerifiedCollectives::count_passed() { g_checks_passed.fetch_add(1); }

VerifiedCollectives::Window::Window(int n)
    : sent(n, 0),
      received(n, 0),
      wire_sent(n, 0),
      wire_received(n, 0),
      sketch(n, 0),
      var(n, 0),
      abs(n, 0) {}

VerifiedCollectives::VerifiedCollectives(std::shared_ptr<Communicator> agree, Names names)
    : agree_(std::move(agree)),
      names_(std::move(names)),
      n_(agree_->size()),
      me_(agree_->rank()),
      state_(std::make_shared<State>(n_, me_)) {}

VerifiedCollectives::~VerifiedCollectives() = default;

void VerifiedCollectives::configure(Settings s) {
  FSDP_CHECK(s.period >= 1, "RuntimeOptions::verify_period is ", s.period,
             "; it must be at least 1 (1 checks every byte of every collective)");
  MutexLock lock(state_->mu);
  state_->settings = s;
  // One rank: nothing crosses a wire, and the Agreed exchange (which carries the rows) is skipped.
  state_->active = s.enabled && n_ > 1;
}

VerifiedCollectives::Settings VerifiedCollectives::settings() const {
  MutexLock lock(state_->mu);
  return state_->settings;
}

void VerifiedCollectives::begin_check(bool backward) { backward_check_ = backward; }

namespace {
using State = VerifiedCollectives::State;
// `work` with `step` run once when it completes, unless a check came first.
Work watched(const std::shared_ptr<State>& st, const Work& work, std::function<void()> step)
    FSDP_REQUIRES(st->mu) {
  auto pending = std::make_shared<State::Pending>();
  st->pending.push_back(pending);
  return work.then([st, pending, step = std::move(step)] {
    MutexLock lock(st->mu);
    if (pending->orphaned) return;
    pending->done = true;
    step();
  });
}

// The lane of `k` ranks a collective travels on: the shard group (k = N) or an hpZ post-forward
// lane, whose ranks are k consecutive ranks of the shard group (fully_shard.cpp).
int lane_first(int me, int k) { return me / k * k; }

// The test fault (core/content_faults.h) on the bytes from its rank as they arrive here.
void corrupt_gathered(int64_t total, int first, int me,
                      const std::vector<std::vector<at::Tensor>>& blocks) {
  const auto& f = content_faults::active();
  if (f.where != content_faults::Where::kGatheredBlock || f.collective != total) return;
  const int from = f.rank - first;
  if (f.rank == me || from < 0 || from >= static_cast<int>(blocks.size())) return;
  content_faults::flip(f, blocks[from]);
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// All-gathers
// ---------------------------------------------------------------------------------------------
void State::fold_gather(int64_t position, int64_t group, int first,
                        const std::vector<uint64_t>& digests, int64_t bytes) {
  const int k = static_cast<int>(digests.size()), mine = me - first;
  for (int r = 0; r < k; ++r) {
    if (r == mine) continue;
    window.received[first + r] += keyed(position, digests[r], kGatherSalt);
    window.sent[first + r] += keyed(position, digests[mine], kGatherSalt);
  }
  if (window.gathers.size() < static_cast<size_t>(AgreedLog::kMaxRecorded)) {
    GatherRecord rec{group, bytes, std::vector<uint64_t>(n, 0)};
    for (int r = 0; r < k; ++r) rec.digests[first + r] = digests[r];
    window.gathers.push_back(std::move(rec));
  }
}

Work VerifiedCollectives::issued_all_gather(const Collective& c, const at::Tensor& out,
                                            const at::Tensor& in, Work work) {
  std::vector<std::vector<at::Tensor>> blocks;
  if (in.numel() > 0) {
    const int64_t k = out.numel() / in.numel();
    const at::Tensor flat = out.view({-1});
    for (int64_t r = 0; r < k; ++r) blocks.push_back({flat.narrow(0, r * in.numel(), in.numel())});
  }
  return issued_all_gather_into(c, blocks, {in}, std::move(work));
}

// Each rank digests its own block of the result (what it sent, as a custom all-gather that
// rounds delivers it too) and every peer's block as it arrived.
Work VerifiedCollectives::issued_all_gather_into(const Collective& c,
                                                 const std::vector<std::vector<at::Tensor>>& places,
                                                 const std::vector<at::Tensor>& pieces, Work work) {
  const auto& st = state_;
  MutexLock lock(st->mu);
  const int64_t total = st->gathers_issued++;  // the same on every rank: the lanes' order agrees
  if (!st->active) return work;
  const int k = static_cast<int>(places.size());
  if (k < 1 || n_ % k != 0) return work;
  // Each block's part by its own size: a gather into places may hold fewer rows (or none) from
  // some ranks; whether anything moved is decided over all of them, alike on every rank.
  std::vector<Part> parts;
  int64_t moved = 0;
  for (const auto& block : places) {
    int64_t n = 0;
    for (const auto& t : block) n += static_cast<int64_t>(t.nbytes());
    moved += n;
    parts.push_back(rotating_part(n, st->step, c.group, st->settings.period));
  }
  if (moved == 0) return work;
  (void)pieces;
  const int first = lane_first(me_, k);
  const int64_t bytes = moved / k;
  State* s = st.get();  // kept alive by the step's own copy (watched)
  return watched(st, work, [s, places, first, parts, total, group = c.group, bytes] {
    s->mu.assert_held();  // watched() runs every step under mu
    Timed timed;
    corrupt_gathered(total, first, s->me, places);
    std::vector<uint64_t> digests;
    for (size_t r = 0; r < places.size(); ++r) digests.push_back(digest_bytes(places[r], parts[r]));
    s->fold_gather(total, group, first, digests, bytes);
  });
}

// ---------------------------------------------------------------------------------------------
// Reduce-scatters
// ---------------------------------------------------------------------------------------------
// [Note: verified collectives] Per element, |m o_i - sum_s b_si| <= gamma(N-1) sum_s |b_si|
// + c m |o_i| + e: each sender carries 3 gamma(N-1)^2 N sum_i b_si^2 of the variance bound for
// the block it sends, the receiver 3 (c^2 m^2 sum_i o_i^2 + n e^2) for its output.
void VerifiedCollectives::issuing_reduce_scatter(const Collective& c, const at::Tensor& out,
                                                 const at::Tensor& in, ReduceOp op,
                                                 const ReduceScatter* custom) {
  State& st = *state_;
  MutexLock lock(st.mu);
  auto& is = st.issuing;
  is = State::Issuing{};
  is.total = st.reduces_issued++;
  if (!st.active) return;
  is.custom = custom != nullptr;
  const int64_t n = out.numel();
  if (n == 0 || in.numel() != n_ * n) return;
  is.numel = n;
  is.record = st.window.reduces.size();
  if (is.record < static_cast<size_t>(AgreedLog::kMaxRecorded))
    st.window.reduces.push_back(ReduceRecord{c.group,
                                             n,
                                             custom ? 1 : 0,
                                             std::vector<double>(n_),
                                             std::vector<double>(n_),
                                             std::vector<double>(n_),
                                             0,
                                             0,
                                             0,
                                             {},
                                             {}});
  if (custom) return;  // checked by the digests of its wire, once it completed
  is.sketched = true;
  Timed timed;
  const Rounding r = rounding_of(in.scalar_type());
  const bool average = op == ReduceOp::kAvg;
  is.scale = average ? n_ : 1;
  const Part part = rotating_part(n, st.step, c.group, st.settings.period);
  is.lo = part.lo;
  is.hi = part.hi;
  const uint64_t key[3] = {static_cast<uint64_t>(st.step), static_cast<uint64_t>(is.total),
                           0x736b657463680003ULL};
  is.seed = checksum_bytes(key, sizeof(key));
  const double g = gamma_of(n_ - 1, r.u_acc);
  is.out_gamma = 1.01 * ((average ? r.u_acc : 0) + r.u_out);
  is.out_absolute = is.scale * ((n_ + 1) * r.eta_acc + r.eta_out);
  ReduceRecord* rec =
      is.record < st.window.reduces.size() ? &st.window.reduces[is.record] : nullptr;
  const at::Tensor flat = in.view({-1});
  for (int j = 0; j < n_; ++j) {
    const Sketch s = sketch_values(flat.narrow(0, j * n, n), part, is.seed);
    const double var = 3 * g * g * n_ * s.square_sum;
    st.window.sketch[j] += s.signed_sum;
    st.window.var[j] += var;
    st.window.abs[j] += s.abs_sum;
    if (rec) {
      rec->sketch[j] = s.signed_sum;
      rec->var[j] = var;
      rec->abs[j] = s.abs_sum;
    }
  }
  ++st.window.sketched;
  st.window.max_terms = std::max(st.window.max_terms, 64 + part.size() / 64 + 2);
  // The test fault: a bit of the block sent to the next rank, once sketched.
  const auto& f = content_faults::active();
  if (f.where == content_faults::Where::kSentBlock && f.collective == is.total && f.rank == me_)
    content_faults::flip(f, {flat.narrow(0, ((me_ + 1) % n_) * n, n)});
}

void State::fold_wire(const Issuing& is, const Work::Digests* d) {
  if (!d || d->sent.size() != static_cast<size_t>(n) ||
      d->received.size() != static_cast<size_t>(n)) {
    ++window.unchecked;
    return;
  }
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    window.wire_sent[j] += keyed(is.total, d->sent[j], kWireSalt);
    window.wire_received[j] += keyed(is.total, d->received[j], kWireSalt);
  }
  if (is.record < window.reduces.size()) {
    window.reduces[is.record].wire_sent = d->sent;
    window.reduces[is.record].wire_received = d->received;
  }
}

void State::fold_output(const Issuing& is, const at::Tensor& out) {
  Timed timed;
  const at::Tensor flat = out.view({-1});
  const auto& f = content_faults::active();
  if (f.where == content_faults::Where::kReducedValue && f.collective == is.total && f.rank == me)
    content_faults::flip(f, {flat});
  const Sketch s = sketch_values(flat, Part{is.lo, is.hi}, is.seed);
  const double sketch = is.scale * s.signed_sum, abs = is.scale * s.abs_sum;
  const double c = is.out_gamma * is.scale, e = is.out_absolute;
  const double var = 3 * (c * c * s.square_sum + static_cast<double>(is.hi - is.lo) * e * e);
  window.out_sketch += sketch;
  window.out_abs += abs;
  window.out_var += var;
  if (is.record < window.reduces.size()) {
    window.reduces[is.record].out_sketch = sketch;
    window.reduces[is.record].out_abs = abs;
    window.reduces[is.record].out_var = var;
  }
}

bool VerifiedCollectives::digests_reduce_scatter(const Collective&, ReceivedChunkHook* hook,
                                                 WireSpan* span) {
  MutexLock lock(state_->mu);
  const State::Issuing is = state_->issuing;
  if (!state_->active || !is.sketched) return false;
  // The wire's digests cover the rotating part the sketches cover (every element at period 1).
  *span = WireSpan{is.lo, is.hi};
  // The test fault: a bit of the block from its rank, as it arrives on the next rank.
  const auto& f = content_faults::active();
  if (f.where == content_faults::Where::kReceivedBlock && f.collective == is.total &&
      me_ == (f.rank + 1) % n_) {
    const int64_t element = ((f.element % is.numel) + is.numel) % is.numel;
    *hook = [f, element](int from, int64_t offset, const at::Tensor& chunk) {
      if (from != f.rank || element < offset || element >= offset + chunk.numel()) return;
      content_faults::Fault at = f;
      at.element = element - offset;
      content_faults::flip(at, {chunk});
    };
  }
  return true;
}

Work VerifiedCollectives::issued_reduce_scatter(const Collective&, const at::Tensor& out,
                                                const at::Tensor&, Work work) {
  const auto& st = state_;
  MutexLock lock(st->mu);
  if (!st->active || out.numel() == 0) return work;
  const State::Issuing is = st->issuing;
  State* s = st.get();
  // A custom collective: checked by the digests of its wire it attached to its Work, if any.
  if (is.custom)
    return watched(st, work, [s, work, is] {
      s->mu.assert_held();  // watched() runs every step under mu
      s->fold_wire(is, work.digests().get());
    });
  if (!is.sketched) return work;
  // The communicator's: its wire's digests (exact) and the sketch of its sum.
  return watched(st, work, [s, out, is, work] {
    s->mu.assert_held();
    s->fold_wire(is, work.digests().get());
    s->fold_output(is, out);
  });
}

}  // namespace fsdp::detail
