// Elastic replicas: HSDP training that survives the loss of a whole replica.
//
// Each replica (the S ranks that shard the model among themselves) is its own job, with its own
// rendezvous; the replicas meet in a coordinator, a c10d TCPStore served by a process of its own
// (fsdp-coordinator, which `fsdp-run --replicas R` starts). The ranks at the same shard position
// across the replicas form the replicate lane that averages gradients, rebuilt for every new
// membership.
//
// When a replica dies (any of its ranks: its shards are then lost, so the whole replica is), the
// step in flight is thrown away everywhere and run again by the survivors over the new membership:
// no committed step is lost, no checkpoint is read, and the gradient mean is over the survivors. A
// replica started later (restarted by the launcher, or by hand with the same variables) joins at
// the next step boundary and copies its shards, buffers and optimizer state from a survivor
// before training with the others. See docs/elastic.md for the failure model: what is survived
// and what is not.
//
//   fsdp::ElasticReplicas replicas(world, fsdp::ElasticOptions::from_env());
//   auto model = ...; auto root = fsdp::fully_shard(model, replicas.mesh());
//   torch::optim::AdamW opt(root.parameters(), ...);
//   std::vector<int64_t> state{0};  // what a new replica must copy: here, the step
//   while (state[0] < steps) {
//     replicas.sync(root, opt, state);             // new membership: lanes rebound, state copied
//     loss_of(batch(state[0], replicas.replica_id())).backward();
//     if (replicas.commit()) { opt.step(); ++state[0]; }
//     opt.zero_grad();                              // committed or thrown away
//   }
//   replicas.finish();                              // the training is done
//
// Thread-safety: one thread per rank, the one that trains.
#pragma once

#include <fsdp/communicator.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

struct ElasticOptions {
  std::string coordinator;  // "host:port" of the coordinator's store
  int replica_id = -1;      // this replica's id, 0..: its data slot, kept across restarts
  int min_replicas = 1;     // replicas that must have joined before the job starts
  // How long a replica waits to be admitted (the others finishing their step, or the job's
  // first replicas arriving).
  std::chrono::milliseconds join_timeout{std::chrono::minutes(10)};
  // How long a replica's heartbeat (its rank 0 raises a counter in the coordinator every 0.25 s,
  // from a thread of its own) may stand still before a step's vote goes on without it: a replica
  // dead or hung on another host is left out after this, not after the collective timeout.
  std::chrono::milliseconds heartbeat_timeout{std::chrono::seconds(5)};

  // From FSDP_ELASTIC_COORDINATOR, FSDP_REPLICA_ID, FSDP_MIN_REPLICAS (default 1),
  // FSDP_ELASTIC_JOIN_TIMEOUT_S (default 600) and FSDP_ELASTIC_HEARTBEAT_TIMEOUT_S (default 5),
  // the first three as `fsdp-run --replicas` sets them. Throws
  // fsdp::Error naming a variable that is missing or malformed.
  static ElasticOptions from_env();
  // Whether FSDP_ELASTIC_COORDINATOR is set.
  static bool requested();
};

namespace detail {
struct ElasticState;
}

class ElasticReplicas {
 public:
  // Collective over `replica` (this replica's ranks, which shard the model): connects to the
  // coordinator and waits until the job admits this replica (at its formation, or at a step
  // boundary of the running replicas).
  ElasticReplicas(std::shared_ptr<Communicator> replica, ElasticOptions options);
  ~ElasticReplicas();
  ElasticReplicas(const ElasticReplicas&) = delete;
  ElasticReplicas& operator=(const ElasticReplicas&) = delete;

  // The mesh to shard the model over: shard = this replica; replicate = a one-rank stand-in until
  // sync() binds the membership's lanes.
  DeviceMesh mesh() const;

  // Before every attempt of a step: when the membership changed since the last call (always at
  // the first), binds its replicate lanes to `model` and, when it gained replicas, copies a
  // surviving replica's state to them: the model's shards and buffers, `optimizer`'s state and
  // `user_state` (whatever else a new replica needs: the step, the data position). Collective
  // over the replica and the membership; cheap when nothing changed.
  void sync(FSDPModule& model, torch::optim::Optimizer& optimizer,
            std::vector<int64_t>& user_state);

  // After the step's backward (all micro-batches), before the optimizer step: true when every
  // member's gradients were averaged over the whole membership (step the optimizer); false when
  // the membership changed during the step (throw the gradients away, sync(), run it again).
  // Throws fsdp::Error when this replica was left out of the membership (it reached the vote
  // after the others gave up on it): restart it to rejoin.
  bool commit();

  // After the last committed step: the job's training is done, and replicas still waiting to join
  // are told so (they stop by name instead of waiting out their join timeout). A replica that
  // ends otherwise (stopped by a signal, failed) must not call it: the others go on without it.
  // Rank 0 of the replica tells the coordinator; a coordinator gone already is ignored.
  void finish();

  int replica_id() const;
  int64_t epoch() const;                // the membership's number: 1 at the job's formation
  std::vector<int> member_ids() const;  // the members' replica ids, by join order
  struct Stats {
    int64_t commits = 0, aborts = 0, memberships = 0;
    double vote_seconds = 0, sync_seconds = 0;  // time spent in commit() and sync()
  };
  const Stats& stats() const;

 private:
  std::unique_ptr<detail::ElasticState> state_;
};

}  // namespace fsdp
