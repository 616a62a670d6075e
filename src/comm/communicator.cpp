// Communicator: construction, the transport chosen once (FSDP_TRANSPORT), lanes, statistics and
// the bookkeeping of each Work. The collectives themselves are in collectives.cpp.
#include <fsdp/communicator.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>

#include <algorithm>
#include <optional>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "communicator_impl.h"
#include "compat.h"
#include "failure.h"
#include "gloo_exchange.h"
#include "shm_exchange.h"
#include "util/env.h"
#include "work_impl.h"

namespace fsdp {

const char* to_string(Transport t) {
  switch (t) {
    case Transport::kShm:
      return "shm";
    case Transport::kTcp:
      return "tcp";
    case Transport::kCollective:
      return "collective";
  }
  return "?";
}

namespace {
std::optional<Transport> requested_transport();
}  // namespace

Communicator::Communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                           c10::intrusive_ptr<c10d::Store> store, std::string backend,
                           std::chrono::milliseconds timeout, std::string name,
                           std::string bind_host, std::vector<PeerInfo> peers)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.pg = std::move(pg);
  m.store = std::move(store);
  m.backend = std::move(backend);
  m.timeout = timeout;
  m.name = std::move(name);
  m.bind_host = std::move(bind_host);
  m.rank = m.pg->getRank();
  m.size = m.pg->getSize();
  m.peers = std::make_shared<const std::vector<PeerInfo>>(std::move(peers));
  m.requested = requested_transport();
  m.connect_transport();
}

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  impl_->connect_transport();
}

Communicator::~Communicator() {
  if (impl_->parent_retired) *impl_->parent_retired += total_stats();
  // The exchange workers stop first: they use the process group.
  impl_->gathers.reset();
  impl_->reductions.reset();
  // See "Broken groups" (work_impl.h): joining Gloo's workers mid-collective would wait out
  // their timeouts.
  if (!detail::broken_reason(impl_->store.get()).empty())
    detail::keep_undestroyed(std::move(impl_->pg));
}

int Communicator::rank() const { return impl_->rank; }
int Communicator::size() const { return impl_->size; }
const std::string& Communicator::name() const { return impl_->name; }
const std::string& Communicator::backend() const { return impl_->backend; }
std::chrono::milliseconds Communicator::timeout() const { return impl_->timeout; }
void Communicator::set_timeout(std::chrono::milliseconds t) { impl_->timeout = t; }
Transport Communicator::transport() const { return impl_->transport; }
const c10::intrusive_ptr<c10d::ProcessGroup>& Communicator::process_group() const {
  return impl_->pg;
}
const std::vector<PeerInfo>& Communicator::peers() const { return *impl_->peers; }
const CommStats& Communicator::stats() const { return *impl_->stats; }

// ---------------------------------------------------------------------------------------------
// The transport
// ---------------------------------------------------------------------------------------------
namespace {

// FSDP_TRANSPORT, read when a communicator is constructed from a process group and by split() and
// subgroup(); a lane keeps its communicator's choice. nullopt: auto.
std::optional<Transport> requested_transport() {
  const std::string v =
      detail::env_choice("FSDP_TRANSPORT", {"auto", "shm", "tcp", "collective"}, "auto");
  if (v == "shm") return Transport::kShm;
  if (v == "tcp") return Transport::kTcp;
  if (v == "collective") return Transport::kCollective;
  return std::nullopt;
}

// The first peer on another host than this one, if any.
const PeerInfo* peer_elsewhere(const std::vector<PeerInfo>& peers) {
  const std::string here = detail::this_host();
  for (const auto& p : peers)
    if (p.host != here) return &p;
  return nullptr;
}

}  // namespace

