// ElasticReplicas: the replica's side of an elastic job (fsdp/elastic.h). The leader (rank 0)
// speaks for the replica in the coordinator (membership.h) and shares each decision with its
// ranks; every rank builds its own position's replicate lane for each membership.
#include <ATen/ATen.h>
#include <fsdp/elastic.h>
#include <fsdp/error.h>
#include <fsdp/state_dict.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <exception>
#include <optional>
#include <sstream>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/address.h"
#include "comm/communicator_impl.h"
#include "comm/failure.h"
#include "comm/lane_loss.h"
#include "compat.h"
#include "elastic/membership.h"
#include "util/env.h"

namespace fsdp {
namespace detail {

using Clock = std::chrono::steady_clock;

struct ElasticState {
  std::shared_ptr<Communicator> world;  // this replica's ranks
  int64_t shared = 0;                   // messages shared from rank 0 (share())
  ElasticOptions options;
  c10::intrusive_ptr<c10d::Store> coordinator;      // "fsdp.elastic/" keys of the coordinator
  c10::intrusive_ptr<c10d::Store> heartbeat_store;  // the heartbeat thread's connection
  std::unique_ptr<Membership> membership;           // the leader's
  std::unique_ptr<Heartbeat> heartbeat;             // the leader's, once it has a ticket
  int64_t ticket = 0;                               // this replica's, shared by its ranks
  Decision current;                                 // the membership now
  int64_t attempt = 0;                              // votes taken in the current epoch
  int64_t bound_epoch = 0;                          // whose lanes the model carries
  bool is_new = true;                               // has not yet copied a member's state
  int64_t fruitless = 0;     // attempts thrown away in a row with the members unchanged
  std::string lane_failure;  // why the last of them failed
  std::shared_ptr<Communicator> solo, lane;
  // The address the lanes bind and advertise: this host's route to the coordinator (which every
  // replica reaches), not the replica's own rendezvous address (loopback for a one-rank replica).
  std::string lane_host;
  ElasticReplicas::Stats stats;
};

namespace {

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Rank 0's `text` on every rank of the replica, through the replica's own store rather than a
// collective: rank 0 may take longer than a collective's timeout to have it (waiting to be
// admitted, or for a member's vote), and the others wait on the store for up to `wait`. Each
// message has the next number of the sequence, the same on every rank; the one before the
// previous is deleted (every rank has read it: a step's collectives came between).
std::string share(ElasticState& s, const std::string& text, std::chrono::milliseconds wait);

std::string share(ElasticState& s, const std::string& text, std::chrono::milliseconds wait) {
  c10d::Store& store = *s.world->impl().store;
  const int64_t n = ++s.shared;
  const std::string key = cat("fsdp.elastic.share/", n);
  if (s.world->rank() == 0) {
    store.set(key, std::vector<uint8_t>(text.begin(), text.end()));
    if (n > 2) store.deleteKey(cat("fsdp.elastic.share/", n - 2));
    return text;
  }
  try {
    store.wait({key}, wait);
  } catch (const std::exception& e) {
    throw CommError(cat("elastic: rank ", s.world->rank(), " of replica ", s.options.replica_id,
                        " did not get its rank 0's word on the membership (waiting at most ",
                        wait.count() / 1000.0, " s): ", e.what(),
                        "; its rank 0 has stopped (see its output) or is hung"));
  }
  const auto b = store.get(key);
  return {b.begin(), b.end()};
}

// Communicators of lanes replaced after a loss: their abandoned collectives may still be finishing
// on Gloo's threads, which destroying them would join (each waiting out its timeout). Kept for the
// life of the process, reachable.
std::vector<std::shared_ptr<Communicator>>& retired_lanes() {
  static auto* lanes = new std::vector<std::shared_ptr<Communicator>>();
  return *lanes;
}

std::shared_ptr<Communicator> lossy_communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                 c10::intrusive_ptr<c10d::Store> store,
                                                 const Communicator& world, const std::string& name,
                                                 const std::string& host) {
  auto impl = std::make_unique<Communicator::Impl>();
  impl->rank = pg->getRank();
  impl->size = pg->getSize();
  impl->pg = std::move(pg);
  impl->store = std::move(store);
  impl->backend = "gloo";
  // Half the replica's timeout: a collective with a hung replica gives up (and stands in) while
  // this replica's own collectives, whose ranks may be waiting for this one, still wait.
  impl->timeout = world.timeout() / 2;
  impl->name = name;
  impl->bind_host = host;
  impl->peers = std::make_shared<const std::vector<PeerInfo>>();
  impl->requested = Transport::kCollective;  // the backend's collectives only (lane_loss.h)
  impl->loss = std::make_shared<LaneLoss>();
  return std::make_shared<Communicator>(std::move(impl));
}

// The lane of this rank's shard position over `d`'s members; null when it cannot be connected (a
// member died since the decision): the caller stands in a lost one.
std::shared_ptr<Communicator> connect_lane(const ElasticState& s, const Decision& d) {
  const Communicator& w = *s.world;
  auto store =
      c10::make_intrusive<c10d::PrefixStore>(cat("e", d.epoch, "/p", w.rank()), s.coordinator);
  const auto timeout = w.timeout() / 2;  // as the lane's collectives (lossy_communicator)
  try {
    auto pg =
        compat::make_process_group(store, d.index_of(s.ticket), static_cast<int>(d.members.size()),
                                   timeout, "gloo", s.lane_host);
    if (pg->getSize() > 1) pg->barrier()->wait(timeout);
    auto lane =
        lossy_communicator(std::move(pg), store, w, cat("replicas.e", d.epoch), s.lane_host);
    // The model's lanes of it (CommContext::rebind_replicate), connected here: a member lost now
    // fails this connection, not the rebind.
    lane->lane("fsdp.replicate");
    lane->lane("fsdp.agree");
    return lane;
  } catch (const std::exception& e) {
    std::cerr << cat("fsdp elastic: replica ", s.options.replica_id, " rank ", w.rank(),
                     ": the lane of membership ", d.epoch, " did not connect (", e.what(),
                     "); this step will be run again\n");
    return nullptr;
  }
}

// Whether every rank of the replica connected its position's lane (the replica's store: a rank
// whose connection failed at once must not go on while another still waits on its own).
bool all_connected(ElasticState& s, bool mine) {
  c10d::Store& store = *s.world->impl().store;
  const int64_t n = ++s.shared;
  const std::string key = cat("fsdp.elastic.connected/", n);
  store.set(cat(key, "/", s.world->rank()), std::vector<uint8_t>{mine ? uint8_t{1} : uint8_t{0}});
  bool all = true;
  for (int r = 0; r < s.world->size(); ++r) {
    const std::string k = cat(key, "/", r);
    try {
      store.wait({k}, 2 * s.world->timeout());
    } catch (const std::exception& e) {
      throw CommError(cat("elastic: rank ", s.world->rank(), " of replica ", s.options.replica_id,
                          " did not hear from rank ", r,
                          " whether its lanes of the new membership connected (waiting at most ",
                          2 * s.world->timeout().count() / 1000.0, " s): ", e.what(),
                          "; that rank is stuck or gone, and this replica stops: restart it to "
                          "join again"));
    }
    all = all && store.get(k) == std::vector<uint8_t>{1};
  }
  return all;
}

std::shared_ptr<Communicator> solo_communicator(const Communicator& world, bool lost) {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  auto pg = compat::make_process_group(store, 0, 1, world.timeout(), "gloo", "127.0.0.1");
  auto c = lossy_communicator(std::move(pg), store, world, "replicas.solo", "127.0.0.1");
  if (lost) c->impl().loss->mark("the lane of this membership did not connect");
  return c;
}

// The parameters' and buffers' count, shapes and dtypes, as one number.
int64_t layout_digest(const std::vector<at::Tensor>& params,
                      const std::vector<std::pair<std::string, at::Tensor>>& buffers) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](int64_t v) { h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull; };
  auto add = [&](const at::Tensor& t) {
    mix(static_cast<int64_t>(t.scalar_type()));
    mix(t.dim());
    for (int64_t d : t.sizes()) mix(d);
  };
  mix(static_cast<int64_t>(params.size()));
  for (const auto& p : params) add(p);
  mix(static_cast<int64_t>(buffers.size()));
  for (const auto& b : buffers) add(b.second);
  return static_cast<int64_t>(h >> 1);
}

