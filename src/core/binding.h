// Binding: a sharded module's group and the root that drives it. Handles (FSDPModule), holders
// (fsdp::Sharded), the autograd hooks (core/hooks.h) and the resharded-parameter guard refer to a
// binding, never to a group's root directly: when a parent's fully_shard absorbs the group into
// its own root, every binding below it is repointed (Registry::absorb), and their calls reach the
// new root.
//
// Ownership points down: bindings own their root and group (shared: a model lives as long as any
// handle or holder of it); the root owns its groups; nothing below refers back up. A container
// element has no holder: the binding of the nearest sharded ancestor owns it (`elements`), the
// registry until one exists.
// Thread-safety: repointed by fully_shard only, before training.
#pragma once

#include <memory>
#include <vector>

namespace fsdp::detail {

class Group;
class Root;

struct Binding {
  std::shared_ptr<Group> group;
  std::shared_ptr<Root> root;
  std::vector<std::shared_ptr<Binding>> elements;  // container elements below the module
};

}  // namespace fsdp::detail
