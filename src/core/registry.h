// Registry: which group manages each sharded module and parameter, process-wide, and the one owner
// of registration. fully_shard claims a module's parameters here, absorbs the groups of its sharded
// descendants into the new root's context, and registers the new group. Weak references keyed by
// identity: models and ranks in one process do not interfere, and entries die with their groups.
// The groups of container elements (fsdp/containers.h), which no holder owns, are kept here until
// a sharded ancestor adopts them.
// Thread-safety: every method takes the registry's mutex; none runs a collective.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/options.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "util/mutex.h"

namespace fsdp {
class Communicator;
}  // namespace fsdp

namespace fsdp::detail {

class Context;
class Group;

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// A module's descendants by path, in the model's own module order: pointer order differs between
// processes, and the group order must be the same on every rank.
struct ModulePaths {
  std::map<const torch::nn::Module*, std::string> path_of;
  std::vector<const torch::nn::Module*> order;
};
ModulePaths module_paths(const torch::nn::Module& module);

class Registry {
 public:
  static Registry& instance();

  bool is_sharded(const torch::nn::Module& module);
  // The group that manages `param`, or null.
  std::shared_ptr<Group> group_of(const at::Tensor& param);

  // The parameters a fully_shard call on `module` manages: those no sharded descendant owns, each
  // once (a parameter tied within the group counts once). A parameter shared with another group,
  // or a module sharded after its parent, is an error naming both.
  // ignored_params (checked to be parameters of `module` that no sharded descendant manages) and
  // those a descendant ignored are left out.
  NamedTensors claim_parameters(const torch::nn::Module& module, const ModulePaths& paths,
                                const std::vector<at::Tensor>& ignored_params);
  // A new context holding every group registered on a descendant (with everything their contexts
  // held), renamed by their path under the module.
  std::shared_ptr<Context> absorb_children(const ModulePaths& paths,
                                           const std::shared_ptr<Communicator>& comm,
                                           const std::shared_ptr<Communicator>& replicate,
                                           const ShardOptions& options);
  // Registers `group` for its module and parameters; it adopts the container elements below its
  // module that no sharded ancestor owned yet, and is kept here itself when it gathers on use.
  void add(const std::shared_ptr<Group>& group);
  // The buffers of `module` that no sharded descendant holds, with values (not pending under
  // deferred_init).
  NamedTensors own_buffers(const torch::nn::Module& module, const ModulePaths& paths);

 private:
  template <class K>
  using Index = std::unordered_map<const K*, std::weak_ptr<Group>>;
  template <class K>
  static std::shared_ptr<Group> find(Index<K>& index, const K* key);
  void adopt_elements(Group& group) FSDP_REQUIRES(mu_);
  void check_ignored(const torch::nn::Module& module, const ModulePaths& paths,
                     const std::vector<at::Tensor>& ignored_params) FSDP_REQUIRES(mu_);

  Mutex mu_;
  Index<torch::nn::Module> modules_ FSDP_GUARDED_BY(mu_);
  Index<c10::TensorImpl> params_ FSDP_GUARDED_BY(mu_);
  Index<c10::TensorImpl> ignored_ FSDP_GUARDED_BY(mu_);  // by the group that ignored them
  std::vector<std::shared_ptr<Group>> unowned_elements_ FSDP_GUARDED_BY(mu_);
};

}  // namespace fsdp::detail