std::string optimizer_bytes(torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive archive;
  opt.save(archive);
  std::ostringstream os;
  archive.save_to(os);
  return os.str();
}

// The source's state onto every member at this position (the new ones keep it).
void copy_state(ElasticState& s, FSDPModule& model, torch::optim::Optimizer& opt,
                std::vector<int64_t>& user_state) {
  Communicator& lane = *s.lane;
  const int root = s.current.index_of(s.current.source);
  const bool keep = s.is_new && s.current.source != s.ticket;
  torch::NoGradGuard no_grad;
  auto send = [&](const at::Tensor& t) {
    at::Tensor c = t.contiguous();
    lane.broadcast(c, root).wait();
    if (keep && !c.is_same(t)) t.copy_(c);
  };
  // What is copied must have one layout everywhere: checked by the receivers before any tensor
  // crosses (a sender goes on; a receiver that stops closes its connections, which the sender's
  // lane stands in for).
  const auto params = model.parameters();
  const auto buffers = named_buffers(model);
  auto layout = at::tensor(
      std::vector<int64_t>{layout_digest(params, buffers), static_cast<int64_t>(user_state.size())},
      at::kLong);
  const auto mine = layout.clone();
  lane.broadcast(layout, root).wait();
  if (keep && !lane.impl().loss->lost()) {
    FSDP_CHECK(layout[0].item<int64_t>() == mine[0].item<int64_t>(), "elastic: replica ",
               s.options.replica_id,
               " cannot copy its state from the member it joins: their models differ (the "
               "parameters' or buffers' count, shapes or dtypes); every replica must build the "
               "same model");
    FSDP_CHECK(layout[1].item<int64_t>() == mine[1].item<int64_t>(), "elastic: replica ",
               s.options.replica_id, "'s user_state has ", user_state.size(),
               " values but the member whose state it copies has ", layout[1].item<int64_t>(),
               "; every replica must pass the same state to sync()");
  }
  for (const at::Tensor& p : params) send(p);
  for (const auto& [name, b] : buffers) send(b);
  auto user = at::tensor(user_state, at::kLong);
  send(user);
  std::string bytes = lane.rank() == root ? optimizer_bytes(opt) : std::string();
  auto len = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong);
  lane.broadcast(len, root).wait();
  auto buf = at::empty({len.item<int64_t>()}, at::kByte);
  if (lane.rank() == root) std::memcpy(buf.data_ptr(), bytes.data(), bytes.size());
  send(buf);
  if (!keep || lane.impl().loss->lost()) return;
  user_state.assign(user.data_ptr<int64_t>(), user.data_ptr<int64_t>() + user.numel());
  std::istringstream is(
      std::string(static_cast<const char*>(buf.data_ptr()), static_cast<size_t>(buf.numel())));
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(is);
    opt.load(archive);
  } catch (const c10::Error& e) {
    throw Error(cat("elastic: replica ", s.options.replica_id,
                    " could not load the optimizer state of the member it joins (",
                    e.what_without_backtrace(),
                    "); every replica must build the same optimizer, with the same parameter "
                    "groups"));
  }
}

