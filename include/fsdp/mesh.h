// DeviceMesh: HSDP's 2-D layout of the world, replicas x shards (FSDP2's fully_shard(mesh=2-D)).
//
// World rank r sits in replica r / S at shard position r % S (S = shards per replica): each
// replica is S consecutive ranks that shard the model among themselves (all-gather and
// reduce-scatter within it), and the ranks at the same shard position across replicas hold equal
// shards, whose gradients are all-reduced (averaged) after the reduce-scatter.
// Thread-safety: build on every rank from the same thread that uses the world.
#pragma once

#include <fsdp/communicator.h>

#include <memory>

namespace fsdp {

struct DeviceMesh {
  std::shared_ptr<Communicator> world;
  std::shared_ptr<Communicator> shard;      // this rank's replica: the S ranks sharding the model
  std::shared_ptr<Communicator> replicate;  // the R ranks at this shard position; null when R = 1
  int replicas = 1;

  int shards() const { return shard ? shard->size() : 0; }
  int replica_index() const { return world ? world->rank() / shards() : 0; }
};

// Splits `world` into `replicas` replicas of world->size() / replicas ranks each. Collective over
// the world: every rank calls it with the same value. replicas = 1 is plain FSDP (shard = world).
DeviceMesh init_mesh(std::shared_ptr<Communicator> world, int replicas);

}  // namespace fsdp
