#include "elastic/membership.h"

#include <fsdp/error.h>

#include <algorithm>
#include <sstream>
#include <thread>

#include "comm/failure.h"

namespace fsdp::detail {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// Polls with a growing pause, 0.1 ms up to 2 ms: the votes of replicas that finished the same
// step's all-reduces together arrive within a millisecond or two, and every poll's wait is the
// step's; a check of the store costs about 0.1 ms.
class Backoff {
 public:
  void pause() {
    std::this_thread::sleep_for(std::chrono::microseconds(us_));
    us_ = std::min(us_ * 2, 2000);
  }

 private:
  int us_ = 100;
};

}  // namespace

// "commit|abort <epoch> <admitted> <source> <ticket>:<id>,<ticket>:<id>,..."
std::string Decision::format() const {
  std::ostringstream os;
  os << (commit ? "commit" : "abort") << ' ' << epoch << ' ' << admitted << ' ' << source << ' ';
  for (size_t i = 0; i < members.size(); ++i)
    os << (i ? "," : "") << members[i].ticket << ':' << members[i].id;
  return os.str();
}

Decision Decision::parse(const std::string& s) {
  std::istringstream is(s);
  std::string verdict, list;
  Decision d;
  is >> verdict >> d.epoch >> d.admitted >> d.source >> list;
  FSDP_CHECK(!is.fail() && (verdict == "commit" || verdict == "abort"),
             "elastic membership: the coordinator holds a decision this build cannot read: '", s,
             "' (every replica must run the same fsdp-cpp)");
  d.commit = verdict == "commit";
  std::istringstream ls(list);
  for (std::string item; std::getline(ls, item, ',');) {
    Member m;
    char colon = 0;
    std::istringstream ms(item);
    ms >> m.ticket >> colon >> m.id;
    FSDP_CHECK(!ms.fail() && colon == ':', "elastic membership: bad member '", item, "' in '", s,
               "'");
    d.members.push_back(m);
  }
  return d;
}

int Decision::index_of(int64_t ticket) const {
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i].ticket == ticket) return static_cast<int>(i);
  return -1;
}

Heartbeat::Heartbeat(c10::intrusive_ptr<c10d::Store> store, int64_t ticket,
                     std::chrono::milliseconds period) {
  thread_ = std::thread([this, store = std::move(store), key = cat("beat/", ticket), period] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      try {
        store->add(key, 1);
      } catch (const std::exception&) {
        // A store error (the coordinator slow, or gone): tried again next period. One failed
        // beat must not stop the pulse of a live replica; if the coordinator is gone, the votes
        // say so.
      }
      wake_.wait_for(lock, period, [this] { return stop_; });
    }
  });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

Membership::Membership(c10::intrusive_ptr<c10d::Store> store, int id, ReplicaProcesses self,
                       std::chrono::milliseconds timeout,
                       std::chrono::milliseconds heartbeat_timeout)
    : store_(std::move(store)),
      id_(id),
      self_(std::move(self)),
      timeout_(timeout),
      heartbeat_timeout_(heartbeat_timeout) {}

std::string Membership::get(const std::string& k) const { return text(store_->get(k)); }

bool Membership::stopped(int64_t ticket, Pulse& p) const {
  const auto now = Clock::now();
  if (p.read && now - p.read_at < std::chrono::milliseconds(100)) return false;  // read recently
  const int64_t beat = store_->add(cat("beat/", ticket), 0);
  if (!p.read || beat != p.beat) p.changed_at = now;
  p.read = true;
  p.read_at = now;
  p.beat = beat;
  return beat > 0 && now - p.changed_at >= heartbeat_timeout_;
}

bool Membership::all_gone(std::vector<Pulse>& pulses) const {
  if (!store_->check({"latest"})) return false;
  const Decision d = Decision::parse(get("latest"));
  if (d.members.empty()) return false;
  if (pulses.size() != d.members.size()) pulses.assign(d.members.size(), Pulse{});
  bool all = true;
  for (size_t i = 0; i < d.members.size(); ++i) {
    const int64_t t = d.members[i].ticket;
    if (!gone(t) && !stopped(t, pulses[i])) all = false;
  }
  return all;
}