// Consecutive attempts that may be thrown away with the members unchanged before the job stops.
constexpr int64_t kMaxFruitlessAttempts = 5;

std::string ids_of(const Decision& d) {
  std::string out;
  for (const auto& m : d.members) out += (out.empty() ? "" : ", ") + std::to_string(m.id);
  return out;
}

// The replica's processes on its leader's host: a pid is only probed on the host it runs on (a
// replica spanning hosts would be taken for gone by a probe of another host's pid here).
ReplicaProcesses processes_of(const Communicator& world) {
  ReplicaProcesses p;
  p.host = this_host();
  for (const PeerInfo& peer : world.peers())
    if (peer.host == p.host) p.pids.push_back(peer.pid);
  if (p.pids.empty()) p.pids.push_back(::getpid());
  return p;
}

c10::intrusive_ptr<c10d::Store> connect_coordinator(const ElasticOptions& o,
                                                    std::chrono::milliseconds timeout) {
  const auto colon = o.coordinator.rfind(':');
  FSDP_CHECK(colon != std::string::npos && colon > 0, "elastic: the coordinator address '",
             o.coordinator, "' is not host:port (FSDP_ELASTIC_COORDINATOR)");
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(parse_env_int("FSDP_ELASTIC_COORDINATOR's port",
                                                o.coordinator.c_str() + colon + 1, 1, 65535));
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = timeout;
  try {
    auto store = compat::make_tcp_store(o.coordinator.substr(0, colon), so);
    return c10::make_intrusive<c10d::PrefixStore>("fsdp.elastic", store);
  } catch (const std::exception& e) {
    throw CommError(cat("elastic: cannot reach the coordinator at ", o.coordinator, " (", e.what(),
                        "); is fsdp-coordinator running there?"));
  }
}

}  // namespace
}  // namespace detail

using detail::Decision;