void Communicator::Impl::connect_transport() {
  if (size == 1 || backend != "gloo" || requested == Transport::kCollective) {
    FSDP_CHECK(size == 1 || !requested || requested == Transport::kCollective,
               "FSDP_TRANSPORT=", to_string(*requested),
               " needs the gloo backend, but communicator '", name, "' uses ", backend,
               "; unset FSDP_TRANSPORT (auto) or set it to collective");
    transport = Transport::kCollective;
    return;
  }
  auto over_tcp = [&](int tag_offset) {
    return std::make_unique<detail::ExchangeWorker>(
        std::make_unique<detail::GlooExchange>(pg, tag_offset));
  };
  const PeerInfo* elsewhere = peer_elsewhere(*peers);
  FSDP_CHECK(requested != Transport::kShm || !elsewhere, "FSDP_TRANSPORT=shm: rank ",
             elsewhere ? elsewhere->rank : 0, " of communicator '", name, "' is on host '",
             elsewhere ? elsewhere->host : "", "', not '", detail::this_host(),
             "'; shared memory needs every rank on one host (unset FSDP_TRANSPORT or set it to "
             "tcp)");
  std::unique_ptr<detail::ShmExchange> gather_shm, reduce_shm;
  if (requested != Transport::kTcp && !elsewhere) {
    const bool required = requested == Transport::kShm;
    gather_shm =
        detail::ShmExchange::connect(*store, name + "/gather", rank, size, required, timeout);
    // Every rank alike: if the first cannot connect, shared memory cannot serve this group.
    if (gather_shm)
      reduce_shm =
          detail::ShmExchange::connect(*store, name + "/reduce", rank, size, required, timeout);
  }
  if (gather_shm && reduce_shm) {
    transport = Transport::kShm;
    gathers = std::make_unique<detail::ExchangeWorker>(std::move(gather_shm));
    reductions = std::make_unique<detail::ExchangeWorker>(std::move(reduce_shm));
    return;
  }
  // Disjoint tag ranges: both exchanges send on the one process group.
  transport = Transport::kTcp;
  gathers = over_tcp(detail::GlooExchange::kTagRange);
  reductions = over_tcp(0);
}

// ---------------------------------------------------------------------------------------------
// Work bookkeeping
// ---------------------------------------------------------------------------------------------
Work Communicator::Impl::make_work(std::vector<c10::intrusive_ptr<c10d::Work>> works,
                                   const std::string& op, int64_t bytes,
                                   std::function<void()> finish) {
  auto w = std::make_shared<Work::Impl>();
  w->works = std::move(works);
  w->finish = std::move(finish);
  w->timeout = timeout;
  w->stats = stats;
  w->op = op;
  w->lane = name;
  w->issued_us = trace::now_us();
  w->peers = peers;
  w->rank = rank;
  w->group = store.get();
  w->store = store;
  w->size = size;
  w->what = detail::cat(op, " of ", bytes, " bytes on communicator '", name, "' (rank ", rank,
                        " of ranks 0..", size - 1, ")");
  stats->collectives++;
  if (trace::enabled()) {
    // The collective's own span, from issue to completion (the future completes on the
    // backend's thread), on one timeline row per communication lane.
    for (auto& cw : w->works) {
      try {
        cw->getFuture()->addCallback(
            [op = w->op, track = "comm " + name, start = w->issued_us](c10::ivalue::Future&) {
              trace::complete(op, "comm", start, trace::now_us() - start, track);
            });
      } catch (const std::exception&) {
        // A backend without futures: the wait spans still show the exposed time.
      }
    }
  }
  return Work(std::move(w));
}

// ---------------------------------------------------------------------------------------------
// Lanes and subgroups
// ---------------------------------------------------------------------------------------------
namespace {
std::string bracketed_ranks(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  return s + "]";
}
}  // namespace