bool Membership::gone(int64_t ticket) const {
  const std::string k = cat("proc/", ticket);
  if (!store_->check({k})) return false;
  std::istringstream is(get(k));
  std::string host;
  is >> host;
  if (host != this_host()) return false;  // on another host: only the timeout tells
  for (int64_t pid; is >> pid;)
    if (!process_alive(pid)) return true;
  return false;
}

std::vector<Member> Membership::waiting_joiners(int64_t admitted, int64_t* last,
                                                const std::vector<Member>& live) const {
  const int64_t n = store_->add("tickets", 0);
  std::vector<Member> out;
  *last = admitted;
  auto taken = [&](int id) -> const Member* {
    for (const Member& m : live)
      if (m.id == id) return &m;
    for (const Member& m : out)
      if (m.id == id) return &m;
    return nullptr;
  };
  for (int64_t t = admitted + 1; t <= n; ++t) {
    const std::string k = cat("ticket/", t);
    if (!store_->check({k})) break;  // taken but not yet written: the next decision's
    *last = t;
    if (gone(t)) continue;
    const int id = std::stoi(get(k));
    // Two members with one id would train one slice of the data twice: the later one is refused.
    if (const Member* twin = taken(id)) {
      store_->set(cat("refused/", t),
                  bytes(cat("replica id ", id, " belongs to a live member of the job (ticket ",
                            twin->ticket, "); each replica needs an FSDP_REPLICA_ID of its own")));
      continue;
    }
    out.push_back({t, id});
  }
  return out;
}

void Membership::publish_admissions(const Decision& before, const Decision& after) {
  const std::string text = after.format();
  // The membership now, for replicas waiting to join (join() gives up when all of it is gone).
  if (after.epoch != before.epoch) store_->set("latest", bytes(text));
  for (const Member& m : after.members)
    if (m.ticket > before.admitted) store_->set(cat("admit/", m.ticket), bytes(text));
}

Decision Membership::join(int min_replicas, std::chrono::milliseconds join_timeout,
                          const std::function<void(int64_t ticket)>& on_ticket) {
  ticket_ = store_->add("tickets", 1);
  if (on_ticket) on_ticket(ticket_);
  std::ostringstream procs;
  procs << self_.host;
  for (int64_t pid : self_.pids) procs << ' ' << pid;
  store_->set(cat("proc/", ticket_), bytes(procs.str()));
  store_->set(cat("ticket/", ticket_), bytes(std::to_string(id_)));
  const std::string mine = cat("admit/", ticket_);
  const auto deadline = Clock::now() + join_timeout;
  int64_t joined = 0;
  const std::string refused = cat("refused/", ticket_);
  std::vector<Pulse> pulses;  // of the latest membership's members, while this one waits
  for (Backoff b;; b.pause()) {
    if (store_->check({mine})) return Decision::parse(get(mine));
    FSDP_CHECK(!store_->check({refused}), "elastic: replica ", id_, " (ticket ", ticket_,
               ") was refused: ", get(refused));
    if (!store_->check({"formed"})) {
      int64_t last = 0;
      auto first = waiting_joiners(0, &last, {});
      joined = static_cast<int64_t>(first.size());
      if (joined >= min_replicas) {
        Decision d;
        d.epoch = 1;
        d.members = std::move(first);
        d.admitted = last;
        d.source = d.members.front().ticket;
        const Decision formed =
            Decision::parse(text(store_->compareSet("formed", {}, bytes(d.format()))));
        publish_admissions(Decision{}, formed);
        continue;
      }
    }
    FSDP_CHECK(!store_->check({"finished"}), "elastic: replica ", id_, " (ticket ", ticket_,
               ") arrived after the job finished its training; nothing is left to join");
    FSDP_CHECK(!all_gone(pulses), "elastic: replica ", id_, " (ticket ", ticket_,
               ") has nothing to join: every member of the job is gone (their processes exited "
               "or their heartbeats stopped), so no replica holds the model's state; restart the "
               "whole job");
    if (Clock::now() < deadline) continue;
    const bool formed = store_->check({"formed"});
    throw Error(
        cat("elastic: replica ", id_, " (ticket ", ticket_, ") was not admitted to the job within ",
            join_timeout.count() / 1000.0, " s: ",
            formed ? std::string("the running replicas did not finish a step in that time (a step "
                                 "longer than that needs a longer FSDP_ELASTIC_JOIN_TIMEOUT_S)")
                   : cat(joined, " of the ", min_replicas,
                         " replicas needed to start the job have joined; start the others or lower "
                         "FSDP_MIN_REPLICAS")));
  }
}