ElasticOptions ElasticOptions::from_env() {
  ElasticOptions o;
  const char* c = detail::env_value("FSDP_ELASTIC_COORDINATOR");
  FSDP_CHECK(c,
             "elastic: FSDP_ELASTIC_COORDINATOR is not set; start the replicas with "
             "`fsdp-run --replicas R`, or set it to the host:port of fsdp-coordinator");
  o.coordinator = c;
  const char* id = detail::env_value("FSDP_REPLICA_ID");
  FSDP_CHECK(id, "elastic: FSDP_REPLICA_ID is not set; give each replica its id, 0, 1, ...");
  o.replica_id = static_cast<int>(detail::parse_env_int("FSDP_REPLICA_ID", id, 0, 1 << 20));
  if (const char* m = detail::env_value("FSDP_MIN_REPLICAS"))
    o.min_replicas = static_cast<int>(detail::parse_env_int("FSDP_MIN_REPLICAS", m, 1, 1 << 20));
  if (auto s = detail::env_positive("FSDP_ELASTIC_JOIN_TIMEOUT_S", "seconds"))
    o.join_timeout = std::chrono::milliseconds(static_cast<int64_t>(*s * 1000));
  if (auto s = detail::env_positive("FSDP_ELASTIC_HEARTBEAT_TIMEOUT_S", "seconds"))
    o.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(*s * 1000));
  return o;
}

bool ElasticOptions::requested() {
  return detail::env_value("FSDP_ELASTIC_COORDINATOR") != nullptr;
}

ElasticReplicas::ElasticReplicas(std::shared_ptr<Communicator> replica, ElasticOptions options)
    : state_(std::make_unique<detail::ElasticState>()) {
  auto& s = *state_;
  FSDP_CHECK(replica, "ElasticReplicas: the replica's communicator is null");
  FSDP_CHECK(replica->backend() == "gloo", "ElasticReplicas: the replica's communicator uses ",
             replica->backend(), "; elastic replicas run on the gloo backend (CPU) for now");
  FSDP_CHECK(options.replica_id >= 0, "ElasticReplicas: replica_id must be set (>= 0)");
  s.world = std::move(replica);
  s.options = std::move(options);
  s.coordinator = detail::connect_coordinator(s.options, s.world->timeout());
  s.lane_host =
      detail::advertised_address(s.options.coordinator.substr(0, s.options.coordinator.rfind(':')));
  std::string text;
  if (s.world->rank() == 0) {
    s.membership = std::make_unique<detail::Membership>(
        s.coordinator, s.options.replica_id, detail::processes_of(*s.world), s.world->timeout(),
        s.options.heartbeat_timeout);
    // The pulse starts with the ticket (join takes it first thing), on a connection of its own.
    s.heartbeat_store = detail::connect_coordinator(s.options, s.world->timeout());
    const Decision d =
        s.membership->join(s.options.min_replicas, s.options.join_timeout, [&](int64_t ticket) {
          s.heartbeat = std::make_unique<detail::Heartbeat>(s.heartbeat_store, ticket,
                                                            std::chrono::milliseconds(250));
        });
    text = detail::cat(s.membership->ticket(), " ", d.format());
  }
  text = detail::share(s, text, s.options.join_timeout + 2 * s.world->timeout());
  const auto space = text.find(' ');
  s.ticket = std::stoll(text.substr(0, space));
  s.current = Decision::parse(text.substr(space + 1));
  s.solo = detail::solo_communicator(*s.world, false);
  s.stats.memberships = 1;
}

// Only finish() ends the job: a replica that returns from its training early (SIGTERM, a stop
// flag) must leave as a dead one does, or the survivors would find the job finished mid-training.
ElasticReplicas::~ElasticReplicas() = default;

void ElasticReplicas::finish() {
  auto& s = *state_;
  if (!s.membership) return;
  try {
    s.membership->finish();
  } catch (const std::exception&) {
    // The coordinator is gone already: nobody is left to tell.
  }
}

DeviceMesh ElasticReplicas::mesh() const {
  DeviceMesh m;
  m.world = state_->world;
  m.shard = state_->world;
  m.replicate = state_->solo;
  return m;
}

