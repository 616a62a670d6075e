// Membership: which replicas make up an elastic job (fsdp/elastic.h), decided in the
// coordinator's store with c10d's atomic primitives (add, compareSet) and nothing else.
//
// A replica takes part through its leader (its rank 0), which speaks for it here. Identities are
// join tickets (the store's counter): a replica restarted under the same id is a new member with
// a new ticket, so an old incarnation still listed can never be mistaken for the new one.
//
// Two decisions, each made once by the first leader to propose it (compareSet on an empty key;
// every leader reads the same outcome):
//  - formation: the first `min_replicas` tickets form the job (epoch 1);
//  - each attempt of each step: every member leader votes ok (its ranks' collectives across
//    replicas all completed) or not; the attempt commits when every member voted ok, and aborts
//    otherwise (a member whose vote did not come within the timeout, whose process is gone, or
//    whose heartbeat stopped, is left out). The decision also admits the replicas waiting to join;
//    a changed membership opens a new epoch.
// Internal to src/elastic. Thread-safety: one thread per object.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

namespace fsdp::detail {

struct Member {
  int64_t ticket = 0;  // identity: the join ticket
  int id = 0;          // the replica id it runs as (its data slot)
  bool operator==(const Member& o) const { return ticket == o.ticket && id == o.id; }
};

struct Decision {
  bool commit = true;           // the attempt's gradients stand (formation: true)
  int64_t epoch = 0;            // the membership's epoch from this decision on
  std::vector<Member> members;  // by ticket, ascending; a member's lane rank is its index
  int64_t admitted = 0;         // every ticket up to this one has been decided on
  int64_t source = 0;           // ticket of the member whose state new members copy; 0: none new

  std::string format() const;
  static Decision parse(const std::string& s);  // throws fsdp::Error naming the text
  int index_of(int64_t ticket) const;           // -1 when not a member
};

// One replica's processes, as its leader publishes them: a member whose process on this host is
// gone is not waited for.
struct ReplicaProcesses {
  std::string host;
  std::vector<int64_t> pids;
};

// A replica leader's pulse: a counter in the store ("beat/<ticket>") raised every `period` from a
// thread of its own, on a store client of its own, so that a step's computation never delays it.
// A member whose pulse stops (its process dead or hung, on any host) is left out of a vote after
// the heartbeat timeout instead of the whole collective timeout. Stops with the object; a beat that
// fails (the coordinator slow or gone) is tried again the next period.
class Heartbeat {
 public:
  Heartbeat(c10::intrusive_ptr<c10d::Store> store, int64_t ticket,
            std::chrono::milliseconds period);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

class Membership {
 public:
  // `heartbeat_timeout`: how long a member's pulse may stand still before a vote leaves it out
  // (members that never beat are waited for until `timeout`).
  Membership(c10::intrusive_ptr<c10d::Store> store, int id, ReplicaProcesses self,
             std::chrono::milliseconds timeout,
             std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(5));

  // Takes a ticket and waits, at most `join_timeout`, for the decision that admits it: the
  // formation when no job runs yet (once `min_replicas` replicas have tickets), else a step's.
  // `on_ticket` runs once the ticket is taken (the leader starts its heartbeat).
  Decision join(int min_replicas, std::chrono::milliseconds join_timeout,
                const std::function<void(int64_t ticket)>& on_ticket = nullptr);
  // The vote on attempt `attempt` of the current membership `now` (every member leader calls it
  // with the same two): returns the decision, this replica among its members or not.
  Decision vote(const Decision& now, int64_t attempt, bool ok);

  // This replica reached the sync of membership `d` (ElasticReplicas::sync); waits until every
  // member has: "go" then, "missing" when a member's processes are gone, its heartbeat stopped
  // or the timeout passed (its lanes would not connect), "finished" when a replica finished the
  // job's training meanwhile.
  std::string enter(const Decision& d);

  // This replica finished its training: the job is over for replicas still waiting to join.
  void finish();

  int64_t ticket() const { return ticket_; }

 private:
  // The replicas waiting to join after ticket `admitted` (`last`: the last ticket decided on),
  // but for those whose processes are gone and those whose id a `live` member or an earlier one
  // of them has (refused: told so under "refused/<ticket>").
  std::vector<Member> waiting_joiners(int64_t admitted, int64_t* last,
                                      const std::vector<Member>& live) const;
  bool gone(int64_t ticket) const;  // its processes on this host are gone
  // What a vote saw of a member's heartbeat.
  struct Pulse {
    bool read = false;
    int64_t beat = 0;
    std::chrono::steady_clock::time_point read_at, changed_at;
  };
  // Its heartbeat has beaten, then stood still for the heartbeat timeout (read at most every
  // 100 ms).
  bool stopped(int64_t ticket, Pulse& p) const;
  // Every member of the latest membership is gone or stopped (`pulses`: kept across calls).
  bool all_gone(std::vector<Pulse>& pulses) const;
  void publish_admissions(const Decision& before, const Decision& after);
  std::string get(const std::string& k) const;
  // Deletes the votes this leader took part in two decisions ago, and the sync keys of epochs
  // that ended: nobody reads them again (a leader reads an attempt's votes only while it has no
  // decision, and each decision stays). The decisions themselves stay (one short key per step
  // attempt): a leader that hung and resumes must find the decision that left it out, not an
  // empty key it could fill with a membership of its own.
  void forget_old(const std::string& attempt_keys, const Decision& voted_on);

  c10::intrusive_ptr<c10d::Store> store_;
  int id_;
  ReplicaProcesses self_;
  std::chrono::milliseconds timeout_, heartbeat_timeout_;
  int64_t ticket_ = 0;
  struct Voted {          // a vote this leader took part in
    std::string attempt;  // its keys' prefix, "e<epoch>/a<attempt>/"
    int64_t epoch = 0;
    std::vector<int64_t> tickets;  // the members voting
  };
  std::deque<Voted> spent_;  // the recent ones, oldest first
};

}  // namespace fsdp::detail