std::shared_ptr<Communicator> Communicator::Impl::child(const std::string& label,
                                                        const std::vector<int>& ranks,
                                                        std::optional<Transport> want) {
  const std::string key =
      detail::cat(name, "/", label, ranks.empty() ? "" : bracketed_ranks(ranks));
  const std::string prefix = detail::cat(key, "#", splits[key]++);
  auto c = std::make_unique<Impl>();
  c->rank = rank;
  c->size = size;
  std::vector<PeerInfo> sub = *peers;
  if (!ranks.empty()) {
    c->rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
    c->size = static_cast<int>(ranks.size());
    sub.clear();
    if (!peers->empty())
      for (int r : ranks) sub.push_back((*peers)[r]);
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
  c->pg = compat::make_process_group(prefixed, c->rank, c->size, timeout, backend, bind_host);
  // Gloo's full-mesh connect can return on one rank while a peer is still reading its handshake: a
  // communicator destroyed at once (a temporary split) then closed that socket under the peer,
  // whose connect failed with "Connection closed by peer". A barrier ends the construction only
  // once every rank is connected (NCCL connects lazily, at its first collective).
  if (backend == "gloo" && c->size > 1) c->pg->barrier()->wait(timeout);
  c->store = store;
  c->backend = backend;
  c->timeout = timeout;
  c->name = prefix;
  c->bind_host = bind_host;
  c->peers = std::make_shared<const std::vector<PeerInfo>>(std::move(sub));
  c->requested = want;
  c->loss = loss;
  return std::make_shared<Communicator>(std::move(c));
}

void Communicator::adopt(const std::shared_ptr<Communicator>& child) {
  auto& kids = impl_->children;
  kids.erase(std::remove_if(kids.begin(), kids.end(), [](const auto& w) { return w.expired(); }),
             kids.end());
  kids.push_back(child);
  child->impl_->parent_retired = impl_->retired;
}

std::shared_ptr<Communicator> Communicator::split(const std::string& name) {
  auto c = impl_->child(name, {}, requested_transport());
  adopt(c);
  return c;
}

std::shared_ptr<Communicator> Communicator::subgroup(const std::string& name,
                                                     const std::vector<int>& ranks) {
  check_subgroup(name, ranks);
  auto c = impl_->child(name, ranks, requested_transport());
  adopt(c);
  return c;
}

std::shared_ptr<Communicator> Communicator::lane(const std::string& name,
                                                 const std::vector<int>& ranks) {
  const std::string key = name + bracketed_ranks(ranks);
  auto it = impl_->lanes.find(key);
  if (it != impl_->lanes.end()) return it->second;
  check_subgroup(name, ranks);
  auto c = impl_->child(name, ranks, impl_->requested);
  impl_->lanes.emplace(key, c);
  return c;
}

void Communicator::check_subgroup(const std::string& name, const std::vector<int>& ranks) const {
  const Impl& m = *impl_;
  FSDP_CHECK(std::find(ranks.begin(), ranks.end(), m.rank) != ranks.end(), "subgroup '", name,
             "': this rank (", m.rank, ") is not in the list ", bracketed_ranks(ranks),
             "; only the ranks of a subgroup may create it");
  for (size_t i = 0; i < ranks.size(); ++i)
    FSDP_CHECK(ranks[i] >= 0 && ranks[i] < m.size && (i == 0 || ranks[i] > ranks[i - 1]),
               "subgroup '", name, "': ranks ", bracketed_ranks(ranks),
               " must be ascending ranks of the ", m.size, "-rank communicator '", m.name, "'");
}

std::shared_ptr<Communicator> Communicator::lane(const std::string& name) {
  auto it = impl_->lanes.find(name);
  if (it != impl_->lanes.end()) return it->second;
  // Built first, entered after: a lane whose connection fails leaves no empty entry behind.
  auto c = impl_->child(name, {}, impl_->requested);
  impl_->lanes.emplace(name, c);
  return c;
}

CommStats Communicator::total_stats() const {
  CommStats s = *impl_->stats;
  s += *impl_->retired;
  for (const auto& [name, lane] : impl_->lanes) s += lane->total_stats();
  for (const auto& weak : impl_->children)
    if (auto c = weak.lock()) s += c->total_stats();
  return s;
}

void Communicator::reset_stats() {
  *impl_->stats = CommStats{};
  *impl_->retired = CommStats{};
  for (auto& [name, lane] : impl_->lanes) lane->reset_stats();
  for (const auto& weak : impl_->children)
    if (auto c = weak.lock()) c->reset_stats();
}

}  // namespace fsdp