void ElasticReplicas::sync(FSDPModule& model, torch::optim::Optimizer& optimizer,
                           std::vector<int64_t>& user_state) {
  auto& s = *state_;
  if (s.bound_epoch == s.current.epoch) return;
  const auto start = detail::Clock::now();
  if (s.lane && s.lane->impl().loss->lost()) detail::retired_lanes().push_back(s.lane);
  // Every member at this membership's sync first (or one gone: then the lanes cannot connect).
  const std::string word =
      detail::share(s, s.world->rank() == 0 ? s.membership->enter(s.current) : std::string(),
                    3 * s.world->timeout());
  FSDP_CHECK(!(s.is_new && word == "finished"), "elastic: replica ", s.options.replica_id,
             " (ticket ", s.ticket,
             ") arrived after the job finished its training; nothing is left to join");
  FSDP_CHECK(word != "finished", "elastic: replica ", s.options.replica_id,
             " is still training (membership ", s.current.epoch,
             ") but another replica called finish(): the replicas disagree on the number of "
             "steps; give every replica the same step count, and call finish() only after the "
             "last committed step");
  s.lane = word == "go" ? detail::connect_lane(s, s.current) : nullptr;
  const bool connected = detail::all_connected(s, s.lane != nullptr);
  if (!connected) {
    s.lane_failure = "its lanes did not connect";
    if (s.lane) detail::retired_lanes().push_back(s.lane);
    s.lane = detail::solo_communicator(*s.world, true);
  }
  model.set_replicate_communicator(s.lane);
  s.bound_epoch = s.current.epoch;
  if (connected && s.current.source != 0) detail::copy_state(s, model, optimizer, user_state);
  if (s.is_new && s.current.source != s.ticket) {
    FSDP_CHECK(s.current.source != 0, "elastic: replica ", s.options.replica_id,
               " joined a job with no member left to copy the model's state from (every replica "
               "that held it is gone); resume the job from its last checkpoint");
    FSDP_CHECK(connected && !s.lane->impl().loss->lost(), "elastic: replica ", s.options.replica_id,
               " could not copy its state from a member (a replica was lost while it joined: ",
               connected ? s.lane->impl().loss->reason() : std::string("the lane did not connect"),
               "); restart it to join again");
  }
  s.is_new = false;
  s.stats.sync_seconds += detail::seconds_since(start);
}

bool ElasticReplicas::commit() {
  auto& s = *state_;
  FSDP_CHECK(
      s.bound_epoch == s.current.epoch, "ElasticReplicas::commit: the membership changed (",
      s.bound_epoch == 0 ? std::string("the first step") : detail::cat("to ", s.current.epoch),
      ") and sync() was not called since: call sync(model, optimizer, state) before every "
      "attempt of a step");
  const auto start = detail::Clock::now();
  const bool ok = !(s.lane && s.lane->impl().loss->lost());
  if (!ok) s.lane_failure = s.lane->impl().loss->reason();
  auto failed = at::tensor({ok ? int64_t{0} : int64_t{1}}, at::kLong);
  s.world->all_reduce(failed, ReduceOp::kSum).wait();
  std::string text;
  if (s.world->rank() == 0)
    text = s.membership->vote(s.current, s.attempt, failed.item<int64_t>() == 0).format();
  const Decision d = Decision::parse(detail::share(s, text, 3 * s.world->timeout()));
  ++s.attempt;
  FSDP_CHECK(d.index_of(s.ticket) >= 0, "elastic: replica ", s.options.replica_id,
             " was left out of membership ", d.epoch,
             ": the other replicas did not receive its vote within the timeout (",
             s.world->timeout().count() / 1000.0,
             " s) and went on without it; restart it to join again");
  // Attempts thrown away while the members stay the same (nobody died or joined): lanes that
  // never connect (replicas that cannot reach each other) would otherwise loop for ever. Every
  // member counts the same decisions, so all stop at the same attempt.
  s.fruitless = !d.commit && d.members == s.current.members ? s.fruitless + 1 : 0;
  if (s.fruitless == 0) s.lane_failure.clear();
  FSDP_CHECK(s.fruitless < detail::kMaxFruitlessAttempts, "elastic: replica ", s.options.replica_id,
             ": ", s.fruitless,
             " step attempts in a row were thrown away with the same members (replicas ",
             detail::ids_of(d), "): no replica died or joined, but the lanes between them failed (",
             s.lane_failure.empty() ? std::string("on another replica") : s.lane_failure,
             "); check that the replicas' hosts reach each other (FSDP_SOCKET_IFNAME names the "
             "interface) and FSDP_TIMEOUT_S");
  if (d.epoch != s.current.epoch) {
    s.attempt = 0;
    ++s.stats.memberships;
  }
  s.current = d;
  ++(d.commit ? s.stats.commits : s.stats.aborts);
  s.stats.vote_seconds += detail::seconds_since(start);
  return d.commit;
}

int ElasticReplicas::replica_id() const { return state_->options.replica_id; }
int64_t ElasticReplicas::epoch() const { return state_->current.epoch; }
std::vector<int> ElasticReplicas::member_ids() const {
  std::vector<int> ids;
  for (const auto& m : state_->current.members) ids.push_back(m.id);
  return ids;
}
const ElasticReplicas::Stats& ElasticReplicas::stats() const { return state_->stats; }

}  // namespace fsdp