void Membership::finish() { store_->set("finished", bytes("1")); }

std::string Membership::enter(const Decision& d) {
  const std::string at = cat("e", d.epoch, "/entered/");
  store_->set(cat(at, ticket_), bytes("1"));
  std::vector<bool> in(d.members.size(), false);
  std::vector<Pulse> pulses(d.members.size());
  const auto deadline = Clock::now() + timeout_;
  for (Backoff b;; b.pause()) {
    if (store_->check({"finished"})) return "finished";
    bool all = true;
    for (size_t i = 0; i < in.size(); ++i) {
      if (in[i]) continue;
      const int64_t t = d.members[i].ticket;
      if (store_->check({cat(at, t)})) {
        in[i] = true;
        continue;
      }
      if (gone(t) || stopped(t, pulses[i])) return "missing";
      all = false;
    }
    if (all) return "go";
    if (Clock::now() >= deadline) return "missing";
  }
}

Decision Membership::vote(const Decision& now, int64_t attempt, bool ok) {
  const std::string at = cat("e", now.epoch, "/a", attempt, "/");
  store_->set(cat(at, "vote/", ticket_), bytes(ok ? "1" : "0"));
  // Each member's vote: -1 not yet seen, 0 not ok, 1 ok, 2 its processes are gone.
  std::vector<int> seen(now.members.size(), -1);
  std::vector<Pulse> pulses(now.members.size());
  const auto deadline = Clock::now() + timeout_;
  const std::string decided = at + "decision";
  for (Backoff b;; b.pause()) {
    if (store_->check({decided})) break;  // another leader decided first
    bool pending = false;
    for (size_t i = 0; i < seen.size(); ++i) {
      if (seen[i] != -1) continue;
      const std::string k = cat(at, "vote/", now.members[i].ticket);
      if (store_->check({k}))
        seen[i] = get(k) == "1" ? 1 : 0;
      else if (gone(now.members[i].ticket) || stopped(now.members[i].ticket, pulses[i]))
        seen[i] = 2;
      else
        pending = true;
    }
    if (!pending || Clock::now() >= deadline) break;
  }
  Decision d;
  if (!store_->check({decided})) {
    d.commit = std::all_of(seen.begin(), seen.end(), [](int v) { return v == 1; });
    for (size_t i = 0; i < seen.size(); ++i)
      if (seen[i] == 0 || seen[i] == 1) d.members.push_back(now.members[i]);
    const int64_t source = d.members.empty() ? 0 : d.members.front().ticket;
    const auto joiners = waiting_joiners(now.admitted, &d.admitted, d.members);
    d.members.insert(d.members.end(), joiners.begin(), joiners.end());
    // A lost lane must be rebuilt even over the same members: any abort opens a new epoch.
    d.epoch = d.commit && d.members == now.members ? now.epoch : now.epoch + 1;
    d.source = joiners.empty() ? 0 : source;
  }
  const Decision out = Decision::parse(text(store_->compareSet(decided, {}, bytes(d.format()))));
  publish_admissions(now, out);
  forget_old(at, now);
  return out;
}

void Membership::forget_old(const std::string& attempt_keys, const Decision& voted_on) {
  Voted now{attempt_keys, voted_on.epoch, {}};
  for (const auto& m : voted_on.members) now.tickets.push_back(m.ticket);
  spent_.push_back(std::move(now));
  if (spent_.size() <= 2) return;
  const Voted old = std::move(spent_.front());
  spent_.pop_front();
  // Its sync keys too once its epoch has ended (they are read while the epoch is entered).
  const bool epoch_ended = old.epoch != voted_on.epoch;
  for (int64_t t : old.tickets) {
    try {
      store_->deleteKey(cat(old.attempt, "vote/", t));
      if (epoch_ended) store_->deleteKey(cat("e", old.epoch, "/entered/", t));
    } catch (const std::exception&) {
      // A coordinator that cannot delete is no worse off than before: the keys stay.
    }
  }
}

}  // namespace fsdp::detail
