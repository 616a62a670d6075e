#include <fsdp/error.h>
#include <fsdp/mesh.h>

namespace fsdp {

DeviceMesh init_mesh(std::shared_ptr<Communicator> world, int replicas) {
  FSDP_CHECK(world != nullptr,
             "init_mesh: the world communicator is null (call "
             "init_process_group first)");
  const int n = world->size();
  FSDP_CHECK(replicas >= 1 && n % replicas == 0, "init_mesh: ", replicas,
             " replicas do not divide the world of ", n,
             " ranks; choose a divisor of the world size (1 = plain FSDP)");
  DeviceMesh mesh;
  mesh.world = world;
  mesh.replicas = replicas;
  if (replicas == 1) {
    mesh.shard = world;
    return mesh;
  }
  const int s = n / replicas;
  const int me = world->rank();
  // Every rank creates the subgroups it belongs to in the same order: its replica, then its
  // shard position's replicate group.
  std::vector<int> shard_ranks, replicate_ranks;
  for (int i = 0; i < s; ++i) shard_ranks.push_back((me / s) * s + i);
  for (int j = 0; j < replicas; ++j) replicate_ranks.push_back(j * s + me % s);
  mesh.shard = world->subgroup("shard", shard_ranks);
  mesh.replicate = world->subgroup("replicate", replicate_ranks);
  return mesh;
}

}  // namespace fsdp
